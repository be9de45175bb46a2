"""The step-time model (twinshard/hlo/timing.py, twinshard/hardware/links.py, step_time.py) term by term, then
whole against a brute-force simulator (tests/step_sim.py: event by event, float64, loops unrolled) on
generated schedules. Pure Python on hand-written or generated HLO text: nothing compiles but the reference
convolutions of one test (a program of eight tiny convolutions run on ones).
"""

from __future__ import annotations

import functools
import pathlib
import re

import numpy as np
import pytest

import step_sim
from step_sim import Chip, Coll, Comp, predict
from twinshard import hlo
from twinshard.hardware import chips
from twinshard.hardware.links import Link, collective_seconds
from twinshard.hardware.step_time import rates

MESH = {"data": 2, "tensor": 4}


UNIT = Chip(peak=1e9, hbm=1e9, matmul_eff=0.5, hbm_eff=0.25,
            links={"data": (1e6, 2.0, 4e6), "tensor": (2e6, 1.5, 8e6)})


def coll(kind: str, axes: tuple[str, ...], rows: int, form: str = "async", name: str = "c") -> Coll:
    return Coll(name, kind, axes, rows, form)


# ----------------------------------------------------------------------------- each term on its own


def test_an_op_takes_the_longer_of_its_flops_and_its_bytes():
    """A [64,64] f32 matmul: 2 x 64^3 FLOPs at the f32 peak x 0.5, 3 x 16 KiB at HBM x 0.25: compute-bound;
    tanh of [64,64]: no FLOPs, 2 x 16 KiB: memory-bound."""
    pred = predict(Comp("main", [("dot", 64), ("tanh", 64)]), UNIT)
    dot, tanh = pred.ops
    assert (dot.kind, dot.flops, dot.bytes) == ("matmul", 2 * 64 ** 3, 3 * 64 * 64 * 4)
    assert dot.compute_s == pytest.approx(2 * 64 ** 3 / 0.5e9) and dot.memory_s == pytest.approx(49152 / 0.25e9)
    assert dot.seconds == dot.compute_s and dot.start_s == 0
    assert (tanh.kind, tanh.flops, tanh.compute_s) == ("memory", 0, 0)
    assert tanh.seconds == tanh.memory_s == pytest.approx(2 * 16384 / 0.25e9) and tanh.start_s == dot.seconds
    assert pred.step_s == pred.compute_s == pytest.approx(dot.seconds + tanh.seconds)
    assert pred.by_kind() == pytest.approx({"matmul": dot.seconds, "memory": tanh.seconds})


def test_a_batched_matmul_counts_its_batch_and_contracted_dims_at_its_dtypes_peak():
    """bf16[3,16,32] x bf16[3,16,8] contracting the 16s with batch 3: 2 x 3 x 32 x 8 x 16 FLOPs at the bf16 peak."""
    text = """HloModule m, is_scheduled=true
ENTRY %main (a: bf16[3,16,32], b: bf16[3,16,8]) -> bf16[3,32,8] {
  %a = bf16[3,16,32]{2,1,0} parameter(0)
  %b = bf16[3,16,8]{2,1,0} parameter(1)
  ROOT %d = bf16[3,32,8]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, rhs_batch_dims={0}, lhs_contracting_dims={1}, \
rhs_contracting_dims={1}
}
"""
    r = hlo.Rates("test", {"bfloat16": 3e9, "float32": 1e9}, 1e15)
    (op,) = hlo.predict(text, r).ops
    assert op.flops == 2 * 3 * 32 * 8 * 16 and op.compute_s == pytest.approx(op.flops / 3e9)
    (f32,) = hlo.predict(text.replace("bf16", "f32"), r).ops
    assert f32.compute_s == pytest.approx(op.flops / 1e9)



def test_each_unfused_op_kind_moves_its_own_bytes():
    """Bytes by hand, f32 = 4 bytes: an elementwise op reads its operands and writes its result; a slice
    (static, dynamic, gather) reads and writes only what it returns; an in-place update (dynamic-update-slice,
    scatter) reads and writes only its update, never the whole buffer it writes into."""
    text = """HloModule m, is_scheduled=true
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (buf: f32[64,32], upd: f32[2,32], i: s32[], idx: s32[2,1]) -> f32[64,32] {
  %buf = f32[64,32]{1,0} parameter(0)
  %upd = f32[2,32]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %idx = s32[2,1]{1,0} parameter(3)
  %z = s32[] constant(0)
  %sum = f32[64,32]{1,0} add(%buf, %buf)
  %sl = f32[8,32]{1,0} slice(%sum), slice={[0:8], [0:32]}
  %ds = f32[4,32]{1,0} dynamic-slice(%sum, %i, %z), dynamic_slice_sizes={4,32}
  %dus = f32[64,32]{1,0} dynamic-update-slice(%sum, %upd, %i, %z)
  ROOT %sc = f32[64,32]{1,0} scatter(%dus, %idx, %upd), update_window_dims={1}, inserted_window_dims={0}, \
scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}
"""
    r = hlo.Rates("test", {"float32": 1e9}, 1e9)
    got = {op.name: op.bytes for op in hlo.predict(text, r).ops if op.computation == "main"}
    buf, upd = 64 * 32 * 4, 2 * 32 * 4
    assert got == {"sum": 3 * buf, "sl": 2 * 8 * 32 * 4, "ds": 2 * 4 * 32 * 4, "dus": 2 * upd, "sc": 2 * upd}


# (kind, axes, result rows) -> ring bytes by hand: f32[rows,4] is 16 x rows bytes; group of 4 on tensor, 2 on data
RING_BYTES = [
    ("all-gather", ("tensor",), 16, 3 / 4 * 256),  # (n-1)/n of the gathered result
    ("all-gather", ("data",), 16, 1 / 2 * 256),
    ("all-reduce", ("tensor",), 16, 2 * 3 / 4 * 256),  # reduce-scatter then all-gather: 2 (n-1)/n
    ("all-reduce", ("data", "tensor"), 16, 2 * 7 / 8 * 256),
    ("reduce-scatter", ("tensor",), 8, 3 * 128),  # (n-1) x its result, the shard
    ("all-to-all", ("tensor",), 16, 3 / 4 * 256),  # (n-1)/n, then x the link's all-to-all factor
    ("collective-permute", ("data",), 16, 256),  # the whole buffer, one hop
]


@pytest.mark.parametrize("kind, axes, rows, ring", RING_BYTES, ids=[f"{k}-{','.join(a)}" for k, a, *_ in RING_BYTES])
def test_each_kind_of_collective_sends_its_ring_bytes_over_its_axis(kind, axes, rows, ring):
    pred = predict(Comp("main", [("sync", coll(kind, axes, rows, "sync"))]), UNIT)
    (c,) = pred.collectives
    assert c.window.ring_bytes == pytest.approx(ring)
    slowest = "data" if "data" in axes else "tensor"  # data's link is the slower one
    rate, a2a, hop = UNIT.links[slowest]
    want = ring / hop if kind == "collective-permute" else ring * (a2a if kind == "all-to-all" else 1) / rate
    assert (c.axis, c.comm_s) == (slowest, pytest.approx(want))
    assert c.exposed_s == c.comm_s and pred.step_s == pytest.approx(want)  # nothing to hide it behind
    assert set(pred.axes) == {slowest} and pred.axes[slowest].comm_s == pytest.approx(want)


def test_collective_seconds_charges_the_slowest_axis_and_refuses_a_missing_one():
    links = {"data": Link(1e6, "slow", 2.0, 5e6), "tensor": Link(4e6, "fast", 3.0, None)}
    assert collective_seconds("all-reduce", ("data", "tensor"), 8e6, links) == ("data", 8.0)
    assert collective_seconds("all-to-all", ("tensor",), 8e6, links) == ("tensor", 6.0)
    assert collective_seconds("collective-permute", ("data",), 1e7, links) == ("data", 2.0)  # its hop rate
    assert collective_seconds("collective-permute", ("tensor",), 8e6, links) == ("tensor", 2.0)  # none: the link's
    with pytest.raises(ValueError, match=r"no link bandwidth for mesh axes \['expert'\]"):
        collective_seconds("all-gather", ("expert",), 1.0, links)


def test_collectives_on_one_link_go_one_after_another_and_other_links_run_beside_them():
    """Three all-gathers issued back to back: the two over tensor share its link (the second begins when the
    first ends), the one over data runs at once on its own; the matmul after them hides what it can."""
    a, b, d = (coll("all-gather", ax, 64, name=n) for ax, n in ((("tensor",), "a"), (("tensor",), "b"),
                                                                (("data",), "d")))
    prog = Comp("main", [("start", a), ("start", b), ("start", d), ("dot", 64), ("done", a), ("done", b),
                         ("done", d)])
    pred = predict(prog, UNIT)
    ta, tb, td = pred.collectives
    assert (ta.begin_s, ta.end_s) == (0, pytest.approx(ta.comm_s))
    assert (tb.issue_s, tb.begin_s, tb.end_s) == (0, pytest.approx(ta.end_s), pytest.approx(ta.end_s + tb.comm_s))
    assert (td.begin_s, td.end_s) == (0, pytest.approx(td.comm_s))
    mm = 2 * 64 ** 3 / 0.5e9
    assert ta.exposed_s == pytest.approx(max(ta.comm_s - mm, 0))
    assert tb.exposed_s == pytest.approx(max(tb.end_s - max(mm, ta.end_s), 0))
    assert pred.step_s == pytest.approx(max(mm, tb.end_s, td.end_s))
    assert pred.axes["tensor"].comm_s == pytest.approx(ta.comm_s + tb.comm_s)


def test_compute_inside_a_window_hides_its_transfer_and_the_rest_is_exposed():
    """An all-gather over data of f32[64,4] (1 KiB, 512 B sent at 1 MB/s: 512 us) around k matmuls (2 x 32^3
    FLOPs at 0.5 GFLOP/s: 131 us each): hidden is the compute inside, up to the transfer; exposed the rest."""
    mm = 2 * 32 ** 3 / 0.5e9
    comm = 512 / 1e6
    for k in range(6):
        g = coll("all-gather", ("data",), 64)
        pred = predict(Comp("main", [("start", g), *[("dot", 32)] * k, ("done", g), ("dot", 32)]), UNIT)
        (c,) = pred.collectives
        assert c.comm_s == pytest.approx(comm)
        assert c.hidden_s == pytest.approx(min(k * mm, comm)) and c.exposed_s == pytest.approx(max(comm - k * mm, 0))
        assert c.done_s == pytest.approx(max(k * mm, comm))
        assert pred.step_s == pytest.approx(pred.compute_s + pred.exposed_s)


def test_loops_multiply_their_bodys_collectives_per_axis():
    """A psum over tensor in an inner loop of 3 trips inside an outer one of 2, and a gather over data in the
    outer body: per step the tensor link carries 6 psums, the data link 2 gathers; the step is their sum."""
    psum, gather = coll("all-reduce", ("tensor",), 16, "sync", "psum"), coll("all-gather", ("data",), 16, "sync", "g")
    inner = Comp("main_l_l", [("count",), ("sync", psum)], trips=3)
    outer = Comp("main_l", [("count",), ("loop", inner), ("sync", gather)], trips=2)
    pred = predict(Comp("main", [("loop", outer)]), UNIT)
    runs = {c.window.start: (c.runs, c.comm_s) for c in pred.collectives}
    assert {k: r for k, (r, _) in runs.items()} == {"psum": 6, "g": 2}
    assert pred.axes["tensor"].comm_s == pytest.approx(6 * runs["psum"][1])
    assert pred.axes["data"].comm_s == pytest.approx(2 * runs["g"][1])
    count = 12 / 0.25e9  # the counter's add: 12 bytes
    body = count + 3 * (count + runs["psum"][1]) + runs["g"][1]
    assert pred.sequence_s["main_l"] == pytest.approx(body) and pred.step_s == pytest.approx(2 * body)
    assert pred.compute_s == pytest.approx(2 * count + 6 * count)


def test_the_chip_tables_rates():
    """step_time.rates: v5e's measured efficiencies by default, its bf16 and int8 peaks, float32 at the bf16
    peak (TPU); an Efficiency given replaces them; a GPU's float32 runs at TF32."""
    v5e = rates("v5e")
    assert v5e.matmul_flops_per_s == {"bfloat16": 197e12, "float32": 197e12, "int8": 394e12}
    assert (v5e.matmul_efficiency, v5e.hbm_efficiency, v5e.hbm_bytes_per_s) == (0.924, 0.757, 8.19e11)
    assert v5e.splash_by_head_dim == chips.EFFICIENCIES["v5e"].splash_by_head_dim
    mine = rates("v5e", chips.Efficiency(matmul_efficiency=0.5))
    assert (mine.matmul_efficiency, mine.hbm_efficiency, mine.splash_by_head_dim) == (0.5, 1.0, ())
    h100 = rates("h100")
    assert h100.matmul_flops_per_s["float32"] == 494.7e12 and h100.matmul_efficiency == 1.0


# ----------------------------------------------------------------------------- against the simulator


CASES = 250


@pytest.fixture(scope="module")
def generated():
    """CASES random programs on random chips: (program, chip, the model's prediction, the simulated step)."""
    out = []
    for seed in range(CASES):
        rng = np.random.default_rng(seed)
        chip = step_sim.random_chip(rng)
        prog = step_sim.random_program(rng, chip)
        out.append((prog, chip, predict(prog, chip), step_sim.simulate(prog, chip)))
    return out


def close(a: float, b: float) -> bool:
    return bool(np.isclose(a, b, rtol=1e-9, atol=1e-15))  # seconds: steps here take 1e-6 to 1e-2 s


def test_the_generated_schedules_hold_every_case(generated):
    """The draw is not degenerate: loops in loops, overlapping pairs, carried starts, queued transfers,
    every kind of collective, hidden and exposed transfers all occur."""
    seen: dict[str, int] = {}

    def note(what: str, yes: bool) -> None:
        seen[what] = seen.get(what, 0) + int(yes)

    for _, _, pred, sim in generated:
        note("nested loop", any(s.runs > s.trips for s in pred.schedule.loops))
        note("carried", any(w.carried for w in pred.schedule.windows()))
        note("overlap", any(a.issue < b.issue < a.done < b.done for s in pred.schedule.sequences.values()
                            for a in s.windows for b in s.windows))
        note("nested pair", any(a.issue < b.issue < b.done < a.done for s in pred.schedule.sequences.values()
                                for a in s.windows for b in s.windows))
        note("queued", any(x.begin > x.issue for x in sim.transfers))
        note("hidden", any(c.hidden_s > 0 for c in pred.collectives))
        note("exposed", any(c.exposed_s > 0 for c in pred.collectives))
        for kind in step_sim.KINDS:
            note(kind, any(c.window.op == kind for c in pred.collectives))
    assert min(seen.values()) >= 10, seen


def test_the_model_is_the_simulated_step(generated):
    for prog, chip, pred, sim in generated:
        assert close(pred.step_s, sim.seconds), step_sim.hlo_text(prog)
        assert close(pred.compute_s, sim.compute)
        assert close(pred.step_s, pred.compute_s + pred.exposed_s)


def test_each_collective_is_its_simulated_runs(generated):
    """Every run of a collective in the simulation (each trip unrolled) has the model's transfer, issue,
    begin, end and exposed time, measured from the start of its computation's run; as many runs as the model's."""
    for prog, _, pred, sim in generated:
        runs: dict[str, list[step_sim.Transfer]] = {}
        for x in sim.transfers:
            runs.setdefault(x.name, []).append(x)
        model = {c.window.start: c for c in pred.collectives}
        assert set(model) == set(runs), step_sim.hlo_text(prog)
        for name, c in model.items():
            assert c.runs == len(runs[name])
            for x in runs[name]:
                assert c.axis == x.link and close(c.comm_s, x.comm) and close(c.exposed_s, x.exposed)
                assert close(c.hidden_s, x.hidden), name
                assert all(close(a, b - x.run_start) for a, b in
                           ((c.issue_s, x.issue), (c.begin_s, x.begin), (c.end_s, x.end))), name


def test_each_axis_is_the_sum_of_its_simulated_transfers(generated):
    for _, _, pred, sim in generated:
        want: dict[str, list[float]] = {}
        for x in sim.transfers:
            t = want.setdefault(x.link, [0.0, 0.0, 0.0])
            t[0] += x.comm
            t[1] += x.hidden
            t[2] += x.exposed
        assert set(pred.axes) == set(want)
        for axis, (comm, hidden, exposed) in want.items():
            got = pred.axes[axis]
            assert close(got.comm_s, comm) and close(got.hidden_s, hidden) and close(got.exposed_s, exposed)
            assert close(got.comm_s, got.hidden_s + got.exposed_s)  # each wait lies in its link's transfers


def test_a_matmul_dtype_without_a_peak_is_priced_at_bf16_or_refused():
    """A float32 matmul at a Rates listing only float32 is priced at it (the bfloat16 fallback used to be
    looked up first, a KeyError); one listing neither its dtype nor bfloat16 raises naming both."""
    one = Comp("main", [("dot", 64)])
    r = hlo.Rates("test", {"float32": 2e9}, 1e15)
    (op,) = hlo.predict(step_sim.hlo_text(one), r, MESH).ops
    assert op.compute_s == pytest.approx(2 * 64 ** 3 / 2e9)
    assert hlo.Rates("test", {"bfloat16": 4e9}, 1e15).peak("float32") == 4e9
    with pytest.raises(ValueError, match=r"no peak for float32 matmuls and no bfloat16 one.*add a 'float32' or"):
        hlo.predict(step_sim.hlo_text(one), hlo.Rates("test", {"int8": 1e9}, 1e15), MESH)


def test_a_wait_behind_another_transfer_hides_nothing():
    """Two all-gathers over tensor, completed in reverse order with no compute between: the second's done waits
    for both transfers (its exposed time is longer than its own), the first's then waits for nothing. Nothing
    ran beside them: the axis hid nothing, all of its transfer time is exposed."""
    a, b = coll("all-gather", ("tensor",), 64, name="a"), coll("all-gather", ("tensor",), 64, name="b")
    pred = predict(Comp("main", [("start", a), ("start", b), ("done", b), ("done", a)]), UNIT)
    ta, tb = sorted(pred.collectives, key=lambda c: c.window.start)
    assert tb.exposed_s == pytest.approx(ta.comm_s + tb.comm_s) and ta.exposed_s == 0
    assert ta.hidden_s == tb.hidden_s == 0  # the first one's transfer ran while the second's done waited
    t = pred.axes["tensor"]
    assert (t.comm_s, t.exposed_s, t.hidden_s) == (pytest.approx(pred.step_s), pytest.approx(pred.step_s), 0)


def test_a_called_computation_runs_at_each_call_and_a_conditional_takes_its_longest_branch():
    """call_conditional.hlo: %sync_grads (a psum over data, f32[4,4]: 2 x 1/2 x 64 B at 1 MB/s = 64 us) is called
    twice; the conditional's branches are a gather over a group of one (no transfer) and a permute over data
    (64 B at its hop's 4 MB/s = 16 us): the step runs both calls and the longer branch, 144 us."""
    text = (pathlib.Path(__file__).parent / "hlo_snippets" / "call_conditional.hlo").read_text()
    links = {a: Link(rate, "test", a2a, hop) for a, (rate, a2a, hop) in UNIT.links.items()}
    pred = hlo.predict(text, hlo.Rates("test", {"bfloat16": 1e9}, 1e9), MESH,
                       lambda op, axes, b: collective_seconds(op, axes, b, links))
    comm = {c.window.start: (c.comm_s, c.runs) for c in pred.collectives}
    assert comm == {"called_psum": (pytest.approx(64e-6), 2), "then_gather": (0, 1),
                    "else_permute": (pytest.approx(16e-6), 1)}
    assert pred.step_s == pytest.approx(2 * 64e-6 + 16e-6)
    calls = [o for o in pred.ops if o.kind == "loop"]
    assert [(o.name, o.seconds) for o in calls] == [("c1", pytest.approx(64e-6)), ("c2", pytest.approx(64e-6)),
                                                    ("cond", pytest.approx(16e-6))]
    assert pred.axes["data"].comm_s == pytest.approx(2 * 64e-6 + 16e-6)  # the totals count every branch


@functools.cache
def tick_loop_prediction() -> hlo.Prediction:
    text = (pathlib.Path(__file__).parent / "hlo_snippets" / "tick_loop.hlo").read_text()
    return hlo.predict(text, hlo.Rates("test", {"bfloat16": 1e9}, 1e9), {"stage": 2},
                       lambda op, axes, b: ("stage", 1e-6))


def test_a_tick_loop_takes_each_trip_at_its_slowest_stages_branch():
    """tick_loop.hlo: 2 stages, 4 ticks; each picks idle (0 s), f (2 us) or b (6 us) from the table
    [[f, idle], [b, f], [idle, b], [f, f]] by its partition id, then a permute of 1 us. Each trip is its
    slowest stage's branch: 2 + 6 + 6 + 2 = 16 us (stage 0 alone: 10, stage 1 alone: 10, both summed:
    20, the longest branch every trip: 24), plus per trip the permute and the counter's and the
    table's 36 B at 1 GB/s. The rows add up to it: f's and b's ops count the 2 trips each sets the time."""
    pred = tick_loop_prediction()
    ticks = pred.ticks
    assert [[r.branch for r in row] for row in ticks.loop.runs] == [["f", "idle"], ["b", "f"], ["idle", "b"], ["f", "f"]]
    assert np.allclose(ticks.cell_s, [[2e-6, 0], [6e-6, 2e-6], [0, 6e-6], [2e-6, 2e-6]])
    assert np.allclose(ticks.tick_s, [2e-6, 6e-6, 6e-6, 2e-6])
    assert pred.step_s == pytest.approx(16e-6 + 4 * (1e-6 + 36e-9))
    assert pred.sequence_s["tick"] == pytest.approx(pred.step_s / 4)  # the mean trip
    runs = {o.name: o.runs for o in pred.ops if o.computation in ("f", "b")}
    assert runs == {"f_neg": 2, "b_neg1": 2, "b_neg2": 2, "b_neg3": 2}
    assert pred.compute_s + pred.exposed_s == pytest.approx(pred.step_s)
    assert pred.exposed_s == pytest.approx(4e-6)


def test_a_tick_loops_record_and_table_show_its_trips_in_their_units():
    """tick_loop.hlo's ticks as the previous test works them out: cells [[2, 0], [6, 2], [0, 6], [2, 2]] us,
    each tick the slowest cell (the first of equals: stages 0, 0, 1, 0), each trip its tick + the permute's
    1 us + 36 ns of scalars. as_dict holds them in seconds under their own names; the table prints the ticks'
    range in ms (2 us = 0.002 ms) and the slowest stage of each trip."""
    cells = [[2e-6, 0.0], [6e-6, 2e-6], [0.0, 6e-6], [2e-6, 2e-6]]
    ticks = [max(row) for row in cells]
    record = tick_loop_prediction().as_dict()["ticks"]
    assert set(record) == {"tick_s", "trip_s", "cell_s"}
    assert record["tick_s"] == pytest.approx(ticks)
    assert record["trip_s"] == pytest.approx([t + 1e-6 + 36e-9 for t in ticks])
    assert [c for row in record["cell_s"] for c in row] == pytest.approx([c for row in cells for c in row])
    line = next(x for x in tick_loop_prediction().table().splitlines() if "tick loop" in x)
    low, high, slowest = re.search(r", ([\d.]+)-([\d.]+) ms; slowest stage by trip (\d+)$", line).groups()
    in_ms = pytest.approx([min(ticks) * 1e3, max(ticks) * 1e3], abs=5e-4)  # 0.002-0.006 to the 3 decimals printed
    assert [float(low), float(high)] == in_ms
    assert slowest == "".join(str(row.index(max(row))) for row in cells) == "0010"


# Convolutions as JAX writes them, each (lhs shape, rhs shape, conv_general_dilated's arguments): padding, strides,
# lhs (input) and rhs (kernel) dilation per spatial dimension, and each group count; with a dot as TPU writes one
# (no spatial dimension) and two spatial dimensions that differ in every window field.
CONVS = {
    "valid": ((2, 3, 9), (4, 3, 3), {}),
    "padded, strided": ((2, 3, 9), (4, 3, 4), dict(window_strides=(3,), padding=[(3, 2)])),
    "input dilated": ((2, 3, 5), (4, 3, 3), dict(padding=[(2, 1)], lhs_dilation=(2,))),
    "kernel dilated": ((2, 3, 9), (4, 3, 3), dict(padding=[(1, 1)], rhs_dilation=(2,))),
    "feature groups": ((2, 6, 8), (9, 2, 3), dict(padding=[(1, 1)], feature_group_count=3)),
    "batch groups": ((6, 3, 7), (4, 3, 3), dict(window_strides=(2,), padding=[(1, 2)], rhs_dilation=(2,),
                                                batch_group_count=2)),
    "2-d": ((2, 2, 6, 5), (3, 2, 3, 2), dict(window_strides=(2, 1), padding=[(1, 1), (0, 1)], lhs_dilation=(1, 2),
                                              rhs_dilation=(2, 1))),
    "a dot": ((4, 6), (5, 6), {}),
}


def test_a_convolutions_flops_count_the_products_that_land_on_real_input():
    """Each of CONVS lowered by JAX, priced by the step-time model: 2 x the multiply-adds XLA runs, counted by
    running it on ones (each output element is then its count of kernel taps on real input, not padding nor a
    dilation hole, times the input features of its group)."""
    import jax
    import jax.numpy as jnp

    def conv(args, lhs, rhs):
        dims = "NCHW"[:lhs.ndim], "OIHW"[:rhs.ndim], "NCHW"[:lhs.ndim]
        return jax.lax.conv_general_dilated(lhs, rhs, **{"window_strides": (1,) * (lhs.ndim - 2),
                                                         "padding": [(0, 0)] * (lhs.ndim - 2), **args},
                                            dimension_numbers=dims)

    ones = [(jnp.ones(a, jnp.float32), jnp.ones(b, jnp.float32)) for a, b, _ in CONVS.values()]
    products = jax.jit(lambda xs: [jnp.sum(conv(args, *x)) for (_, _, args), x in zip(CONVS.values(), xs)])(ones)
    r = hlo.Rates("test", {"float32": 1e9}, 1e15)
    for (name, (_, _, args)), x, n in zip(CONVS.items(), ones, products):
        text = jax.jit(functools.partial(conv, args)).lower(*x).as_text(dialect="hlo")
        for group in ("feature_group_count", "batch_group_count"):
            assert (f"{group}={args.get(group)}" in text) == (group in args), (name, text)  # the case is what it says
        (op,) = hlo.predict(text, r).ops
        assert (op.opcode, op.flops) == ("convolution", 2 * float(n)), (name, text)
