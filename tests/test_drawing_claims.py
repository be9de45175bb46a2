"""What the timeline drawing (twinshard/hlo/draw.py), the prediction's table and launch.collectives' side-by-side
table claim, checked against the numbers they are drawn from: box positions and widths against the schedule's
times (loops collapsed to one iteration), SVG geometry against the boxes, lane and table figures against the
model's per-axis sums, TOTAL rows against the rows above them. Generated programs (tests/step_sim.py) and
hand-written HLO: nothing compiles.
"""

from __future__ import annotations

import pathlib
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import step_sim
from step_sim import predict
from twinshard import hlo
from twinshard.hlo import draw
from twinshard.hlo.timing import seconds

SVG = "{http://www.w3.org/2000/svg}"
SNIPPETS = pathlib.Path(__file__).parent / "hlo_snippets"


@pytest.fixture(scope="module")
def predictions() -> list[hlo.Prediction]:
    out = []
    for seed in range(60):
        rng = np.random.default_rng(1000 + seed)
        chip = step_sim.random_chip(rng)
        out.append(predict(step_sim.random_program(rng, chip), chip))
    return out


def drawn_length(pred: hlo.Prediction, seq: hlo.Sequence) -> float:
    """One run of `seq` with each loop in it drawn as one iteration of its body (itself drawn so)."""
    length = pred.sequence_s[seq.name]
    for op in (o for o in pred.ops if o.computation == seq.name and o.kind == "loop"):
        (body,) = pred.schedule.branches(next(i for i in seq.order if i.name == op.name))
        length -= op.seconds - drawn_length(pred, body)
    return length


def close(a: float, b: float) -> bool:
    return bool(np.isclose(a, b, rtol=1e-9, atol=1e-15))


def test_the_drawing_is_one_iteration_of_each_loop(predictions):
    """The axis is the step with every loop collapsed to one iteration of its body; each loop's strip is as
    wide as that iteration, says its trip count, is coloured by its body's most common phase, and holds its
    body's boxes."""
    for pred in predictions:
        boxes, length = draw.boxes(pred)
        assert close(length, drawn_length(pred, pred.schedule.entry))
        loops = [b for b in boxes if b.lane == "loops"]
        assert len(loops) == sum(1 for o in pred.ops if o.kind == "loop")
        for b in loops:
            data = dict(b.data)
            body = pred.schedule.sequences[data["body"]]
            assert int(data["trips"]) == body.trips
            phases = [o.phase for o in pred.ops if o.computation == body.name and o.kind not in ("loop", "collective")]
            assert phases.count(b.phase) == max(map(phases.count, phases))  # its ops' most common phase
            assert close(b.end_s - b.start_s, drawn_length(pred, body))
            assert all(b.start_s - 1e-15 <= x.start_s and x.end_s <= b.end_s + 1e-15 for x in boxes
                       if dict(x.data).get("first", dict(x.data).get("start", "")).startswith(body.name + "."))
        if not pred.schedule.loops:
            assert close(length, pred.step_s)


def test_compute_boxes_are_the_ops_back_to_back(predictions):
    """Each compute box is a run of ops of one kind and phase: as wide as their seconds, their FLOPs and bytes
    summed; the boxes never overlap, and all of them together are every op's time once per drawn run."""
    longer_runs = 0  # boxes of several ops whose bytes differ: where a box's bytes are not its first op's
    for pred in predictions:
        boxes, length = draw.boxes(pred)
        compute = sorted((b for b in boxes if b.lane == "compute"), key=lambda b: b.start_s)
        ops = {(o.computation, o.name): o for o in pred.ops}
        for b in compute:
            data = dict(b.data)
            seq = next(o.computation for o in pred.ops if o.name == data["first"])
            names = [i.name for i in pred.schedule.sequences[seq].order]
            run = [ops[seq, n] for n in names[names.index(data["first"]):names.index(data["last"]) + 1]
                   if (seq, n) in ops and ops[seq, n].kind not in ("collective",)]
            assert int(data["ops"]) == len(run) and {(o.kind, o.phase) for o in run} == {(b.kind, b.phase)}
            assert close(b.end_s - b.start_s, sum(o.seconds for o in run))
            assert float(data["flops"]) == pytest.approx(sum(o.flops for o in run), rel=1e-5)
            assert float(data["bytes"]) == pytest.approx(sum(o.bytes for o in run), rel=1e-5)
            longer_runs += len(run) > 1 and len({o.bytes for o in run}) > 1
        for a, b in zip(compute, compute[1:]):
            assert a.end_s <= b.start_s + 1e-12 * length
        drawn_ops = sum(o.seconds for o in pred.ops if o.kind not in ("loop", "collective"))
        assert close(sum(b.end_s - b.start_s for b in compute), drawn_ops)
    assert longer_runs > 0


def test_collective_boxes_span_issue_to_completion_with_their_numbers(predictions):
    """One box per collective in the lane of the axis it is charged to, from its issue to its completion (minus
    the loops collapsed inside its window), carrying its transfer, exposed and hidden time and its runs;
    per lane, exposed x runs is the axis's exposed time the lane's title gives, hidden x runs its hidden time."""
    for pred in predictions:
        boxes, _ = draw.boxes(pred)
        colls = [b for b in boxes if b.kind == "collective"]
        assert len(colls) == len(pred.collectives)
        by_start = {dict(b.data)["start"]: b for b in colls}
        for c in pred.collectives:
            b = by_start[c.window.start]
            data = dict(b.data)
            assert b.lane == c.axis and data["op"] == c.window.op and int(data["runs"]) == c.runs
            assert float(data["comm-us"]) == pytest.approx(c.comm_s * 1e6, rel=1e-3)
            assert float(data["exposed-us"]) == pytest.approx(c.exposed_s * 1e6, rel=1e-3, abs=1e-9)
            assert float(data["hidden-us"]) == pytest.approx(c.hidden_s * 1e6, rel=1e-3, abs=1e-9)
            seq = pred.schedule.sequences[c.window.computation]
            inside = {i.name for i in seq.order[c.window.issue:c.window.done + 1]}
            collapsed = 0.0
            loops = [o for o in pred.ops if o.computation == seq.name and o.kind == "loop" and o.name in inside]
            for o in loops:
                (body,) = pred.schedule.branches(next(i for i in seq.order if i.name == o.name))
                collapsed += o.seconds - drawn_length(pred, body)
            assert close(b.end_s - b.start_s, c.done_s - c.issue_s - collapsed)
        for lane in {b.lane for b in colls}:
            exposed = sum(float(dict(b.data)["exposed-us"]) * int(dict(b.data)["runs"])
                          for b in colls if b.lane == lane)
            assert exposed * 1e-6 == pytest.approx(pred.axes[lane].exposed_s, rel=1e-3, abs=1e-12)
            hidden = sum(float(dict(b.data)["hidden-us"]) * int(dict(b.data)["runs"]) for b in colls if b.lane == lane)
            assert hidden * 1e-6 == pytest.approx(pred.axes[lane].hidden_s, rel=1e-3, abs=1e-12)


def test_the_svg_draws_each_box_where_its_numbers_say(predictions):
    """x and width of every box's rectangle are its start and span on the shared axis; the red strip of a
    collective is its exposed time at the box's right end; each band says its prediction's step, each axis
    lane its exposed time. Drawn two predictions at a time, one above the other."""
    red_strips = 0
    for pair in zip(predictions[0::2], predictions[1::2]):
        svg = ET.fromstring(draw.timeline_svg([("a", pair[0]), ("b", pair[1])]))
        span = max(draw.boxes(p)[1] for p in pair)
        scale = (draw.WIDTH - draw.LEFT - 20) / span
        bands = [g for g in svg.iter(SVG + "g") if g.get("class") == "twin"]
        assert [b.get("data-twin") for b in bands] == ["a", "b"]
        for band, pred in zip(bands, pair):
            assert float(band.get("data-step-s")) == pytest.approx(pred.step_s, rel=1e-8)
            assert f"predicted step {seconds(pred.step_s)}" in band.find(SVG + "text").text
            for lane in band.findall(SVG + "g"):
                name = lane.get("data-lane")
                if name in pred.axes:
                    assert lane.find(SVG + "text").text == f"{name} ({seconds(pred.axes[name].exposed_s)} exposed)"
                for g in lane.findall(SVG + "g"):
                    start, end = float(g.get("data-start-s")), float(g.get("data-end-s"))
                    rect = g.find(SVG + "rect")
                    x, width = float(rect.get("x")), float(rect.get("width"))
                    assert x == pytest.approx(draw.LEFT + start * scale, abs=0.01)
                    assert width == pytest.approx(max((end - start) * scale, 1.0), abs=0.01)
                    red = g.find(SVG + "rect[@class='exposed']")
                    exposed = float(g.get("data-exposed-us") or 0) * 1e-6 * scale
                    assert (red is not None) == (exposed >= 0.5)
                    if red is not None:
                        red_strips += 1
                        assert float(red.get("width")) == pytest.approx(exposed, abs=0.01)
                        assert float(red.get("x")) + float(red.get("width")) == pytest.approx(x + width, abs=0.02)
    assert red_strips >= 10


def test_the_prediction_table_says_the_models_sums(predictions):
    """Prediction.table(): the step is compute plus exposed, each axis's communication, hidden and exposed are
    the model's per-axis figures, each loop its one-iteration time and runs."""
    for pred in predictions[:20]:
        lines = pred.table().splitlines()
        assert lines[0] == (f"predicted step on one test: {seconds(pred.step_s)} = compute and memory "
                            f"{seconds(pred.compute_s)} + exposed communication {seconds(pred.exposed_s)}")
        axes = {m.group(1): m.group(2, 3, 4) for m in (re.fullmatch(
            r"  axis (\S+): communication (.+), hidden (.+), exposed (.+)", line) for line in lines) if m}
        assert axes == {a: (seconds(t.comm_s), seconds(t.hidden_s), seconds(t.exposed_s))
                        for a, t in pred.axes.items()}
        for a, t in pred.axes.items():
            assert t.exposed_s <= t.comm_s * (1 + 1e-9) and t.hidden_s == pytest.approx(t.comm_s - t.exposed_s)
        loops = [line for line in lines if line.startswith("  loop %")]
        assert loops == [f"  loop %{s.name}: {seconds(pred.sequence_s[s.name])} per iteration, {s.runs} runs per step"
                         for s in pred.schedule.loops]
        assert sum(pred.by_kind().values()) == pytest.approx(pred.compute_s)


# a collective only one twin has: a reduce-scatter over tensor ('tensor' groups of schedule_overlap.hlo's mesh)
EXTRA_REDUCE_SCATTER = ("  %extra = f32[1,4]{1,0} reduce-scatter(%p), channel_id=9, replica_groups={{0,1,2,3},{4,5,6,7}}, "
                        "use_global_device_ids=true, dimensions={0}, to_apply=%add\n")


@pytest.mark.parametrize("other", ["manual", "explicit", "extra", "both"])
def test_the_side_by_side_table_totals_its_rows(other):
    """launch.collectives.side_by_side: each (op, axes) row is each twin's and the model's count and bytes;
    each TOTAL row sums its axes' rows; a row is marked exactly where the twins differ from each other or
    from the model, naming the twins that differ from it. Twins read from schedule_overlap.hlo: as written
    (also the model) beside one without its all-reduce over tensor (another count), one with that all-reduce
    twice as large (the same count, other bytes), one with a reduce-scatter over tensor the model lacks (its
    own row, every twin's (op, axes) is one), or all three."""
    from launch.collectives import side_by_side
    from twinshard.cost import human

    text = (SNIPPETS / "schedule_overlap.hlo").read_text()
    mesh = {"data": 2, "tensor": 4}
    sync = "%sync = f32[4,4]{1,0} all-reduce(%cp-done)"
    assert sync in text
    twins = {"auto": hlo.ledger(text, mesh),
             "manual": hlo.ledger(text.replace(sync, "%sync = f32[4,4]{1,0} add(%cp-done, %cp-done)").replace(
                 ", channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add",
                 ""), mesh),
             "explicit": hlo.ledger(text.replace(sync, "%sync = f32[8,4]{1,0} all-reduce(%q)"), mesh),
             "extra": hlo.ledger(text.replace("  ROOT %out", EXTRA_REDUCE_SCATTER + "  ROOT %out"), mesh)}
    model = twins["auto"]
    assert len(twins["manual"]) == len(model) - 1 and len(twins["explicit"]) == len(model)
    assert len(twins["extra"]) == len(model) + 1 and ("reduce-scatter", ("tensor",)) not in model.summary()
    twins = {impl: led for impl, led in twins.items() if impl in ("auto", other) or other == "both"}
    results = [{"impl": impl, "ledger": led, "model": model} for impl, led in twins.items()]
    rows = [line.split("|") for line in side_by_side(results).splitlines()[2:]]
    summaries = [led.summary() for led in twins.values()] + [model.summary()]
    totals: dict[str, list[list[int]]] = {}
    marked = 0
    listed = {(row[0].split()[0], row[0].split()[1]) for row in rows if not row[0].startswith("TOTAL")}
    assert listed == {(op, ",".join(axes) or "-") for s in summaries for op, axes in s}
    for row in rows:
        op, axes = row[0].split()
        cells = [[int(c.split(None, 1)[0]), c.split(None, 1)[1].strip()] for c in row[1:-1]]
        if op == "TOTAL":
            want = totals.pop(axes)
        else:
            key = (op, () if axes == "-" else tuple(axes.split(",")))
            want = [[s[key]["count"], s[key]["bytes"]] if key in s else [0, 0] for s in summaries]
            acc = totals.setdefault(axes, [[0, 0] for _ in want])
            for a, w in zip(acc, want):
                a[0], a[1] = a[0] + w[0], a[1] + w[1]
        assert cells == [[n, human(b)] for n, b in want], row
        off = [impl for impl, w in zip(twins, want) if w != want[-1]]
        mark = "; ".join((["twins differ"] if len({tuple(w) for w in want[:-1]}) > 1 else [])
                         + ([f"{', '.join(off)} differ{'s' * (len(off) == 1)} from the model"] if off else []))
        assert row[-1].strip() == mark
        marked += bool(mark)
    # a TOTAL row for every axes; marked: the tensor TOTAL and the row that differs (both: the all-reduce and the
    # reduce-scatter over tensor)
    assert totals == {} and marked == (3 if other == "both" else 2)
