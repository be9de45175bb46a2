"""launch/bench.py: a smoke run on tiny (fsdp, both twins) through the launcher's main, and its input errors.

Not a timed test: it checks that every field is written and is consistent, that the
model FLOPs are the hand count, and that the manual twin's collectives equal the cost
model exactly (ledger bytes / model bytes == 1.0, every (op, axes) row matching).
"""

import importlib.util
import json
import math
import pathlib

import jax
import numpy as np
import pytest
from absl import flags

from launch import bench, common
from twinshard.hardware import chips
from twinshard.hardware.measure import p25

FLAGS = flags.FLAGS


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    FLAGS.unparse_flags()
    FLAGS(["bench", "--preset=tiny", "--strategies=fsdp", "--impls=auto,manual", "--steps=2", "--warmup=1",
           "--matmul_size=128", "--matmul_reps=2", f"--json={out / 'b.json'}", f"--markdown={out / 'b.md'}"])
    try:
        bench.main(["bench"])
    finally:
        FLAGS.unparse_flags()
    with open(out / "b.json") as f:
        result = json.load(f)
    result["_markdown"] = (out / "b.md").read_text()
    return result


@pytest.mark.parametrize("times", [[1.0, 6.0], [0.01, 0.5], [2.0], [1.0, 2.0, 3.0, 10.0], [3.0, 1.0, 2.0]])
def test_the_peak_time_is_a_percentile_within_the_samples(times):
    # A CI run (2 reps, one disturbed) got a negative peak from statistics.quantiles' default
    assert min(times) <= p25(times) <= max(times)
    assert p25(times) == pytest.approx(np.percentile(times, 25))  # linear interpolation


def test_the_matmul_peak_counts_two_flops_a_multiply_add(doc):
    """The recorded peak is an [n, n] x [n, n] matmul's 2 n^3 FLOPs (a multiply and an add each) over the
    25th-percentile time of its samples, and over their median beside it."""
    peak = doc["peaks"]["float32"]
    n, times = peak["n"], peak["times_s"]
    assert len(times) == peak["reps"] and peak["p25_s"] == p25(times) and peak["median_s"] == np.median(times)
    assert peak["flops_per_s"] * peak["p25_s"] == pytest.approx(2 * n**3)
    assert peak["flops_per_s_median"] * peak["median_s"] == pytest.approx(2 * n**3)


def test_writes_every_field(doc):
    env = doc["environment"]
    assert env["cpu_count"] >= 1 and len(env["load_avg_before"]) == 3 and len(env["load_avg_after"]) == 3
    assert env["backend"] == "cpu" and env["device_count"] == 8
    assert doc["peaks"]["float32"]["n"] == 128 and doc["peaks"]["float32"]["flops_per_s"] > 0
    assert [r["run"] for r in doc["runs"]] == ["fsdp/auto", "fsdp/manual"]
    for r in doc["runs"]:
        assert r["mesh"] == {"data": 8, "tensor": 1} and r["n_devices"] == 8
        assert r["lower_s"] > 0 and r["compile_s"] > 0 and r["init"]["wall_s"] > 0
        assert r["init"]["compile_s"] > 0  # the init really compiled (the monitoring events were heard)
        assert len(r["step_s"]["all"]) == 2 and r["step_s"]["min"] <= r["step_s"]["median"] <= r["step_s"]["max"]
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["step_s"]["median"])
        assert math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"]) and r["profile"] is None
        assert r["memory"]["xla"]["peak_estimate"] > 0 and r["memory"]["model"]["total"] > 0
        assert 0 < r["fraction_of_measured_peak"]
        # 8 simulated devices share this one machine: MFU over one machine's measured peak, not 8 of them
        assert r["peak"] == {"dtype": "float32", "flops_per_s": doc["peaks"]["float32"]["flops_per_s"]}
        assert r["fraction_of_measured_peak"] == pytest.approx(r["model_flops_per_s"] / r["peak"]["flops_per_s"])
    md = doc["_markdown"]
    assert "| fsdp/manual | data:8,tensor:1 |" in md and "--preset=tiny" in doc["command"]


def test_mfu_divides_by_one_machines_peak_on_a_cpu_and_by_every_chips_on_a_tpu():
    """add_ratios by hand: 8 simulated CPU devices at 3 GFLOP/s of model FLOPs over the machine's measured
    5 GFLOP/s f32 peak (a bfloat16 model too: the CPU measured no bf16 peak) is 0.6; 4 v5e chips at 400
    TFLOP/s over 4 x the one chip's measured 150 TFLOP/s bf16 peak is 2/3, over 4 x its nominal 197 TFLOP/s
    400/788."""
    for dtype in ("float32", "bfloat16"):
        cpu = {"n_devices": 8, "model_flops_per_s": 3e9}
        bench.add_ratios(cpu, None, {"float32": {"flops_per_s": 5e9}}, None, "cpu", dtype)
        assert cpu["peak"] == {"dtype": "float32", "flops_per_s": 5e9} and cpu["fraction_of_measured_peak"] == 0.6
        assert "mfu_nominal" not in cpu
    tpu = {"n_devices": 4, "model_flops_per_s": 4e14}
    peaks = {"float32": {"flops_per_s": 1e14}, "bfloat16": {"flops_per_s": 1.5e14}}
    bench.add_ratios(tpu, None, peaks, chips.chip("v5e"), "tpu", "bfloat16")
    assert tpu["peak"] == {"dtype": "bfloat16", "flops_per_s": 6e14}
    assert tpu["fraction_of_measured_peak"] == pytest.approx(2 / 3)
    assert tpu["mfu_nominal"] == pytest.approx(400 / 788)


def test_model_flops_are_the_hand_count(doc):
    # tiny: V=384 (257 padded), D=64, F=192, L=2, H*dh=64, B=8, T=32.
    # matmul params N_mm = L(4 D^2 + 3 D F) + D V = 2(16384 + 36864) + 24576 = 131072
    # forward = 2 B T N_mm + L * 4 B T^2 D = 67108864 + 4194304; a step is 3 forwards; MFU's
    # FLOPs count causal attention half: 3 * (67108864 + 4194304 / 2).
    assert all(r["model_flops_per_step"] == 3 * (67108864 + 2097152) for r in doc["runs"])
    assert "(causal attention counted half)" in doc["_markdown"]


def test_manual_twin_moves_exactly_the_cost_models_bytes(doc):
    manual = doc["runs"][1]["collectives"]
    assert manual["bytes_ratio"] == 1.0 and manual["rows_match"] and manual["unparsed"] == 0
    # tiny has 7L+2 = 16 matrices: 16 forward + 15 backward gathers (the embedding is not re-gathered),
    # 16 reduce-scatters (per layer inside the scanned stack, counted x L); the norm gains are 3 leaves
    # (ln1, ln2 stacked [L, D], ln_final): 3 gradient all-reduces; the grad-norm and loss all-reduces.
    assert manual["ledger_count"] == manual["model_count"] == 16 + 15 + 16 + 3 + 1 + 1
    auto = doc["runs"][0]["collectives"]
    assert auto["ledger_bytes"] > 0 and auto["model_bytes"] == manual["model_bytes"]


def test_grad_accum_runs_micro_batches(tmp_path):
    """--grad_accum=2 on one device: the step runs 2 micro-batches of 4 (the cost model counts the
    float32 accumulator), and the record and the Markdown say so; 3 does not split the batch of 8."""
    FLAGS.unparse_flags()
    FLAGS(["bench", "--preset=tiny", "--strategies=single", "--grad_accum=2", "--steps=1", "--warmup=0",
           "--matmul_size=64", "--matmul_reps=1", f"--json={tmp_path / 'b.json'}"])
    try:
        assert bench.main(["bench"]) == 0
        FLAGS["grad_accum"].value = 3
        with pytest.raises(ValueError, match="grad_accum=3"):
            bench.config_from_flags()
    finally:
        FLAGS.unparse_flags()
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["grad_accum"] == 2 and "--grad_accum=2" in doc["command"]
    run = doc["runs"][0]
    assert run["memory"]["model"]["accumulator"] > 0 and math.isfinite(run["loss_first"])
    assert "batch 8x32 in 2 micro-batches" in bench.markdown(doc)


def test_the_recorded_command_holds_every_flag_the_bench_defines(monkeypatch):
    """bench.argv_flags (the command the record keeps to rerun it) serializes the given flags among
    BENCH_FLAGS, so BENCH_FLAGS must be every flag launch/bench.py defines: each changes what runs (the
    model, the train config, the meshes, the memory check) or what is written. The defined set is read
    from absl: running bench.py's top level again under another program name registers each flag it
    defines (its own and common's define_*_flags) as a key flag of that name (common.define)."""
    program = "bench_flags_of_this_test"
    spec = importlib.util.spec_from_file_location("bench_again", bench.__file__)
    monkeypatch.setattr("sys.argv", [program])
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    defined = {f.name for f in FLAGS.get_key_flags_for_module(program)}
    assert {"preset", "grad_accum", "grad_accum_dtype", "dcn_mesh", "d_model"} <= defined  # the reading reads them
    assert sorted(bench.BENCH_FLAGS) == sorted(defined)


# A benchmark document written by hand, every field a different value, so a cell that reads the wrong field
# or formats it wrongly shows: the second run has no single-device baseline, no XLA memory figure, no ledger.
REPORT_DOC = {
    "environment": {"backend": "tpu", "device_kind": "TPU v5 lite", "device_count": 4, "cpus_usable": 3, "cpu_count": 5,
                    "load_avg_before": [0.5, 1.25, 2.0], "load_avg_after": [3.0, 4.5, 6.25], "jax": "0.12.0",
                    "flax": "0.11.1", "git_commit": "abc1234", "time_utc": "2026-12-07 03:00"},
    "model": {"d_model": 96, "num_layers": 3, "num_heads": 6, "num_kv_heads": 2, "d_ff": 320, "vocab_size": 512},
    "preset": "tiny", "batch_size": 10, "seq_len": 48, "grad_accum": 5, "dtype": "bfloat16",
    "command": "python -m launch.bench --preset=tiny", "steps": 7, "warmup": 2,
    "fast_path": ["fast path on tpu v5e: remat=none (fits)"],
    "peaks": {"bfloat16": {"n": 1024, "flops_per_s": 1.5e14, "reps": 9, "flops_per_s_after": 1.25e14}},
    "chip": {"name": "v5e", "bf16": 197, "tf32": 131, "fp32": 98, "source": "the datasheet"},
    "runs": [{"run": "fsdp/manual", "mesh": {"data": 2, "tensor": 2}, "lower_s": 1.25, "compile_s": 3.5,
              "vs_single": {"compile_time": 1.75, "step_time": 0.6}, "init": {"wall_s": 7.25, "compile_s": 6.5},
              "step_s": {"median": 0.0125, "min": 0.01, "max": 0.015}, "tokens_per_s": 54321.4,
              "model_flops_per_s": 2.5e12, "fraction_of_measured_peak": 0.375, "mfu_nominal": 0.125,
              "memory": {"xla": {"peak_estimate": 3 * 2 ** 20}, "model": {"total": 5.5 * 2 ** 20}},
              "collectives": {"bytes_ratio": 0.875, "rows_match": False}},
             {"run": "single", "mesh": {}, "lower_s": 0.5, "compile_s": 2.0, "init": {"wall_s": 4.0, "compile_s": 3.0},
              "step_s": {"median": 0.02, "min": 0.0195, "max": 0.0215}, "tokens_per_s": 24000.0,
              "model_flops_per_s": 8.5e9, "fraction_of_measured_peak": 0.07, "mfu_nominal": None,
              "memory": {"xla": None, "model": {"total": 2 ** 20}}, "collectives": None}],
}


def test_the_report_draws_each_cell_from_its_own_field():
    """launch.bench's Markdown section and summary lines of REPORT_DOC, cell by cell against the values
    written by hand."""
    head = ("run", "mesh", "lower s", "compile s", "compile / single", "init s (XLA compile)", "step ms (min-max)",
            "tokens/s", "step / single", "model FLOP/s (causal attention counted half)", "% of peak",
            "mem/dev MiB: XLA / model", "ledger/model bytes")
    rows = [("fsdp/manual", "data:2,tensor:2", "1.25", "3.50", "1.75", "7.25 (6.50)", "12.5 (10.0-15.0)", "54,321",
             "0.60", "2.5 TFLOP/s", "37.5 (MFU 12.5)", "3.0 / 5.5", "0.875 (rows differ)"),
            ("single", "1 device", "0.50", "2.00", "-", "4.00 (3.00)", "20.0 (19.5-21.5)", "24,000", "-",
             "8.5 GFLOP/s", "7.0", "- / 1.0", "-")]
    want = ["### tiny on TPU v5 lite: batch 10x48 in 5 micro-batches, bfloat16", "",
            "`python -m launch.bench --preset=tiny`", "",
            "- model: d_model 96, 3 layers, 6 heads (2 key/value), d_ff 320, vocab 512; 7 timed steps after 2 warm-up",
            "- machine: tpu (TPU v5 lite), 4 device(s), 3 usable CPUs of 5, load avg 0.50/1.25/2.00 before / "
            "3.00/4.50/6.25 after; jax 0.12.0, flax 0.11.1, commit abc1234, 2026-12-07 03:00 UTC",
            "- fast path on tpu v5e: remat=none (fits)",
            "- measured matmul peak bfloat16 1024^3: 150 TFLOP/s (25th percentile time of 9, before the runs: "
            "'% of peak' uses it; 125 TFLOP/s after the runs)",
            "- nominal v5e: bf16 197 TFLOP/s, tf32 131, fp32 98 (the datasheet)", "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    assert bench.markdown(REPORT_DOC).splitlines() == want
    manual, single = REPORT_DOC["runs"]
    assert bench.summary_line(manual) == (
        "fsdp/manual      compile   3.50s  init   7.25s  step     12.5 ms     54,321 tok/s    2.5 TFLOP/s   37.5% "
        "of peak (causal attention counted half)  ledger/model bytes 0.875")
    assert bench.summary_line(single) == (
        "single           compile   2.00s  init   4.00s  step     20.0 ms     24,000 tok/s    8.5 GFLOP/s    7.0% "
        "of peak (causal attention counted half)")


def test_bad_input_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="'tp' is not one of the benchmarked strategies"):
        bench.parse_meshes("fsdp=data:8,tensor:1;tp=data:1,tensor:8", ["single", "fsdp"])
    assert bench.parse_meshes("data:2,tensor:4", ["single", "fsdp_tp"]) == {"fsdp_tp": "data:2,tensor:4"}
    with pytest.raises(ValueError, match="--json=.*does not exist"):
        common.check_output_path(str(tmp_path / "missing" / "b.json"), "json")
    with pytest.raises(ValueError, match="--strategies=single,pp: choose from"):
        bench.check_choices(["single", "pp"], ["auto"])
    (tmp_path / "old" / "single").mkdir(parents=True)  # a trace already there: neither overwritten nor read twice
    with pytest.raises(ValueError, match="--profile=.*old: exists and is not an empty folder"):
        bench.check_profile_dir(str(tmp_path / "old"))
    with pytest.raises(ValueError, match="--profile=.*missing/p: directory .*missing does not exist"):
        bench.check_profile_dir(str(tmp_path / "missing" / "p"))
    bench.check_profile_dir(str(tmp_path / "new"))


def step_profile():
    """tools/step_profile.py as a module (tools/ is no package; importing it defines no flags)."""
    path = pathlib.Path(__file__).parents[1] / "tools" / "step_profile.py"
    spec = importlib.util.spec_from_file_location("step_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The shape of a compiled GPU module: a Triton GEMM fusion (a dot in its body), a cuBLAS GEMM and a
# cuDNN attention as custom-calls whose results are tuples (workspace, softmax statistics).
GPU_HLO = """HloModule jit_train_step, entry_computation_layout={(bf16[16,64]{1,0})->bf16[16,32]{1,0}}

%fused_computation.3 (param_0: bf16[16,64], param_1: bf16[64,32]) -> bf16[16,32] {
  %param_0 = bf16[16,64]{1,0} parameter(0)
  %param_1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[16,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (Arg_0.1: bf16[16,64], Arg_1.2: bf16[64,32]) -> bf16[16,32] {
  %Arg_0.1 = bf16[16,64]{1,0} parameter(0)
  %Arg_1.2 = bf16[64,32]{1,0} parameter(1)
  %fusion.3 = bf16[16,32]{1,0} fusion(%Arg_0.1, %Arg_1.2), kind=kCustom, calls=%fused_computation.3
  %custom-call.7 = (bf16[16,32]{1,0}, s8[4194304]{0}) custom-call(%Arg_0.1, %Arg_1.2), custom_call_target="__cublas$gemm"
  %custom-call.8 = (bf16[4,12,64]{2,1,0}, f32[4,12]{1,0}, u8[0]{0}) custom-call(%Arg_0.1), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %get-tuple-element.4 = bf16[16,32]{1,0} get-tuple-element(%custom-call.7), index=0
}
"""

# A trace as XLA:GPU writes it: the host plane's thread records the launch of fusion.3 (9 us), the
# device plane's stream the kernels (5, 2 and 1 us), each naming its HLO instruction in `hlo_op`.
GPU_TRACE = """
planes { id: 1 name: "/host:CPU"
  lines { id: 1 name: "tf_XLAExecute" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000 stats { metadata_id: 1 str_value: "fusion.3" } } }
  event_metadata { key: 1 value { id: 1 name: "fusion.3" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } } }
planes { id: 2 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 stats { metadata_id: 1 str_value: "fusion.3" } }
    events { metadata_id: 2 offset_ps: 6000000 duration_ps: 2000000 stats { metadata_id: 1 str_value: "custom-call.7" } }
    events { metadata_id: 3 offset_ps: 9000000 duration_ps: 1000000 stats { metadata_id: 1 str_value: "custom-call.8" } }
    events { metadata_id: 4 offset_ps: 9500000 duration_ps: 7000000 } }
  event_metadata { key: 1 value { id: 1 name: "triton_gemm_fusion_3" } }
  event_metadata { key: 2 value { id: 2 name: "sm90_xmma_gemm_bf16bf16" } }
  event_metadata { key: 3 value { id: 3 name: "cudnn_generated_fort_native_sdpa" } }
  event_metadata { key: 4 value { id: 4 name: "MemcpyD2H" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } } }
"""


def test_step_profile_reads_a_gpu_module_and_counts_device_kernels_not_host_launches():
    sp = step_profile()
    kinds, lines = sp.hlo_kinds(GPU_HLO)
    # tuple-typed instructions are parsed too (the type "(bf16[..], s8[..])" has a space)
    assert kinds == {"dot.1": "matmul", "fusion.3": "matmul", "custom-call.7": "matmul",
                     "custom-call.8": "attention"}, kinds  # get-tuple-element: a no-op
    per_op, kernels, device, busiest = sp.op_times(jax.profiler.ProfileData.from_text_proto(GPU_TRACE), kinds)
    assert device  # the device plane had instructions: the host's 9 us launch is not counted
    assert per_op == {"fusion.3": 5000, "custom-call.7": 2000, "custom-call.8": 1000} and busiest == 8000
    assert kernels == {"triton_gemm_fusion_3": 5000, "sm90_xmma_gemm_bf16bf16": 2000,
                       "cudnn_generated_fort_native_sdpa": 1000}  # the memcpy names no instruction
    host_only = "planes {" + GPU_TRACE.split("planes {")[1]  # a CPU trace: the host's events are the ops
    per_op, kernels, device, _ = sp.op_times(jax.profiler.ProfileData.from_text_proto(host_only), kinds)
    assert not device and per_op == {"fusion.3": 9000} and not kernels
    # an event of another jitted program that reuses an instruction name is not the step's
    head, last, tail = GPU_TRACE.rpartition('  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } } }')
    other = (head + '  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } }\n'
             '  stat_metadata { key: 2 value { id: 2 name: "hlo_module" } } }' + tail).replace(
        'str_value: "custom-call.7" }', 'str_value: "custom-call.7" } stats { metadata_id: 2 str_value: "jit_other" }')
    per_op, *_ = sp.op_times(jax.profiler.ProfileData.from_text_proto(other), kinds, module="jit_train_step")
    assert per_op == {"fusion.3": 5000, "custom-call.8": 1000}, per_op


def test_step_profile_prices_the_program_it_profiled_op_by_op(tmp_path):
    from twinshard.hardware import chips

    sp = step_profile()
    kinds, _ = sp.hlo_kinds(GPU_HLO)
    per_op = {"fusion.3": 10_000, "custom-call.7": 4_000}  # ns over 2 steps
    out = sp.write_prediction(str(tmp_path / "p.json"), GPU_HLO, per_op, kinds, 1.0, chips.chip("v5e"), 2, "tiny")
    ops = {o["name"]: o for o in json.loads((tmp_path / "p.json").read_text())["ops"]}
    assert ops["fusion.3"]["measured_ms"] == 0.005 and ops["custom-call.7"]["measured_ms"] == 0.002
    assert ops["custom-call.8"]["measured_ms"] == 0  # priced, but the profile saw no time for it
    fused = ops["fusion.3"]  # bf16 [16,64] x [64,32]: 2*16*32*64 FLOPs at v5e's measured matmul rate
    eff = chips.EFFICIENCIES["v5e"].matmul_efficiency
    assert fused["kind"] == "matmul" and fused["flops"] == 2 * 16 * 32 * 64
    assert fused["compute_ms"] == pytest.approx(1e3 * fused["flops"] / (197e12 * eff))
    assert fused["predicted_ms"] == pytest.approx(max(fused["compute_ms"], fused["memory_ms"]))
    assert out["predicted_ms"] == pytest.approx(sum(o["predicted_ms"] for o in ops.values()))
    assert (tmp_path / "p.hlo").read_text() == GPU_HLO  # the program, to price again offline


# A trace as a TPU writes it (the shape measured on a v5e, JAX 0.10.2): the device plane's "XLA Ops"
# events are named by their HLO text and carry no `hlo_op`; "XLA Modules" holds one event per program
# run and "Async XLA Ops" repeats the async copies' spans (both must not be counted again).
TPU_TRACE = """
planes { id: 2 name: "/device:TPU:0"
  lines { id: 1 name: "XLA Modules" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000 } }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 2 offset_ps: 0 duration_ps: 5000000 }
    events { metadata_id: 3 offset_ps: 6000000 duration_ps: 1000000 } }
  lines { id: 3 name: "Async XLA Ops" timestamp_ns: 1000
    events { metadata_id: 3 offset_ps: 6000000 duration_ps: 2500000 stats { metadata_id: 1 str_value: "custom-call.7" } } }
  event_metadata { key: 1 value { id: 1 name: "jit_train_step(123)" } }
  event_metadata { key: 2 value { id: 2 name: "%fusion.3 = bf16[16,32]{1,0:T(8,128)(2,1)} fusion(%Arg_0.1, %Arg_1.2), kind=kOutput" } }
  event_metadata { key: 3 value { id: 3 name: "%custom-call.7 = (bf16[16,32]{1,0}, s8[4194304]{0}) custom-call(%Arg_0.1)" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } } }
"""


def test_step_profile_reads_the_tpu_device_plane_by_instruction_text():
    sp = step_profile()
    kinds, _ = sp.hlo_kinds(GPU_HLO)
    per_op, kernels, device, busiest = sp.op_times(jax.profiler.ProfileData.from_text_proto(TPU_TRACE), kinds)
    assert device and per_op == {"fusion.3": 5000, "custom-call.7": 1000} and busiest == 6000, per_op
    assert kernels == {"fusion.3": 5000, "custom-call.7": 1000}


# The splash kernels of a step compiled for a v5e (AOT from this CPU, JAX 0.12; operands, layouts and the
# Mosaic body shortened): Pallas `tpu_custom_call`s named for the kernel, their block sizes in a
# multi-line kernel_metadata attribute.
SPLASH_HLO = """HloModule jit_f, is_scheduled=true

ENTRY %main.2 (q.1: bf16[2,2048,128]) -> bf16[2,2048,128] {
  %q.1 = bf16[2,2048,128]{2,1,0} parameter(0)
  %splash_mha_fwd_residuals.1 = (bf16[2,2048,128]{2,1,0:T(8,128)(2,1)S(1)}, f32[2,2048,128]{2,1,0:T(8,128)S(1)}) custom-call(%q.1, %q.1, %q.1), custom_call_target="tpu_custom_call", operand_layout_constraints={bf16[2,2048,128]{2,1,0}, bf16[2,2048,128]{2,1,0}, bf16[2,2048,128]{2,1,0}}, frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512, \\"block_kv\\": 512, \\"use_fused_bwd_kernel\\": true}"
}}, metadata={op_name="jit(f)/jvp(vmap(static_sparsity_splash))/jit(_splash_attention)/splash_mha_fwd_residuals/splash_mha_fwd_residuals/pallas_call"}, backend_config={"flag_configs":[],"scoped_memory_configs":[],"custom_call_config":{"body":"TUzvUgFNTElS"}}
  %pallas_call.1 = bf16[2,2048,128]{2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%splash_mha_fwd_residuals.1), index=0
  %splash_mha_dkv_no_residuals.1 = (bf16[4,2,2048,128]{3,2,1,0}, bf16[2,2048,128]{2,1,0}, bf16[2,2048,128]{2,1,0}) custom-call(%q.1, %pallas_call.1), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q_dkv\\": 512}"
}}, backend_config={"custom_call_config":{"body":"TUzvUgFNTElS"}}
  %other.1 = bf16[2,2048,128]{2,1,0} custom-call(%q.1), custom_call_target="tpu_custom_call", backend_config={}
  ROOT %add.1 = bf16[2,2048,128]{2,1,0} add(%pallas_call.1, %other.1)
}
"""


def test_step_profile_files_splash_kernels_under_attention():
    kinds, _ = step_profile().hlo_kinds(SPLASH_HLO)
    assert kinds == {"splash_mha_fwd_residuals.1": "attention", "splash_mha_dkv_no_residuals.1": "attention",
                     "other.1": "other", "add.1": "other"}, kinds  # a bare add: no fusion


def test_step_profile_refuses_a_trace_dir_launch_bench_did_not_write(tmp_path):
    with pytest.raises(ValueError, match=r"--trace_dir=.*: no .*step\.hlo\.txt, .*profile\.json; give a folder"):
        step_profile().from_trace_dir(str(tmp_path))
