"""The planner across TPU slices (twinshard/hardware/plan.py, launch/plan.py --slices): each layout's
DCN term by hand, the DCN term turning the ranking, memory deciding between hsdp and fsdp over every
chip, and bad input refused. Nothing is compiled here (tests/test_maxtext_slices.py compiles one)."""

from __future__ import annotations

import pytest

from launch import plan as planner
from twinshard.config import preset
from twinshard.hardware import links
from twinshard.hardware import plan as plans_lib

TINY = preset("tiny")  # 2 layers, d_model 64: 155,968 params, 5 x 64 of them norm gains
ONE = links.parse_topology("v5e:2x2")  # 4 chips a slice
INSIDE = {"data": 4, "tensor": 1}
DCN = 2 * 100e9 / 8 / 8  # v5e: 2 x 100 Gb/s per host of 8 chips, B/s a chip


def layouts(slices: int, **kwargs) -> dict[str, plans_lib.Plan]:
    """dp and hsdp (fsdp inside each slice) on data:4 of every slice, and fsdp over every chip, batch 8 a slice."""
    topo = links.with_slices(ONE, slices)
    out = {p.layout: p for p in (plans_lib.evaluate(TINY.model, topo, s, INSIDE, 8 * slices, **kwargs)
                                 for s in ("dp", "fsdp"))}
    if slices > 1:
        out["fsdp"] = plans_lib.evaluate(TINY.model, topo, "fsdp", INSIDE, 8 * slices, across=True, **kwargs)
    return out


@pytest.mark.parametrize("slices", [2, 4])
def test_each_layouts_dcn_term_by_hand(slices: int) -> None:
    n, norms = TINY.model.num_params(), (2 * TINY.model.num_layers + 1) * TINY.model.d_model
    ring = 2 * (slices - 1) / slices
    plans = layouts(slices)
    assert plans["dp"].comm_s["dcn"] == pytest.approx(ring * 4 * n / DCN, rel=1e-12)  # every f32 gradient
    # this chip's quarter of each matrix's gradient, and the whole norm gains
    assert plans["hsdp"].comm_s["dcn"] == pytest.approx(ring * 4 * ((n - norms) / 4 + norms) / DCN, rel=1e-12)
    gathered = plans["hsdp"].cost.summary()[("all-gather", ("data",))]["bytes"]  # a slice's gathers, per chip
    assert plans["fsdp"].comm_s["dcn"] == pytest.approx(
        plans["hsdp"].comm_s["dcn"] + (slices - 1) / slices * gathered / 4 / DCN, rel=1e-12)
    # one slice's compute and ICI: the same in every layout of fsdp
    for key in ("compute_s",):
        assert getattr(plans["fsdp"], key) == getattr(plans["hsdp"], key)
    assert plans["fsdp"].comm_s["data"] == plans["hsdp"].comm_s["data"]


def test_the_dcn_term_turns_dp_from_first_to_last() -> None:
    """One slice: dp's gradient all-reduce (2 x 3/4 of 4 N bytes) beats fsdp's two gathers and a
    reduce-scatter on ICI. Two: dp sends every gradient over DCN, hsdp a quarter of them, fsdp over every
    chip that quarter and its gathers' shards."""
    one, two = layouts(1), layouts(2)
    assert one["dp"].serial_s < one["fsdp"].serial_s
    ranked = plans_lib.rank(list(two.values()), "serial")[0]
    assert [p.layout for p in ranked] == ["hsdp", "fsdp", "dp"]
    # by hand: dp's DCN term less hsdp's outweighs hsdp's extra ICI time
    assert two["dp"].comm_s["dcn"] - two["hsdp"].comm_s["dcn"] > two["hsdp"].comm_s["data"] - two["dp"].comm_s["data"]
    assert [p.layout for p in plans_lib.rank(list(one.values()), "serial")[0]] == ["dp", "fsdp"]


def test_memory_decides_between_hsdp_and_fsdp_over_every_chip() -> None:
    """fsdp over 8 chips holds half of hsdp's params, grads and moments: with HBM between the two, the
    slower fsdp fits and ranks first."""
    plans = layouts(2)
    hsdp, fsdp = plans["hsdp"], plans["fsdp"]
    assert fsdp.memory < hsdp.memory and fsdp.serial_s > hsdp.serial_s
    assert fsdp.cost.memory.params * 2 == pytest.approx(hsdp.cost.memory.params, rel=0.02)  # the norms whole in both
    hbm = ONE.chip.hbm_bytes
    between = 1 - (fsdp.memory + hsdp.memory) / 2 / hbm
    tight = layouts(2, headroom=between)
    fit, over = plans_lib.rank(list(tight.values()), "serial")
    assert [p.layout for p in fit] == ["fsdp"] and {p.layout for p in over} == {"hsdp", "dp"}


def test_labels_name_the_layout_and_its_slices() -> None:
    plans = layouts(2)
    assert {k: p.label() for k, p in plans.items()} == {
        "dp": "dcn:2 x data:4,tensor:1", "hsdp": "dcn:2 x data:4,tensor:1", "fsdp": "data:8,tensor:1 over 2 slices"}
    assert plans["fsdp"].mesh == {"data": 8, "tensor": 1} and plans["fsdp"].across and not plans["hsdp"].across
    assert not any(p.runnable for p in plans.values())  # launch.train builds one slice's mesh
    table = planner.plan_table(plans_lib.rank(list(plans.values()), "serial")[0], links.with_slices(ONE, 2),
                               TINY.model, 16)
    assert [line.split()[1] for line in table.splitlines()[2:]] == ["hsdp", "fsdp", "dp"]
    assert "comm dcn" in table.splitlines()[0]


def test_plan_all_adds_fsdp_over_every_chip_across_slices_only() -> None:
    two = plans_lib.plan_all(TINY.model, links.with_slices(ONE, 2), 16)[0]
    assert [p.label() for p in two if p.across] == ["data:8,tensor:1 over 2 slices"]
    assert not any(p.across for p in plans_lib.plan_all(TINY.model, ONE, 8)[0])


def test_fsdp_over_every_chip_refuses_other_strategies_and_one_slice() -> None:
    for strategy, topo in (("dp", links.with_slices(ONE, 2)), ("fsdp", ONE)):
        with pytest.raises(ValueError, match=f"across=True splits fsdp's weights over several slices' chips, not "
                                             f"{strategy} on {topo.slices} slice"):
            plans_lib.evaluate(TINY.model, topo, strategy, INSIDE, 16, across=True)
    with pytest.raises(ValueError, match="batch=15 does not split over 2 slices"):
        plans_lib.evaluate(TINY.model, links.with_slices(ONE, 2), "fsdp", INSIDE, 15, across=True)


def test_compile_across_slices_takes_the_best_dp_hsdp_and_fsdp_plans(monkeypatch) -> None:
    """--compile --slices=2: the best plans launch/slices.py compiles (dp and fsdp layouts, not flat, in
    rank order; tp and pipelines skipped), each through compile_step and compiled_report, re-ranked by
    the predicted step."""
    from launch import slices

    topo = links.with_slices(ONE, 2)
    plans = plans_lib.rank(plans_lib.plan_all(TINY.model, topo, 16)[0], "serial")[0]
    want = [p for p in plans if p.strategy in ("dp", "fsdp")][:2]
    steps = {id(p): 2.0 - i for i, p in enumerate(want)}  # the second compiles faster
    monkeypatch.setattr(slices, "compile_step", lambda p, t, cfg: {"plan": p})
    monkeypatch.setattr(slices, "compiled_report", lambda p, t, step: ("", {
        "strategy": p.strategy, "fits": True, "peak_bytes": 1, "predicted": {
            "step_s": steps[id(step["plan"])], "compute_s": 0.5, "exposed_s": 0.0,
            "axes": {"dcn": {"exposed_s": 0.25}},
            "rates": {"matmul_efficiency": 1.0, "hbm_efficiency": 1.0, "source": "test"}}}))
    text, docs = planner.compile_top(plans, topo, TINY, 2, "serial")
    assert [d["plan_rank"] for d in docs] == [plans.index(p) + 1 for p in reversed(want)]
    assert "exposed dcn" in text and want[1].label() in text


def test_a_batch_the_slices_do_not_split_is_one_line_naming_both() -> None:
    with pytest.raises(ValueError) as e:
        planner.check_batch_slices(16, 3)
    assert str(e.value) == "--batch_size=16 does not split over --slices=3: pass a multiple of 3 (e.g. 15 or 18)."
    with pytest.raises(ValueError, match=r"pass a multiple of 4 \(e.g. 4\)\.$"):
        planner.check_batch_slices(2, 4)
    planner.check_batch_slices(18, 3)  # divides: no error


def test_hsdp_is_a_layout_across_slices_not_a_plan_of_one_slice() -> None:
    """The hsdp strategy's `data` axis runs across slices: inside one slice's chips it is no plan (nor a
    refusal); across slices fsdp inside each slice is the hsdp layout."""
    one, two = (plans_lib.plan_all(TINY.model, topo, 16)[0] for topo in (ONE, links.with_slices(ONE, 2)))
    assert "hsdp" not in {p.strategy for p in one + two} and "hsdp" not in plans_lib.runnable(TINY.model)[1]
    assert [p.label() for p in two if p.layout == "hsdp"] == ["dcn:2 x data:4,tensor:1"]
