"""Benchmark single device and every strategy x twin in ONE process, side by side.

    python -m launch.bench --preset=small --steps=10 --json=bench.json --markdown=bench.md
    python -m launch.bench --preset=maxtext_llama_ref --strategies=single,fsdp,fsdp_tp,dp
    python -m launch.bench --preset=gpt2_125m --strategies=single --batch_size=16   # one GPU
    python -m launch.bench --preset=gpt2_350m --strategies=single --batch_size=16 --grad_accum=4   # 4 x 4 sequences
    python -m launch.bench --preset=tiny --mesh='tp=data:1,tensor:4'   # tp on 4 of the 8 devices

For each run (the single-device reference, then each strategy with each twin):

- compile: the train step lowered (trace + StableHLO) and compiled, each
  timed, ahead of time on abstract inputs; the init (`runner.init_state`)
  split into trace / lower / backend compile by JAX's own monitoring events,
  and its wall time (compile + run). The persistent compilation cache is off.
- step: the compiled step run `--warmup` times, then `--steps` times, each
  step timed to `block_until_ready`; the median is reported, with tokens/s =
  B*T / median and model FLOP/s = the cost model's FLOPs per step / median
  (twinshard.cost `model_total`: 6 N_mm B T + 3 x the attention matmuls, causal
  attention counted half as MaxText does since mid-2025; the embedding lookup counts 0).
- peak: a float32 (and, on accelerators, bfloat16) matmul of
  `--matmul_size`^3 timed the same way, the 25th percentile time of `--matmul_reps` (the
  undisturbed rate: a shared VM's bursts drag a median down), measured
  in this process before the runs. "% of peak" = model FLOP/s / measured
  peak of the hardware the run uses: on CPU the whole machine (simulated
  devices share its cores, so the peak is NOT multiplied by the device
  count), on an accelerator the per-chip peak x chips. On a chip in `twinshard.hardware.chips`
  the MFU against the datasheet peak is reported too.
- memory per device: `compiled.memory_analysis()`'s total allocation (every buffer of the program, all
  live while it runs; launch/fit.py compiled_bytes) beside the cost model's prediction.
- collectives: the ledger of the compiled HLO (twinshard.hlo) against the
  cost model: bytes and counts, and whether every (op, axes) row matches.
- `--profile=DIR`: `--profiled_steps` more steps of each run under the profiler, its trace
  in DIR/<run>/ beside the compiled step's HLO (step.hlo.txt) and the steps' wall time
  (profile.json); `tools/step_profile.py --trace_dir=DIR/<run>` reads them, per op kind, so
  a profile costs no second compile of the same program.

Every input is validated and every runner built (meshes checked) before
anything compiles; output directories are checked before any work. Numbers
on a shared 2-core machine are noisy: the JSON records os.getloadavg() before
and after and the CPU count; docs/speed.md ("Measure it") says what simulated-device
numbers do and do not mean.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags, logging

from launch import common, fit
from launch.bench_report import markdown, summary_line
from twinshard.parallel import strategies, support
from twinshard.hardware.chips import Chip, chip_for  # the datasheet peaks (launch.plan reads the same table)
from twinshard.hardware import measure
from twinshard.config import PRESETS, Config, ModelConfig, TrainConfig, preset

# Flags shared by name with the other launchers keep their defaults (absl flags are process-global:
# whichever module defines a name first wins, so a different default here would leak into train).
common.define(flags.DEFINE_string, "preset", "small", "Named preset from twinshard.config (tiny, small, gpt2_125m, ...).")
common.define(flags.DEFINE_integer, "steps", None, "Timed steps per run, after the warm-up (default 10).")
common.define(flags.DEFINE_integer, "batch_size", None, "Global batch size in sequences.")
common.define(flags.DEFINE_integer, "seed", None, "Seed for init and batches.")
common.define(flags.DEFINE_integer, "grad_accum", None, "Micro-batches per step: the batch is split into "
              "grad_accum micro-batches whose gradients are accumulated (default 1).")
common.define(flags.DEFINE_enum, "grad_accum_dtype", None, common.GRAD_ACCUM_DTYPES, "The micro-batches' gradient "
              "sum: float32 (default), or weight: each param's dtype (the fast path's on a TPU with bf16 weights).")
common.define(flags.DEFINE_string, "mesh", None, "Mesh, e.g. data:4,tensor:2 (default: from the device count).")
common.define(flags.DEFINE_string, "dcn_mesh", None, "The mesh axes across slices (e.g. data:2) for the strategies "
              f"that cross them ({', '.join(strategies.CROSS_DCN)}); --mesh then names the axes inside a slice.")
common.define(flags.DEFINE_integer, "devices", 8, "Simulated CPU devices when running a strategy on CPU.")
common.define(flags.DEFINE_string, "json", None, "Write the results as JSON here.")
common.define(flags.DEFINE_string, "markdown", None, "Write the results as a Markdown section here.")
common.define_precision_flags()  # --dtype, --attention, fit's --skip_memory_check, --device_memory_gib
common.define(flags.DEFINE_list, "strategies", "single,dp,fsdp,tp,fsdp_tp", "Runs: single and/or strategies.")
common.define(flags.DEFINE_list, "impls", "auto,manual", "Twins to run for each strategy: auto, manual, explicit "
              f"(explicit: {', '.join(support.written_by('explicit'))}).")
common.define(flags.DEFINE_integer, "warmup", 2, "Untimed steps before the timed ones.")
common.define(flags.DEFINE_integer, "matmul_size", None,
              "n of the n^3 peak matmul (default 2048 on CPU, 8192 on accelerators).")
common.define(flags.DEFINE_integer, "matmul_reps", 20, "Timed matmuls for the peak (its 25th percentile time).")
common.define(flags.DEFINE_string, "profile", None, "Also profile each run: after its timed steps, --profiled_steps "
              "more under jax.profiler.trace into PROFILE/<run>/, with the compiled step's HLO and the steps' wall "
              "time beside the trace (tools/step_profile.py --trace_dir reads them: no second compile).")
common.define(flags.DEFINE_integer, "profiled_steps", 3, "Steps each --profile trace holds.")
FLAGS = flags.FLAGS  # the model-shape flags (--d_model, --num_kv_heads, ...): common.define_shape_flags

# MaxText 0.2.5's llama-style reference (d_model 256, 4 layers, 4 heads x 64, mlp 1024,
# vocab 4096, seq 256, global batch 16, fp32): tools/maxtext_compare.sh runs MaxText on it.
BENCH_PRESETS: dict[str, Config] = {
    "maxtext_llama_ref": Config(
        ModelConfig(vocab_size=4096, context_length=256, d_model=256, num_layers=4, num_heads=4, d_ff=1024),
        TrainConfig(batch_size=16, tokenizer="shakespeare4096")),
}

DEFAULT_STEPS = 10
NOISE_NOTE = ("CPU timings on a shared machine are noisy (other processes, frequency scaling): "
              "compare runs of one process, read load_avg, and repeat before trusting a few percent.")


# ----------------------------------------------------------------------------- inputs


def config_from_flags() -> Config:
    """The preset (or a bench preset) with flag overrides; bad values raise ValueError naming the flag."""
    if FLAGS.preset in BENCH_PRESETS:
        cfg = BENCH_PRESETS[FLAGS.preset]
    elif FLAGS.preset in PRESETS:
        cfg = preset(FLAGS.preset)
    else:
        raise ValueError(f"--preset={FLAGS.preset}: unknown; choose one of "
                         f"{', '.join((*PRESETS, *BENCH_PRESETS))}.")
    train = {k: getattr(FLAGS, k) for k in ("batch_size", "seed", "grad_accum", "grad_accum_dtype")
             if getattr(FLAGS, k) is not None}
    try:
        cfg = Config(cfg.model, dataclasses.replace(cfg.train, **train))
    except ValueError as e:
        raise ValueError(f"{e} (from the flags {_flags_text(train)})") from None
    return common.with_model_flags(cfg, FLAGS)  # the shape flags too


def _flags_text(values: dict) -> str:
    return " ".join(f"--{k}={v}" for k, v in values.items()) or f"--preset={FLAGS.preset}"


def parse_meshes(text: str | None, strategies: Sequence[str]) -> dict[str, str | None]:
    """--mesh: one spec for every strategy ('data:2,tensor:4'), or per strategy
    ('fsdp=data:8,tensor:1;fsdp_tp=data:2,tensor:4'); unnamed strategies use their default mesh."""
    parallel = [s for s in strategies if s in common.PARALLEL]
    if not text:
        return dict.fromkeys(parallel)
    if "=" not in text:
        return dict.fromkeys(parallel, text)
    out: dict[str, str | None] = dict.fromkeys(parallel)
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, spec = part.partition("=")
        if name not in out:
            raise ValueError(f"--mesh={text}: {name!r} is not one of the benchmarked strategies "
                             f"{', '.join(parallel) or '(none)'}; write strategy=data:N,tensor:M;...")
        out[name] = spec
    return out


# pipelines need --microbatches and their own bubble sweep (tools/pipeline_bubble.py), not here
BENCHED = tuple(s for s in common.STRATEGIES if s not in strategies.of_family("pipeline"))


def check_choices(strategies: Sequence[str], impls: Sequence[str]) -> None:
    bad = [s for s in strategies if s not in BENCHED]
    if bad or not strategies:
        raise ValueError(f"--strategies={','.join(strategies)}: choose from {', '.join(BENCHED)}.")
    bad = [i for i in impls if i not in common.IMPLS]
    if bad or (not impls and any(s in common.PARALLEL for s in strategies)):
        raise ValueError(f"--impls={','.join(impls)}: choose from {', '.join(common.IMPLS)}.")


def check_profile_dir(path: str | None) -> None:
    """--profile's folder: new or empty (each run's trace, HLO and wall time go in a subfolder; one
    already there would be overwritten or read back as two traces), its parent existing."""
    if path and os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ValueError(f"--profile={path}: exists and is not an empty folder; give a new or empty folder.")
    if path and not os.path.exists(path):
        common.check_output_path(path, "profile")  # its parent exists and is writable


# ----------------------------------------------------------------------------- measuring


def random_batch(cfg: Config):
    """Tokens x [B, T] and their shifted targets y, uniform over the real vocab (timing needs no corpus)."""
    import numpy as np

    rng = np.random.default_rng(cfg.train.seed)
    tokens = rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.context_length + 1))
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def model_cost(run):
    """(cost-model Cost or None, Flops, Memory) of one step of a resolved run on this backend's devices
    (cost.of_run; on one device: no Cost, its collectives are none)."""
    import jax

    from twinshard import cost

    backend = jax.default_backend()  # attention auto: cuDNN's on a GPU, splash's on a TPU
    c = cost.of_run(run, gpu=backend == "gpu", tpu=backend == "tpu")
    return c if run.mesh else None, c.flops, c.memory


def memory_per_device(compiled) -> dict[str, int] | None:
    """memory_analysis() fields, the peak the device holds (`peak_estimate`, fit.compiled_bytes: XLA's
    total_allocation_bytes) and `summed`, arguments + outputs - aliased + temporaries."""
    out = measure.memory_analysis(compiled)
    if out is not None:
        got = fit.compiled_bytes(compiled)
        out["peak_estimate"], out["summed"] = got["peak"], got["summed"]
    return out


def collectives_vs_model(compiled, runner, model) -> dict[str, Any]:
    """Ledger totals against the cost model: bytes, counts, ratio, and whether every row matches."""
    from twinshard import cost, hlo

    led = hlo.ledger(compiled, runner.mesh)
    measured = led.summary()
    rows = cost.compare(measured, model.summary())
    m_bytes = sum(v["bytes"] for v in measured.values())
    c_bytes = sum(r.bytes for r in model.collectives)
    return {"ledger_bytes": m_bytes, "model_bytes": c_bytes,
            "ledger_count": sum(v["count"] for v in measured.values()),
            "model_count": sum(r.count for r in model.collectives),
            "bytes_ratio": m_bytes / c_bytes if c_bytes else None,
            "rows_match": all(r["match"] for r in rows), "unparsed": len(led.unparsed),
            "rows": rows}


def bench_one(runner, run, impl: str | None, batch, steps: int, warmup: int, log=print,
              profile: str | None = None, profile_steps: int = 3) -> dict:
    """Compile, init, and time one runner (then, with `profile`, trace `profile_steps` more into
    profile/<run>/); returns one JSON-ready record. Logs each phase as it ends, so a run killed by a
    time limit shows how far it got."""
    import jax
    import numpy as np

    strategy, cfg = run.strategy, run.cfg
    B, T = cfg.train.batch_size, cfg.model.context_length
    mesh = dict(run.mesh) or None  # None: the single-device run
    xs = jax.ShapeDtypeStruct((B, T), np.int32, sharding=getattr(runner, "batch_sharding", None))
    abstract = runner.abstract_state()
    t0 = time.perf_counter()
    lowered = runner.train_step.lower(abstract, xs, xs)
    t1 = time.perf_counter()
    compiled = fit.compile_checked(lowered, run)  # refused in one line if it cannot fit
    t2 = time.perf_counter()
    label = strategy if impl is None else f"{strategy}/{impl}"
    log(f"{label}: train step lowered in {t1 - t0:.2f}s, compiled in {t2 - t1:.2f}s; init ...")
    with measure.CompileEvents() as init_times:
        state = runner.init_state(cfg.train.seed)
        jax.block_until_ready(state)
    init_wall = time.perf_counter() - t2
    log(f"{label}: init in {init_wall:.2f}s (XLA compile {init_times['compile_s']:.2f}s); "
        f"{warmup} + {steps} steps ...")
    x, y = runner.place_batch(*batch)
    losses, times = [], []
    for i in range(warmup + steps):
        t = time.perf_counter()
        state, metrics = compiled(state, x, y)  # the step donates `state`: rebind it
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t)
        losses.append(float(metrics["loss"]))
    where = os.path.join(profile, label.replace("/", "-")) if profile else None
    if where:
        state = measure.trace_steps(compiled, state, (x, y), profile_steps, where)
        log(f"{label}: {profile_steps} steps profiled into {where}")
    model, flops, mem = model_cost(run)
    med = statistics.median(times)
    rec = {"run": label, "strategy": strategy, "impl": impl,
           "mesh": mesh, "n_devices": int(np.prod(list(mesh.values()))) if mesh else 1,
           "lower_s": t1 - t0, "compile_s": t2 - t1,
           "init": {"wall_s": init_wall, **init_times},
           "step_s": {"median": med, "min": min(times), "max": max(times), "all": times},
           "tokens_per_s": B * T / med, "model_flops_per_step": flops.model_total,
           "model_flops_per_s": flops.model_total / med,
           "loss_first": losses[0], "loss_last": losses[-1], "profile": where,
           "memory": {"xla": memory_per_device(compiled), "model": {**dataclasses.asdict(mem), "total": mem.total}},
           "collectives": collectives_vs_model(compiled, runner, model) if model is not None else None}
    del state, compiled, lowered
    gc.collect()
    return rec


def build_runners(cfg: Config, strategies: Sequence[str], impls: Sequence[str],
                  meshes: dict[str, str | None], dcn_spec: str | None = None) -> list[tuple[Any, str | None, Any]]:
    """Every runner, built (and its mesh validated) before anything compiles. A --mesh smaller
    than the device count runs on the first devices (tiny's 4 heads: tp on tensor:4 of 8);
    `dcn_spec` (--dcn_mesh) puts the strategies that cross slices (hsdp) across them."""
    runs = []
    for s in strategies:
        for impl in (impls if s in common.PARALLEL else [None]):
            dcn = dcn_spec if s in common.CROSS_DCN else None  # --dcn_mesh: for those that cross slices
            run = common.resolve_run(s, impl or "auto", meshes.get(s), cfg, first_devices=dcn is None, dcn_spec=dcn)
            runs.append((run, impl, common.runner_of(run)))
    return runs


def environment() -> dict[str, Any]:
    import flax
    import jax
    import jaxlib

    dev = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"time_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "git_commit": commit or None, "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__, "backend": dev.platform,
            "device_kind": dev.device_kind, "device_count": jax.device_count(),
            "cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "machine": platform.machine(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "load_avg_before": os.getloadavg(), "noise_note": NOISE_NOTE}


def run(name: str, cfg: Config, strategies: Sequence[str], impls: Sequence[str], meshes: dict[str, str | None],
        steps: int = DEFAULT_STEPS, warmup: int = 2, matmul_size: int | None = None,
        matmul_reps: int = 20, command: str = "", log=print, profile: str | None = None,
        profile_steps: int = 3, dcn_spec: str | None = None) -> dict[str, Any]:
    """The whole benchmark: environment, matmul peaks, then every run; returns the JSON document
    (dcn_spec: --dcn_mesh, for the strategies that cross slices)."""
    import jax

    if steps < 1 or warmup < 0 or matmul_reps < 1 or (matmul_size is not None and matmul_size < 1) or profile_steps < 1:
        raise ValueError(f"need --steps >= 1, --warmup >= 0, --matmul_reps >= 1, --matmul_size >= 1, --profiled_steps "
                         f">= 1; got {steps}, {warmup}, {matmul_reps}, {matmul_size}, {profile_steps}.")
    runners = build_runners(cfg, strategies, impls, meshes, dcn_spec)  # validates every mesh first
    for run, _, _ in runners:  # every step's memory by the cost model, before any compiles
        fit.check_model(run)
    env = environment()
    dev = jax.devices()[0]
    n = matmul_size or (2048 if dev.platform == "cpu" else 8192)
    dtypes = ("float32",) if dev.platform == "cpu" else ("float32", "bfloat16")
    peaks = {d: measure.matmul_peak(d, n, matmul_reps, dev) for d in dtypes}
    for d, p in peaks.items():
        log(f"matmul peak {d} {n}^3: {p['flops_per_s'] / 1e9:,.0f} GFLOP/s")
    chip = chip_for(dev.device_kind) if dev.platform != "cpu" else None
    batch = random_batch(cfg)
    records = []
    for run, impl, runner in runners:
        rec = bench_one(runner, run, impl, batch, steps, warmup, log, profile, profile_steps)
        add_ratios(rec, records[0] if records and records[0]["strategy"] not in common.PARALLEL else None,
                   peaks, chip, dev.platform, cfg.model.dtype)
        records.append(rec)
        log(summary_line(rec))
    env["load_avg_after"] = os.getloadavg()
    # The same matmul again: a peak that moved during the runs means the machine's load did.
    after = measure.matmul_peak(dtypes[0], n, matmul_reps, dev)
    peaks[dtypes[0]]["flops_per_s_after"] = after["flops_per_s"]
    log(f"matmul peak {dtypes[0]} {n}^3 after the runs: {after['flops_per_s'] / 1e9:,.0f} GFLOP/s")
    return {"schema": 1, "command": command, "preset": name,
            "model": dataclasses.asdict(cfg.model), "batch_size": cfg.train.batch_size,
            "grad_accum": cfg.train.grad_accum, "grad_accum_dtype": cfg.train.grad_accum_dtype,
            "seq_len": cfg.model.context_length, "dtype": cfg.model.dtype, "steps": steps, "warmup": warmup,
            "environment": env, "peaks": peaks, "chip": dataclasses.asdict(chip) if chip else None,
            "runs": records}


def add_ratios(rec: dict, single: dict | None, peaks: dict, chip: Chip | None, backend: str, dtype: str) -> None:
    """Fractions of the measured (and nominal) peak, and ratios to the single-device run."""
    peak_dtype = "bfloat16" if "bf" in dtype and "bfloat16" in peaks else "float32"
    chips = 1 if backend == "cpu" else rec["n_devices"]  # simulated CPU devices share one machine
    rec["peak"] = {"dtype": peak_dtype, "flops_per_s": peaks[peak_dtype]["flops_per_s"] * chips}
    rec["fraction_of_measured_peak"] = rec["model_flops_per_s"] / rec["peak"]["flops_per_s"]
    if chip is not None:
        nominal = chip.bf16 if peak_dtype == "bfloat16" else (chip.tf32 or chip.fp32)
        rec["mfu_nominal"] = rec["model_flops_per_s"] / (nominal * 1e12 * chips) if nominal else None
    if single is not None:
        rec["vs_single"] = {"step_time": rec["step_s"]["median"] / single["step_s"]["median"],
                            "compile_time": rec["compile_s"] / single["compile_s"]}


# ----------------------------------------------------------------------------- reporting


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    cfg = config_from_flags()
    check_choices(FLAGS.strategies, FLAGS.impls)
    meshes = parse_meshes(FLAGS.mesh, FLAGS.strategies)
    if FLAGS.dcn_mesh and not set(FLAGS.strategies) & set(common.CROSS_DCN):
        raise ValueError(f"--dcn_mesh={FLAGS.dcn_mesh} puts a strategy across slices, and none of --strategies="
                         f"{','.join(FLAGS.strategies)} can cross them: add {' or '.join(common.CROSS_DCN)}, or drop "
                         "--dcn_mesh.")
    common.check_output_path(FLAGS.json, "json")
    common.check_output_path(FLAGS.markdown, "markdown")
    check_profile_dir(FLAGS.profile)
    common.default_platform()
    if any(s in common.PARALLEL for s in FLAGS.strategies):
        common.simulate_cpu_devices(FLAGS.devices)  # before jax initialises its backend
    from twinshard.train import compile_cache

    # on a TPU, the fast path's choices (logged, and kept in the JSON); those of one chip's program where
    # every run is single
    chosen: list[str] = []
    cfg = common.fast_path(cfg, FLAGS, "single" if set(FLAGS.strategies) == {"single"} else "mesh",
                           lambda line: (print(line), chosen.append(line)))
    with compile_cache.disabled():  # time real compiles, not cache reads
        doc = run(FLAGS.preset, cfg, FLAGS.strategies, FLAGS.impls, meshes, FLAGS.steps or DEFAULT_STEPS,
                  FLAGS.warmup, FLAGS.matmul_size, FLAGS.matmul_reps, "python -m launch.bench " + " ".join(argv_flags()),
                  profile=FLAGS.profile, profile_steps=FLAGS.profiled_steps, dcn_spec=FLAGS.dcn_mesh)
    doc["fast_path"] = chosen
    print(write_outputs(doc, FLAGS.json, FLAGS.markdown))
    return 0


# Every flag the bench defines: each changes what it runs or where it writes, so the recorded command reruns it
# (--dcn_mesh the mesh across slices; --skip_memory_check, --device_memory_gib whether a run is refused).
BENCH_FLAGS = ("preset", "strategies", "impls", "mesh", "dcn_mesh", "devices", "steps", "warmup", "batch_size",
               "seed", "grad_accum", "grad_accum_dtype", *common.MODEL_FLAGS, "matmul_size", "matmul_reps", "json", "markdown", "profile",
               "profiled_steps", "skip_memory_check", "device_memory_gib")


def argv_flags() -> list[str]:
    """The flags this run was given (for the record: the command that reproduces it)."""
    return [FLAGS[n].serialize() for n in BENCH_FLAGS if FLAGS[n].present]


def write_outputs(doc: dict, json_path: str | None, md_path: str | None) -> str:
    """Write the JSON and Markdown (each atomically); return the Markdown."""
    text = markdown(doc)
    if json_path:
        _write(json_path, json.dumps(doc, indent=1))
    if md_path:
        _write(md_path, text)
    return text + "".join(f"wrote {p}\n" for p in (json_path, md_path) if p)


if __name__ == "__main__":
    try:
        app.run(main, flags_parser=common.parse_flags)
    except ValueError as e:  # a user error: one line naming the flag and the fix, no traceback
        sys.exit(f"launch.bench: {e}")
