"""The step-time model's pipeline tick loop (twinshard/hlo/tick_timing.py) on the manual twin's compiled
1F1B and zb_h1 steps: each trip priced at its slowest stage's branch, against pipeline.build's table.

The programs are test_pipeline's (pp on 4 stages of tiny's 4 layers, M = 4 micro-batches; its xdist
group, tests/harness/schedule.py), priced at unit rates: nothing new compiles.
"""

import functools

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
