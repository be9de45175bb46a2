"""A pipeline step read from its compiled program (twinshard/hlo/pipeline_ticks.py) against the table that
built it (pipeline.build), its drawing against the reading, and the memory model's activations in flight
against the compiled temporaries' growth per micro-batch.

The programs are test_pipeline's (pp on 4 stages of tiny's 4 layers, micro-batches of 2 sequences;
its xdist group, tests/harness/schedule.py): M = 4 is the twin tests' step, M = 8 its memory tests';
interleaved (V = 2 chunks of one layer) its 2-stage twins'; pp_fsdp's (stage:2,data:2) its ledger tests'; only
zb_h1 at M = 8 compiles here alone.
"""

import functools
import pathlib
import xml.etree.ElementTree as ET
from fractions import Fraction

import pytest

from test_pipeline import CFG, M, V, reading
from twinshard import cost
from twinshard.hlo import draw_pipeline
from twinshard.hlo.pipeline_ticks import Cell, pipeline_ticks
from twinshard.hlo.records import parsed_module
from twinshard.hlo.tick_timing import tick_loop
from twinshard.parallel import pipeline

pytestmark = pytest.mark.pp
S = 4
MESH = {"stage": S}
SVG = "{http://www.w3.org/2000/svg}"


@functools.cache
def read(impl: str, schedule: str, stages: int = S):
    """The reader's Ticks of the twin tests' compiled step (M = 4; interleaved: on 2 stages): its text as
    test_pipeline kept it (test_pipeline.reading), else compiled from an untrained runner."""
    return pipeline_ticks(reading("pp", impl, stages, schedule)[0], {"stage": stages})


def table_cells(sched: pipeline.Schedule) -> list[list[Cell | None]]:
    """The table's grid as the reader's cells (B for a whole backward and for zb_h1's input gradient; the
    device's local chunk j // S of virtual stage j)."""
    return [[Cell(pipeline.LETTER[a.kind], a.microbatch, a.stage // sched.stages) if a else None for a in row]
            for row in sched.grid]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_the_compiled_tick_loop_runs_the_table(schedule):
    """The manual twin's step, read from its HLO: one while of the table's ticks, and per tick each stage's
    op and micro-batch, equal to pipeline.build's grid cell by cell; the measured bubble share is the
    table's, for 1F1B the formula (S-1)/(M+S-1). Stages 1..3 differ from stage 0 in every schedule
    here, so a reader that evaluated every stage as partition 0 fails."""
    ticks, sched = read("manual", schedule), pipeline.build(schedule, S, M)
    assert ticks.form == "table" and ticks.loops[0][1] == sched.ticks == ticks.ticks
    assert [list(row) for row in ticks.grid] == table_cells(sched), ticks.text() + "\n" + sched.text()
    assert ticks.bubble() == sched.bubble()
    if schedule == "1f1b":
        assert ticks.bubble() == Fraction(S - 1, M + S - 1)
    else:  # zb_h1: the W's fill 1F1B's idle ticks: 12 of 60 stage-ticks against 1F1B's 24 of 56
        assert ticks.bubble() == Fraction(12, 60) < Fraction(S - 1, M + S - 1)
    assert len({tuple(row[s] for row in ticks.grid) for s in range(S)}) == S


@pytest.mark.pp_fsdp
def test_pp_fsdp_reads_each_stage_at_its_own_partitions():
    """pp_fsdp's manual 1F1B step on stage:2,data:2 (M = 4), read from its HLO, equals pipeline.build's grid
    cell by cell. `stage` is the outer mesh axis, so stage s's devices are partitions 2s and 2s + 1: a reader
    that took partition s for stage s would read stage 0's second data shard as stage 1 and draw stage 0's
    ops twice. (Its program is test_pipeline's ledger test's: the text that module kept, test_pipeline.reading.)"""
    ticks = pipeline_ticks(reading("pp_fsdp", "manual", "1f1b")[0], {"stage": 2, "data": 2})  # FSDP_MESH
    sched = pipeline.build("1f1b", 2, M)
    assert ticks.form == "table" and ticks.stages == 2
    assert [list(row) for row in ticks.grid] == table_cells(sched), ticks.text() + "\n" + sched.text()
    assert [row[0] for row in ticks.grid] != [row[1] for row in ticks.grid]


@pytest.mark.parametrize("impl", ["manual", "auto"])
def test_gpipe_is_read_from_its_loops(impl):
    """GPipe has no table: both twins compute every stage every tick. Read from the loop structure: the
    forward loop and its transpose, M + S - 1 ticks each, M micro-batches (the batch's tokens over a
    hand-off's), so the bubble is (S-1)/(M+S-1). Its forward ticks are the table's; its backward runs
    the micro-batches last first (the transposed loop runs the ticks backwards), the table's
    backward with micro-batch i as M-1-i."""
    ticks = read(impl, "gpipe")
    assert ticks.form == "structure" and [n for _, n in ticks.loops] == [M + S - 1] * 2
    assert ticks.bubble() == Fraction(S - 1, M + S - 1)
    mirrored = [[Cell(c.op, M - 1 - c.microbatch) if c and c.op == "B" else c for c in row]
                for row in table_cells(pipeline.build("gpipe", S, M))]
    assert [list(row) for row in ticks.grid] == mirrored, ticks.text()


@pytest.mark.parametrize("impl", ["manual", "auto"])
def test_interleaved_is_read_with_its_chunks(impl):
    """--schedule=interleaved, S = 2, V = 2, M = 4. The manual twin runs Megatron's table: read from its
    branch tables, each op's chunk from the block of the stage's weights its branch slices, equal to
    pipeline.build's grid cell by cell. The GSPMD twin runs MaxText's circular loop: read from its
    structure, V M + S - 1 = 9 ticks each way (GPipe's M + S - 1 = 5), equal to pipeline.circular's grid.
    Both measure the bubble (S-1)/(V M+S-1) = 1/9, not GPipe's 1/5; a reader that took every op for
    chunk 0, or the circular loop's ticks past M for bubbles, fails here."""
    stages = 2
    ticks = read(impl, "interleaved", stages)
    sched = pipeline.build("interleaved", stages, M, V) if impl == "manual" else pipeline.circular(stages, M, V)
    assert ticks.form == ("table" if impl == "manual" else "structure")
    assert [n for _, n in ticks.loops] == ([sched.ticks] if impl == "manual" else [V * M + stages - 1] * 2)
    assert [list(row) for row in ticks.grid] == table_cells(sched), ticks.text() + "\n" + sched.text()
    assert ticks.virtual == V and ticks.text().splitlines()[1:] == sched.text().splitlines()[1:]  # F0.1: chunk 1
    assert ticks.bubble() == sched.bubble() == Fraction(stages - 1, V * M + stages - 1)


@pytest.mark.parametrize("schedule, stages, n", [("zb_h1", S, 15), ("interleaved", 2, 18)])
def test_the_picture_draws_the_reading(schedule, stages, n):
    """pipeline_svg of the read manual step, parsed back: one box per op the reader found, at its stage
    lane and tick, with its op, micro-batch, chunk and colour (interleaved labels F0.1: chunk 1); nothing
    where the stage idles."""
    ticks = read("manual", schedule, stages)
    root = ET.fromstring(draw_pipeline.pipeline_svg([("manual", ticks)]))
    band = next(g for g in root.iter(SVG + "g") if g.get("class") == "pipeline")
    assert (band.get("data-twin"), int(band.get("data-ticks")), int(band.get("data-stages"))) == ("manual", n, stages)
    assert float(band.get("data-bubble")) == pytest.approx(float(ticks.bubble()))
    drawn = {}
    for g in band.iter(SVG + "g"):
        if g.get("class") == "op":
            key = (int(g.get("data-tick")), int(g.get("data-stage")))
            assert key not in drawn, key
            drawn[key] = Cell(g.get("data-op"), int(g.get("data-microbatch")), int(g.get("data-chunk")))
            assert g.find(SVG + "rect").get("fill") == draw_pipeline.OP_COLOURS[drawn[key].op]
            assert g.find(SVG + "text").text == drawn[key].label(chunked=schedule == "interleaved")
    assert drawn == {(t, s): c for t, row in enumerate(ticks.grid) for s, c in enumerate(row) if c is not None}
    assert {c.chunk for c in drawn.values()} == set(range(V if schedule == "interleaved" else 1))


def test_each_conditional_in_a_branch_takes_the_branch_its_index_names():
    """tests/hlo_snippets/tick_loop_nested.hlo (2 stages, 4 ticks, the table [[f, idle], [b, f], [idle, b],
    [f, f]]): inside f a pred conditional on "last stage?" (stage == 1), whose true runs its first branch
    %head (lax.cond's true_computation) and false %pass, and inside %head an s32 one on the chunk tick // 2
    that runs branch 0 %no_loss or 1 %loss. Every (tick, stage) with the conditionals it passes and the
    branch each takes, by hand: a pred read inverted puts the head on stage 0."""
    text = (pathlib.Path(__file__).parent / "hlo_snippets" / "tick_loop_nested.hlo").read_text()
    table = [["f", "idle"], ["b", "f"], ["idle", "b"], ["f", "f"]]

    def choices(t: int, s: int) -> tuple:
        if table[t][s] != "f":
            return ()
        if s != 1:  # pred false
            return (("last_stage", "pass"),)
        return (("last_stage", "head"), ("loss_of_chunk", ["no_loss", "loss"][t // 2]))

    loop = tick_loop(parsed_module(text), {"stage": 2})
    assert [[(r.branch, r.choices) for r in row] for row in loop.runs] == \
        [[(table[t][s], choices(t, s)) for s in range(2)] for t in range(4)]


# ----------------------------------------------------------------------------- memory per micro-batch
# The compiled temporaries at M = 4 and 8 micro-batches of 2 sequences (the batch grows with M): their
# growth per micro-batch against the memory model's. GPipe keeps every tick's residuals (M + S - 1
# ticks), 1F1B and zb_h1 at most S micro-batches in rings sized by the table, so theirs does not grow.
# Measured (JAX 0.12, XLA:CPU, bytes per micro-batch, compiled / model): gpipe 755,968 / 559,104,
# 1f1b 48 / 0, zb_h1 64 / 0. GPipe's excess (0.35 of a micro-batch's activations) is what its transposed
# tick loop keeps per tick beyond the layers' residuals the model counts (test_pipeline.py's memory notes).
# The bound, in micro-batches of a stage's activations (the model's GPipe growth per micro-batch):
SLOPE_BOUND = {"gpipe": 0.4, "1f1b": 0.01, "zb_h1": 0.01}


def temp_slope(schedule: str) -> tuple[float, float, float]:
    """(compiled, modelled) temporaries' growth per micro-batch from M = 4 to 8, and the unit: one
    micro-batch's saved activations of a stage (the model's per-micro-batch growth under GPipe)."""
    def model(s: str, m: int) -> int:
        return cost.memory(CFG.model, "pp", {"stage": S, "data": 1}, 2 * m, CFG.model.context_length,
                           microbatches=m, schedule=s).temporaries

    temp = [reading("pp", "manual", S, schedule)[1], reading("long", schedule, 2 * M)[1]]
    unit = (model("gpipe", 2 * M) - model("gpipe", M)) / M
    return (temp[1] - temp[0]) / M, (model(schedule, 2 * M) - model(schedule, M)) / M, unit


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_activations_in_flight_grow_per_microbatch_as_the_model_says(schedule):
    """The compiled temporaries' growth per micro-batch is the model's within SLOPE_BOUND micro-batches
    of a stage's activations: GPipe grows by about that unit, 1F1B and zb_h1 by almost nothing
    (at most S micro-batches held). A model that priced 1F1B or zb_h1 as M micro-batches would grow by
    a unit per micro-batch and fail here."""
    compiled, modelled, unit = temp_slope(schedule)
    assert abs(compiled - modelled) <= SLOPE_BOUND[schedule] * unit, (compiled, modelled, unit)
    if schedule == "gpipe":
        assert compiled >= unit  # every micro-batch's residuals live until the backward loop
    else:
        assert abs(compiled) <= SLOPE_BOUND[schedule] * unit
