"""The planner's ranking, one key at a time, and its defaults (twinshard/hardware/plan.py,
launch/plan.py, docs/planning.md).

Ranking keys, in order: a plan that fits HBM before one that does not; among those that fit the
step time `--rank_by` names (serial: compute + every axis's communication; overlap: the largest of
them), then the memory, then the order given (a stable sort); those that do not fit by memory
alone. `_best` (a pipeline's micro-batch count) takes the first of that order; `--compile` ranks the
compiled plans by whether XLA's peak fits, then the predicted step. Each test builds candidates
equal in every key but one, so that key alone decides. Nothing is compiled here.
"""

from __future__ import annotations

import dataclasses
import json
import types
from fractions import Fraction

import jax
import pytest

from cli import run
from launch import plan as planner
from twinshard.config import preset
from twinshard.hardware import chips, links
from twinshard.hardware import plan as plans_lib
from twinshard.hardware.plan import Plan, Precision

HBM = 100.0


def candidate(name: str, compute: float = 1.0, comm: dict[str, float] | None = None, memory: int = 50,
              flat: bool = False, slices: int = 1) -> Plan:
    """A plan whose ranking keys are given: compute and per-axis communication seconds, memory
    against HBM usable bytes of 100; the cost model's only part read here is `cost.memory.total`."""
    cost = types.SimpleNamespace(memory=types.SimpleNamespace(total=memory))
    return Plan(name, {"data": 1, "tensor": 1}, cost, HBM, compute, {"data": 0.0} if comm is None else comm, {}, flat, slices)


def names(plans: list[Plan]) -> list[str]:
    return [p.strategy for p in plans]


@pytest.mark.parametrize("rank_by", plans_lib.RANK_BY)
def test_a_plan_that_fits_ranks_before_a_faster_one_that_does_not(rank_by: str) -> None:
    at_limit = candidate("at the limit", compute=3.0, memory=int(HBM))  # memory == usable HBM fits
    over = candidate("one byte over", compute=1.0, memory=int(HBM) + 1)
    fit, too_big = plans_lib.rank([over, at_limit], rank_by)
    assert names(fit) == ["at the limit"] and names(too_big) == ["one byte over"]
    assert plans_lib._best([over, at_limit], rank_by) is at_limit


def test_serial_ranks_by_the_sum_and_overlap_by_the_largest_term() -> None:
    """Equal memory; serial and overlap disagree on the order (steps in the comments)."""
    spread = candidate("spread", compute=1.0, comm={"data": 2.0, "tensor": 2.0})  # serial 5, overlap 2
    one_axis = candidate("one axis", compute=1.0, comm={"data": 3.5, "tensor": 0.0})  # serial 4.5, overlap 3.5
    compute_bound = candidate("compute bound", compute=3.0, comm={"data": 0.25, "tensor": 0.25})  # 3.5, 3
    plans = [spread, one_axis, compute_bound]
    assert names(plans_lib.rank(plans, "serial")[0]) == ["compute bound", "one axis", "spread"]
    assert names(plans_lib.rank(plans, "overlap")[0]) == ["spread", "compute bound", "one axis"]
    assert [p.step_s("serial") for p in plans] == [5.0, 4.5, 3.5]
    assert [p.step_s("overlap") for p in plans] == [2.0, 3.5, 3.0]
    assert plans_lib._best(plans, "serial") is compute_bound and plans_lib._best(plans, "overlap") is spread


@pytest.mark.parametrize("rank_by", plans_lib.RANK_BY)
def test_equal_steps_rank_the_smaller_memory_first_then_keep_the_given_order(rank_by: str) -> None:
    big, small = candidate("big", memory=60), candidate("small", memory=40)
    twin_a, twin_b = candidate("twin a", memory=40), candidate("twin b", memory=40)
    assert names(plans_lib.rank([big, small], rank_by)[0]) == ["small", "big"]
    assert names(plans_lib.rank([twin_b, big, twin_a], rank_by)[0]) == ["twin b", "twin a", "big"]
    assert plans_lib._best([big, small], rank_by) is small


def test_plans_too_big_rank_by_memory_alone_and_the_best_of_none_fitting_is_the_smallest() -> None:
    slow_small = candidate("slow small", compute=9.0, memory=120)
    fast_big = candidate("fast big", compute=0.1, memory=300)
    middle = candidate("middle", compute=1.0, memory=200)
    for rank_by in plans_lib.RANK_BY:
        fit, over = plans_lib.rank([fast_big, middle, slow_small], rank_by)
        assert fit == [] and names(over) == ["slow small", "middle", "fast big"]
        assert plans_lib._best([fast_big, middle, slow_small], rank_by) is slow_small


@pytest.mark.parametrize("call", [
    lambda plans: plans_lib.rank(plans, "overlapped"), lambda plans: plans_lib._best(plans, "Serial"),
    lambda plans: plans[0].step_s("sum"),
    lambda plans: plans_lib.rank([candidate("too big", memory=500)], "fastest"),  # no plan fits: still refused
    lambda plans: plans_lib.plan_all(preset("tiny").model, links.parse_topology("v5e:2x2"), 8, rank_by="max")])
def test_an_unknown_rank_by_raises_naming_the_choices(call) -> None:
    with pytest.raises(ValueError, match=r"rank_by='\w+': rank by one of \('serial', 'overlap'\)"):
        call([candidate("a"), candidate("b")])


def test_the_bound_is_the_largest_term_and_compute_wins_a_tie() -> None:
    assert candidate("c", compute=2.0, comm={"data": 1.0, "tensor": 3.0}).bound == "comm tensor"
    assert candidate("c", compute=2.0, comm={"data": 1.0, "tensor": 0.5}).bound == "compute"
    assert candidate("c", compute=2.0, comm={"data": 2.0}).bound == "compute"


def test_the_launch_line_is_the_best_plan_launch_train_runs() -> None:
    """launch_section: the first plan that fits and is runnable (not flat, one slice)."""
    cfg, topo = preset("tiny"), links.parse_topology("v5e:2x2")
    flat = dataclasses.replace(plans_lib.evaluate(cfg.model, topo, "fsdp", {"data": 4}, 8), flat=True)
    dp = plans_lib.evaluate(cfg.model, topo, "dp", {"data": 4}, 8)
    lines = planner.launch_section([flat, dp], topo, "tiny", cfg)
    assert "the best plan launch.train runs (dp data:4,tensor:1)" in lines[0] and "--strategy=dp" in lines[1]
    assert "the best plan:" in planner.launch_section([dp, flat], topo, "tiny", cfg)[0]
    assert planner.launch_section([flat], topo, "tiny", cfg) == [
        "== no plan that fits is one launch.train runs (all are flat) =="]


def test_compile_ranks_what_fits_first_then_the_predicted_step(monkeypatch) -> None:
    """--compile: the --compile_top best runnable plans (flat ones skipped), re-ranked by whether
    XLA's peak fits, then by the step predicted from the compiled program; each keeps its plan rank."""
    compiled = {"dp": (False, 1.0), "fsdp_tp": (True, 3.0), "tp": (True, 2.0), "tp_sp": (True, 0.5)}

    def compile_plan(p: Plan, topo, cfg) -> tuple[str, dict]:
        fits, step = compiled[p.strategy]
        return "", {"strategy": p.strategy, "fits": fits, "peak_bytes": 1, "predicted": {
            "step_s": step, "compute_s": step, "exposed_s": 0.0, "axes": {},
            "rates": {"matmul_efficiency": 1.0, "hbm_efficiency": 1.0, "source": "test"}}}

    monkeypatch.setattr(planner, "compile_plan", compile_plan)
    # plan ranks 1-5: a flat plan, XLA's peak too big but the fastest, the slowest, the middle, a 5th not compiled
    fit = [candidate("fsdp", flat=True), *(candidate(name) for name in compiled)]
    _, docs = planner.compile_top(fit, types.SimpleNamespace(name="v5e:2x2", slices=1), None, 3, "serial")
    assert [(d["strategy"], d["plan_rank"]) for d in docs] == [("tp", 4), ("fsdp_tp", 3), ("dp", 2)]


# ----------------------------------------------------------------------------- defaults


def test_the_planners_defaults_are_the_documented_ones() -> None:
    """plan_all with no options: --mfu 1 (the peak), 25% of HBM kept free, AdamW's two float32
    moments over float32 params without a master copy, ranked by the serial step; a plan that is not a
    pipeline runs 1 micro-batch in GPipe's order. Held against the same call with each value spelled out,
    and against the numbers the docs give (docs/planning.md, "Memory")."""
    model, topo = preset("tiny").model, links.parse_topology("v5e:2x2")
    default, _ = plans_lib.plan_all(model, topo, 8)
    spelled, _ = plans_lib.plan_all(model, topo, 8, mfu=1.0, headroom=0.25, optimizer="adamw",
                                    precision=Precision("float32", "float32", False), rank_by="serial")
    assert default == spelled
    dp = next(p for p in default if p.strategy == "dp")
    assert plans_lib.evaluate(model, topo, "dp", dp.mesh, 8) == dp  # evaluate's own defaults are plan_all's
    m, n = dp.cost.memory, model.num_params()
    assert (m.params, m.grads, m.optimizer, m.master) == (4 * n, 4 * n, 8 * n, 0)  # 16 bytes a parameter
    assert dp.hbm_usable == 0.75 * topo.chip.hbm_bytes and (dp.microbatches, dp.schedule) == (1, "gpipe")
    assert dp.compute_s == pytest.approx(plans_lib._flops_per_chip(dp.cost) / chips.matmul_peak_flops(topo.chip, "float32")[0])
    assert Precision().is_default and not Precision("bfloat16").is_default
    assert plans_lib.rank(default, "serial") == plans_lib.rank(default, plans_lib.RANK_BY[0])


def test_the_plan_does_not_follow_jaxs_global_configuration() -> None:
    """64-bit types, the highest matmul precision and strict promotion set globally change no plan:
    its dtypes are the config's and its peaks the chip table's."""
    model, topo = preset("tiny").model, links.parse_topology("v5e:2x2")
    default, _ = plans_lib.plan_all(model, topo, 8)
    with jax.enable_x64(True), jax.default_matmul_precision("highest"), jax.numpy_dtype_promotion("strict"):
        configured, _ = plans_lib.plan_all(model, topo, 8)
    assert configured == default


def test_the_cli_defaults_under_jaxs_global_configuration(tmp_path) -> None:
    """launch.plan with no optional flag, run with JAX's 64-bit types, highest matmul precision and
    strict promotion set in the environment: the JSON's assumptions are the flags' documented defaults
    (--mfu: v5e's measured matmul efficiency; --hbm_headroom 0.25; --rank_by serial; AdamW in float32;
    float32 params, no master copy; the preset's dtype and batch) and its plans those of the library's
    defaults in this process."""
    out = tmp_path / "plan.json"
    proc = run("-m", "launch.plan", "--preset=tiny", "--topology=v5e:2x2", f"--json={out}",
               JAX_ENABLE_X64="1", JAX_DEFAULT_MATMUL_PRECISION="highest", JAX_NUMPY_DTYPE_PROMOTION="strict")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    cfg, topo = preset("tiny"), links.parse_topology("v5e:2x2")
    assert doc["assumptions"] | {"mfu_from": ""} == {
        "peak_flops": chips.matmul_peak_flops(topo.chip, "float32")[0], "peak": doc["assumptions"]["peak"],
        "mfu": chips.efficiency(topo.chip).matmul_efficiency, "hbm_headroom": 0.25, "rank_by": "serial",
        "optimizer": "adamw (float32 state)", "latency": "ignored", "mfu_from": "",
        "precision": {"params": "float32", "optimizer": "float32", "master": False}}
    assert (doc["dtype"], doc["batch_size"], doc["seq_len"], doc["slices"]) == (
        cfg.model.dtype, cfg.train.batch_size, cfg.model.context_length, 1)
    fit, _ = plans_lib.rank(plans_lib.plan_all(cfg.model, topo, cfg.train.batch_size,
                                               chips.efficiency(topo.chip).matmul_efficiency)[0], "serial")
    assert [(p["strategy"], p["serial_s"], p["memory"]["total"]) for p in doc["plans"] if p["rank"]] == [
        (p.strategy, p.serial_s, p.memory) for p in fit]


# ----------------------------------------------------------------------------- what the options change


@pytest.mark.parametrize("dtype, peak_of", [("float32", lambda chip: chip.tf32), ("bfloat16", lambda chip: chip.bf16)],
                         ids=["float32", "bfloat16"])
def test_each_dtype_computes_at_its_own_peak(dtype: str, peak_of) -> None:
    """On an H100 (TF32 494.7 TFLOP/s, bf16 989.4 from the chip table) a float32 model's matmuls run at
    TF32's rate and a bfloat16 one's at bf16's: every plan's compute seconds are its FLOPs per chip over
    that peak x mfu (x the pipeline's bubble factor)."""
    model, topo, mfu = dataclasses.replace(preset("tiny").model, dtype=dtype), links.parse_topology("h100:1x4"), 0.5
    assert topo.chip.tf32 != topo.chip.bf16
    plans, _ = plans_lib.plan_all(model, topo, 8, mfu=mfu)
    assert plans
    for p in plans:
        bubble = plans_lib.pipeline_factor(p.microbatches, p.mesh["stage"], p.schedule) if "stage" in p.mesh else 1.0
        want = plans_lib._flops_per_chip(p.cost) / (peak_of(topo.chip) * 1e12 * mfu) * bubble
        assert p.compute_s == pytest.approx(want, rel=1e-12), p.strategy


def test_each_precision_setting_is_in_every_plans_memory() -> None:
    """plan_all with bfloat16 params (and gradients), bfloat16 moments and a float32 master copy: each plan is
    the one evaluate gives with that precision, its memory smaller than the float32 default's; dp's per chip
    by hand: 2 + 2 + 2 x 2 + 4 = 12 bytes a parameter."""
    model, topo = preset("tiny").model, links.parse_topology("v5e:2x2")
    low = Precision("bfloat16", "bfloat16", True)
    plans, _ = plans_lib.plan_all(model, topo, 8, precision=low)
    default = {(p.strategy, tuple(p.mesh.items()), p.schedule): p for p in plans_lib.plan_all(model, topo, 8)[0]}
    for p in plans:
        assert p == plans_lib.evaluate(model, topo, p.strategy, p.mesh, 8, precision=low,
                                       microbatches=p.microbatches, schedule=p.schedule)
        assert p.memory < default[p.strategy, tuple(p.mesh.items()), p.schedule].memory, p.strategy
    dp, n = next(p for p in plans if p.strategy == "dp"), model.num_params()
    m = dp.cost.memory
    assert (m.params, m.grads, m.optimizer, m.master) == (2 * n, 2 * n, 4 * n, 4 * n)


# ----------------------------------------------------------------------------- a pipeline's schedules
# The planner tries every schedule on a pipeline mesh (plans_lib.schedule_choices): gpipe, 1f1b, zb_h1 and
# interleaved with each V in 2 ... 4 that divides L/S, each at its best M; launch.plan names the fastest that
# fits for the best pipeline mesh (plans_lib.pipeline_schedules). llm_1b with 16 layers: S = 4 stages of 4.
LLM_16 = dataclasses.replace(preset("llm_1b").model, num_layers=16)
V5E = links.parse_topology("v5e:2x2")


def test_the_schedules_tried_are_every_schedule_and_each_v_that_splits_a_stage():
    assert plans_lib.schedule_choices(16, 4) == [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                                 ("zb_h1", 1)]
    assert plans_lib.schedule_choices(20, 2) == [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb_h1", 1)]
    assert plans_lib.schedule_choices(12, 4) == [("gpipe", 1), ("1f1b", 1), ("interleaved", 3), ("zb_h1", 1)]
    assert plans_lib.schedule_choices(20, 4) == [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1)]  # 5 layers: no V <= 4


def at_s4(schedule: str, m: int, virtual: int = 1, **kwargs) -> Plan:
    """pp on v5e:2x2 (stage:4), one sequence a micro-batch."""
    return plans_lib.evaluate(LLM_16, V5E, "pp", {"stage": 4}, m, microbatches=m, schedule=schedule, virtual=virtual,
                              **kwargs)


# The M each schedule may run, by hand, for batch 12 on v5e:2x2: pp on stage:4 has 12 rows a stage, pp_fsdp on
# stage:2,data:2 has 6; M divides them, from S up, and for interleaved is a multiple of S (Megatron's table
# runs the micro-batches in rounds of S): {S: (every schedule's, interleaved's)}.
M_BY_HAND = {4: ([4, 6, 12], [4, 12]), 2: ([2, 3, 6], [2, 6])}


def test_each_schedule_is_planned_at_the_best_m_it_can_run():
    """Every pipeline plan of plan_all (llm_1b with 16 layers: V = 2 and 4 split both meshes' stages) is
    one per (schedule, V) of schedule_choices, at the best of its Ms of M_BY_HAND (each evaluated, then
    ranked). On stage:2 interleaved V = 4 runs M = 2 or 6, multiples of S that V does not divide: searched
    over multiples of V it would have no M at all."""
    plans, _ = plans_lib.plan_all(LLM_16, V5E, 12)
    pipelines = [p for p in plans if p.mesh.get("stage", 1) > 1]
    assert {(p.strategy, p.mesh["stage"]) for p in pipelines} == {("pp", 4), ("pp_fsdp", 2)}
    for strategy, stages in (("pp", 4), ("pp_fsdp", 2)):
        mine = [p for p in pipelines if p.strategy == strategy]
        assert [(p.schedule, p.virtual) for p in mine] == plans_lib.schedule_choices(16, stages)
        for p in mine:
            every, interleaved = M_BY_HAND[stages]
            tried = [plans_lib.evaluate(LLM_16, V5E, strategy, p.mesh, 12, microbatches=m, schedule=p.schedule,
                                        virtual=p.virtual) for m in (interleaved if p.virtual > 1 else every)]
            fit, over = plans_lib.rank(tried, "serial")
            assert p.microbatches == (fit or over)[0].microbatches, (p.label(), [(q.microbatches, q.fits) for q in tried])


def test_at_s4_m8_interleaved_and_zb_h1_beat_1f1b_by_their_bubble():
    """S = 4, M = 8: each plan's bubble is its published formula (GPipe and 1F1B (S-1)/(M+S-1) = 3/11,
    interleaved (S-1)/(V M+S-1) = 3/19 and 3/35, zb_h1 (S-1)/(3M+S-1) = 1/9), and interleaved (V = 2)
    and zb_h1 compute at least 10% shorter than 1F1B (pipeline_factor 2.042 against 2.417), at the same
    FLOPs. Their memory is theirs: zb_h1 keeps B's stashes, interleaved more chunks in flight."""
    plans = {(s, v): at_s4(s, 8, v) for s, v in plans_lib.schedule_choices(16, 4)}
    assert {k: p.bubble for k, p in plans.items()} == {
        ("gpipe", 1): Fraction(3, 11), ("1f1b", 1): Fraction(3, 11), ("interleaved", 2): Fraction(3, 19),
        ("interleaved", 4): Fraction(3, 35), ("zb_h1", 1): Fraction(1, 9)}
    ofob = plans["1f1b", 1]
    for key in (("interleaved", 2), ("interleaved", 4), ("zb_h1", 1)):
        assert plans[key].cost.flops.per_device == ofob.cost.flops.per_device
        assert plans[key].compute_s <= 0.9 * ofob.compute_s, (key, plans[key].compute_s / ofob.compute_s)
    assert plans["zb_h1", 1].cost.memory.activations > ofob.cost.memory.activations
    assert plans["interleaved", 2].label() == "stage:4 M=8 interleaved V=2"


def test_at_m_far_above_s_the_schedules_converge():
    """M = 256 on S = 4: every bubble is under 1.2%, and the schedules run by hand (1f1b, interleaved, zb_h1)
    compute within 1% of each other, where at M = 8 they are 15% apart. GPipe stays apart for another
    reason than its bubble: its autodiff keeps the residuals, where a hand-run backward re-runs the forward."""
    def spread(m: int) -> float:
        times = [at_s4(s, m, v).compute_s for s, v in plans_lib.schedule_choices(16, 4) if s != "gpipe"]
        return max(times) / min(times) - 1

    assert all(at_s4(s, 256, v).bubble < Fraction(12, 1000) for s, v in plans_lib.schedule_choices(16, 4))
    assert spread(256) < 0.01 < 0.15 < spread(8)


def test_a_schedule_that_does_not_fit_is_not_the_one_named():
    """pp_fsdp stage:2,data:32 of llm_1b on v5p:4x4x4 (M = 2): GPipe is the fastest schedule and is named at
    the default headroom; with 14.25 GiB usable (--hbm_headroom=0.85) GPipe (17.0 GiB) and zb_h1 (21.0 GiB)
    do not fit, so the fastest that does, interleaved V=2 (8.8 GiB), is named, and the report says so."""
    model, topo = preset("llm_1b").model, links.parse_topology("v5p:4x4x4")

    def schedules(headroom: float) -> list[Plan]:
        fit, over = plans_lib.rank(plans_lib.plan_all(model, topo, 64, headroom=headroom)[0], "serial")
        got = plans_lib.pipeline_schedules(fit, over)
        assert {(p.strategy, p.mesh_text()) for p in got} == {("pp_fsdp", "stage:2,data:32")}  # the best pipeline mesh
        return got

    roomy, tight = schedules(0.25), schedules(0.85)
    assert [(p.schedule, p.virtual) for p in roomy] == [("gpipe", 1), ("zb_h1", 1), ("interleaved", 2), ("1f1b", 1)]
    assert all(p.fits for p in roomy)
    assert [(p.schedule, p.virtual, p.fits) for p in tight] == [
        ("interleaved", 2, True), ("1f1b", 1, True), ("gpipe", 1, False), ("zb_h1", 1, False)]
    text = "\n".join(planner.schedule_section(tight, "serial"))
    assert text.splitlines()[-1] == "best schedule for this shape: interleaved V=2 M=2", text
    assert planner.train_flags(tight[0], "llm_1b", preset("llm_1b")).count("--schedule=interleaved --virtual_stages=2")


@pytest.mark.parametrize("batch, planned", [(2, ()), (4, (2,)), (8, (2, 4))])
def test_a_pipeline_is_planned_only_at_micro_batch_counts_of_at_least_its_stages(batch, planned):
    """tiny (2 layers) on v5e:2x2: pp_fsdp on stage:2,data:2 splits each data shard's batch/2 rows into M >= 2
    micro-batches. At batch 2 a shard's one row makes none, and the skip names the batch's split (a count the
    user could pick: none), not a micro-batch count below the stages; at 4 and 8 every plan's M is one of the
    counts by hand, its best."""
    plans, skipped = plans_lib.plan_all(preset("tiny").model, links.parse_topology("v5e:2x2"), batch)
    ms = {p.microbatches for p in plans if p.strategy == "pp_fsdp"}
    assert ms <= set(planned) and bool(ms) == bool(planned)
    why = [s.why for s in skipped if s.strategy == "pp_fsdp"]
    assert why == ([] if planned else [
        "batch=2 does not split into data=2 x microbatches=2 equal micro-batches (each data shard's B/data rows into M)"])


def test_each_precision_flag_sets_its_own_bytes(tmp_path):
    """launch.plan --param_dtype=bfloat16 --optimizer_dtype=float32 --master_weights: the params and their
    gradients 2 bytes, AdamW's two moments 4 each, the master copy 4 (each plan's memory, per chip, is
    those multiples of one parameter's bytes), and the assumptions say so."""
    out = tmp_path / "plan.json"
    proc = run("-m", "launch.plan", "--preset=tiny", "--topology=v5e:2x2", "--param_dtype=bfloat16",
               "--optimizer_dtype=float32", "--master_weights", f"--json={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["assumptions"]["precision"] == {"params": "bfloat16", "optimizer": "float32", "master": True}
    for plan in doc["plans"]:
        m = plan["memory"]
        assert m["grads"] == m["params"] and m["optimizer"] == 4 * m["params"] and m["master"] == 2 * m["params"], plan
