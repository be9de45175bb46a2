"""The step-time model's pipeline tick loop (twinshard/hlo/tick_timing.py) on the manual twin's compiled
1F1B and zb_h1 steps: each trip priced at its slowest stage's branch, against pipeline.build's table.

The programs are test_pipeline's (pp on 4 stages of tiny's 4 layers, M = 4 micro-batches; its xdist
group, tests/harness/schedule.py), priced at unit rates: nothing new compiles.
"""

import functools
import pathlib

import pytest

from test_pipeline import M, compiled_step
from twinshard import hlo
from twinshard.hlo.pipeline_ticks import branch_op
from twinshard.parallel import pipeline

pytestmark = pytest.mark.pp
S = 4
RATES = hlo.Rates("unit", {"float32": 1e12, "bfloat16": 1e12}, 1e11)


@functools.cache
def priced(schedule: str) -> hlo.Prediction:
    return hlo.predict(compiled_step("manual", S, schedule), RATES, {"stage": S},
                       lambda op, axes, ring_bytes: (axes[0], ring_bytes / 1e10))


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_each_trip_takes_its_slowest_stages_branch_of_the_table(schedule):
    """Each stage-tick runs the branch of pipeline.build's op (idle, F, B, W); the same op on the same stage
    costs the same in every tick, the last stage's F more than a middle stage's (its lm_head and loss). The
    loop is, trip by trip, the body's other ops plus the slowest stage's op, priced from the table: neither
    stage 0's op alone nor the stages' ops summed, and shorter than trips x the longest branch."""
    pred, table = priced(schedule), pipeline.build(schedule, S, M)
    ticks, mod = pred.ticks, pred.schedule.module
    letters = [[pipeline.LETTER[a.kind] if a else None for a in row] for row in table.grid]
    assert [[branch_op(mod, r.branch) for r in row] for row in ticks.loop.runs] == letters
    price: dict[tuple[int, str | None], float] = {}
    for t, row in enumerate(letters):
        for s, op in enumerate(row):
            assert price.setdefault((s, op), ticks.cell_s[t][s]) == pytest.approx(ticks.cell_s[t][s])
    assert price[(S - 1, "F")] > 1.2 * price[(1, "F")]
    by_table = [[price[(s, op)] for s, op in enumerate(row)] for row in letters]
    body = pred.schedule.sequences[ticks.loop.body]
    other = sum(o.seconds for o in pred.ops if o.computation == body.name and o.name != ticks.loop.switch) + \
        sum(c.exposed_s for c in pred.collectives if c.window.computation == body.name)
    loop_row = next(o for o in pred.ops if o.name == ticks.loop.loop)
    assert loop_row.seconds == pytest.approx(sum(other + max(row) for row in by_table))
    assert loop_row.seconds != pytest.approx(sum(other + row[0] for row in by_table))
    assert loop_row.seconds != pytest.approx(sum(other + sum(row) for row in by_table))
    longest = max(pred.sequence_s[b] for b in ticks.loop.branches)
    assert loop_row.seconds < 0.8 * table.ticks * (other + longest)
    assert pred.compute_s + pred.exposed_s == pytest.approx(pred.step_s)


# ----------------------------------------------------------------------------- what the CPU programs lack
# tests/hlo_snippets/tick_loop_nested.hlo: 2 stages, 4 ticks of the table [[f, idle], [b, f], [idle, b], [f, f]],
# with a pred conditional in f (the last stage runs %head, the others %pass), an s32 conditional nested in %head
# (chunk = tick // 2: chunk 0 runs %no_loss, chunk 1 %loss) and a collective in b. The compiled pipelines here
# have none of these (no cond in a taken branch's cond, no pred index, no collective under the switch).
NESTED = (pathlib.Path(__file__).parent / "hlo_snippets" / "tick_loop_nested.hlo").read_text()
NEG, PERMUTE = 2e-6, 1e-6  # a negate of f32[250]: 2,000 B at 1 GB/s; each permute as link_seconds prices it
TABLE = [["f", "idle"], ["b", "f"], ["idle", "b"], ["f", "f"]]
LAST = 1


@functools.cache
def nested() -> hlo.Prediction:
    return hlo.predict(NESTED, hlo.Rates("test", {"bfloat16": 1e9}, 1e9), {"stage": 2},
                       lambda op, axes, ring_bytes: ("stage", PERMUTE))


def computations_run(t: int, s: int) -> list[str]:
    """What stage s runs in tick t, by hand: the table's branch; f then %head (the last stage) or %pass, and
    in %head the loss on chunk 1 only."""
    branch = TABLE[t][s]
    if branch != "f":
        return [branch]
    if s != LAST:
        return ["f", "pass"]
    return ["f", "head", "loss" if t // 2 == 1 else "no_loss"]


def seconds_by_hand(computation: str) -> float:
    """Each computation's own ops: f, head 1 negate; loss 4; b 3 negates and its permute; the rest nothing."""
    return {"f": NEG, "head": NEG, "loss": 4 * NEG, "b": 3 * NEG + PERMUTE}.get(computation, 0.0)


def test_a_conditional_inside_a_taken_branch_is_priced_as_taken():
    """Each stage-tick is the branches it takes, nested ones too, not their longest: stage 1's F costs
    f + head + no_loss = 4 us in tick 1 (chunk 0) and f + head + loss = 12 us in tick 3 (chunk 1), stage 0's
    F f + pass = 2 us. Each trip is its slowest stage, 2 + 7 + 7 + 12 = 28 us, plus per trip the body's
    permute (1 us) and its scalars' 57 B at 1 GB/s: dynamic-slice 8, reshape 8, convert 8, compare 9 (two
    s32 in, a pred out), divide 12, add 12."""
    ticks = nested().ticks
    cells = [[sum(seconds_by_hand(c) for c in computations_run(t, s)) for s in range(2)] for t in range(4)]
    assert [[r.branch for r in row] for row in ticks.loop.runs] == TABLE
    assert [c for row in ticks.cell_s for c in row] == pytest.approx([c for row in cells for c in row])
    assert ticks.tick_s == pytest.approx([max(row) for row in cells])
    assert nested().step_s == pytest.approx(sum(max(row) + PERMUTE + 57e-9 for row in cells))


def test_the_rows_under_the_switch_count_the_trips_their_stage_sets_the_time():
    """Every op and collective under the switch counts the trips in which the slowest stage (the first of
    equals) runs its computation: f in trips 0 and 3, pass 0, head and loss 3, b 1 and 2 (its permute too),
    no_loss and idle never; the body's ops every trip. So the rows add up to the step."""
    pred = nested()
    slowest = [max(range(2), key=lambda s: pred.ticks.cell_s[t][s]) for t in range(4)]
    assert slowest == [0, 0, 1, 1]
    trips = {c: sum(c in computations_run(t, s) for t, s in enumerate(slowest))
             for c in ("idle", "f", "pass", "head", "no_loss", "loss", "b")}
    rows = [(o.computation, o.name, o.runs) for o in pred.ops] + \
        [(c.window.computation, c.window.start, c.runs) for c in pred.collectives]
    assert {(comp, name): runs for comp, name, runs in rows} == \
        {(comp, name): trips.get(comp, 4 if comp == "tick" else 1) for comp, name, _ in rows}
    assert {c for c, _, _ in rows} == {"f", "head", "loss", "b", "tick", "main"}  # every priced computation
    assert pred.compute_s + pred.exposed_s == pytest.approx(pred.step_s)


# A tick table as XLA:TPU may hand it to the loop: moved to another memory space by an async copy, the
# switch's index read from the copy's destination at the partition's column (the zb_h1 step of
# gpt2_350m on v5e:2x2, JAX 0.12 / libtpu 0.0.50.1, wrote one).
TABLE_THROUGH_AN_ASYNC_COPY = """HloModule table_copy, is_scheduled=true, num_partitions=4

ENTRY %main () -> s32[] {
  %table = s32[4]{0} constant({3, 1, 4, 1})
  %start = (s32[4]{0:S(1)}, s32[4]{0}, u32[]) copy-start(%table)
  %moved = s32[4]{0:S(1)} copy-done(%start)
  %p = u32[] partition-id()
  %slot = s32[1]{0} dynamic-slice(%moved, %p), dynamic_slice_sizes={1}
  ROOT %index = s32[] reshape(%slot)
}
"""


def test_the_reader_follows_a_table_through_an_async_copy():
    """Each partition reads its own column of the copied table; the copy's third element (its context) is
    not a value the reader makes up."""
    from twinshard.hlo.evaluate import Frame, Unreadable
    from twinshard.hlo.parse import parse_module

    mod = parse_module(TABLE_THROUGH_AN_ASYNC_COPY)
    assert [int(Frame(mod, mod.entry, None, p).value("index")) for p in range(4)] == [3, 1, 4, 1]
    with pytest.raises(Unreadable, match="context"):
        Frame(mod, mod.entry, None, 0).value("start").get(2)
