"""`launch.collectives --timeline`: one training step of both fsdp twins on a v5e:2x2 (compiled ahead of
time, needs libtpu), read back from the SVG file: the twins' bands, their lanes, the collective boxes
in them and their order, the loop bodies drawn once with their trips; and the same numbers in --json.
`--trace`: the same step as a Chrome trace-event file, held to --json event by event.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from cli import run
from twinshard.hardware import topology

pytestmark = pytest.mark.skipif(not topology.libtpu_installed(),
                                reason="needs libtpu: uv run --locked --extra tpu pytest")
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    out = tmp_path_factory.mktemp("timeline")
    topology.devices("v5e:2x2", (2, 2, 1))  # libtpu loaded here first (its lockfile: topology.devices)
    # the compiler's own collective options: with the train step's (xla_options.py) the norm gains'
    # all-reduces run inside the backward pass, beside its gathers (tests/test_xla_options.py)
    proc = run("-m", "launch.collectives", "--preset=tiny", "--strategy=fsdp", "--impl=auto,manual",
               "--topology=v5e:2x2", "--async_collectives=false", f"--timeline={out}/fsdp.svg",
               f"--json={out}/fsdp.json", f"--trace={out}/fsdp.trace.json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    twins = {}
    for band in ET.parse(out / "fsdp.svg").getroot().iter(SVG + "g"):
        if band.get("class") == "twin":
            lanes = {lane.get("data-lane"): lane.findall(SVG + "g") for lane in band.findall(SVG + "g")
                     if lane.get("class") == "lane"}
            twins[band.get("data-twin")] = (band, lanes)
    with open(out / "fsdp.json") as f:
        doc = json.load(f)
    with open(out / "fsdp.trace.json") as f:
        trace = json.load(f)
    return {"twins": twins, "doc": {d["impl"]: d for d in doc["twins"]}, "text": proc.stdout, "trace": trace}


def test_both_twins_one_above_the_other_with_their_lanes(drawn):
    assert list(drawn["twins"]) == ["auto", "manual"]  # --impl order, top to bottom
    for name, (band, lanes) in drawn["twins"].items():
        assert list(lanes) == ["loops", "compute", "data"]  # mesh data:4, tensor:1: one axis with collectives
        assert all(g.get("class") == "collective" for g in lanes["data"])
        assert {g.get("data-kind") for g in lanes["compute"]} <= {"matmul", "memory"}
        pred = drawn["doc"][name]["prediction"]
        assert float(band.get("data-step-s")) == pytest.approx(pred["step_s"])
        assert len(lanes["data"]) == len(pred["collectives"])  # one box per collective, as in --json
        # every collective of the ledger is in a window (auto: gradient all-reduces TPU fused with compute)
        ledger = drawn["doc"][name]["ledger"]["records"]
        assert sum(c["runs"] * c["records"] for c in pred["collectives"]) == sum(r["multiplicity"] for r in ledger)
        exposed = sum(float(g.get("data-exposed-us")) * int(g.get("data-runs")) for g in lanes["data"])
        assert exposed * 1e-6 == pytest.approx(pred["axes"]["data"]["exposed_s"], rel=1e-3)
        assert "predicted step on one v5e: " in drawn["text"]


def test_the_scanned_layers_are_drawn_once_with_their_trips(drawn):
    for _, lanes in drawn["twins"].values():
        loops = lanes["loops"]
        assert [(g.get("data-trips"), g.get("data-phase")) for g in loops] == [("2", "forward"), ("2", "backward")]
        fwd, bwd = (float(g.get("data-end-s")) for g in loops)
        assert float(loops[0].get("data-start-s")) < fwd <= float(loops[1].get("data-start-s")) < bwd


def test_manual_fsdp_gathers_forward_then_backward_then_reduces(drawn):
    """The manual twin's boxes in issue order: the forward gathers, the backward re-gathers and reduce-scatters,
    then the optimizer's and the loss's all-reduces; each labelled with its tensor, bytes and source line."""
    _, lanes = drawn["twins"]["manual"]
    boxes = sorted(lanes["data"], key=lambda g: float(g.get("data-start-s")))
    phases = "".join(g.get("data-phase")[0] for g in boxes)
    assert re.fullmatch(r"f+b+o+", phases), phases
    ops = {(g.get("data-op"), g.get("data-phase")) for g in boxes}
    assert {("all-gather", "forward"), ("all-gather", "backward"), ("reduce-scatter", "backward")} <= ops
    for g in boxes:
        title = g.find(SVG + "title").text
        assert g.get("data-tensor") in title and g.get("data-op") in title
        assert float(g.get("data-start-s")) <= float(g.get("data-end-s"))
    gathers = [g for g in boxes if g.get("data-op") == "all-gather"]
    for g in gathers:  # the manual twin's own lines: its fsdp gathers and the embedding's
        path, line = g.get("data-source").rsplit(":", 1)
        assert path.startswith("manual_parallel/") and f"{path.rsplit('/', 1)[-1]}:{line}" in g.find(SVG + "title").text
    # TPU issues most layer gathers asynchronously: some compute is scheduled inside their windows
    assert any(g.get("data-synchronous") == "false" and int(g.get("data-inside")) > 0 for g in gathers)


def us(seconds: float) -> float:
    return seconds * 1e6


NS = 2e-3  # us: the trace rounds each time to the nanosecond, a duration from two rounded ends


def traced_twins(drawn):
    """Per twin of the --trace file: (its process's name, --json's prediction, the 'X' events of each
    track by the track's name, where each run of each sequence starts in µs: the step's at 0, a loop
    body's at each of the trace's iterations of it). The tracks are held to --json's axes here."""
    events = drawn["trace"]["traceEvents"]
    heads = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert [h.split(":")[0] for h in heads.values()] == ["predicted auto", "predicted manual"]  # --impl order
    assert {e["pid"] for e in events} == set(heads)
    for pid, head in heads.items():
        pred = drawn["doc"][head.split(":")[0].removeprefix("predicted ")]["prediction"]
        tracks = {e["args"]["name"]: e["tid"] for e in events
                  if e["ph"] == "M" and e["pid"] == pid and e["name"] == "thread_name"}
        assert set(tracks) == {"compute", "loops", *pred["axes"]} and len(set(tracks.values())) == len(tracks)
        on = {track: [e for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) == (pid, tid)]
              for track, tid in tracks.items()}
        assert sum(map(len, on.values())) == sum(e["ph"] == "X" and e["pid"] == pid for e in events)
        starts = {next(s["name"] for s in pred["sequences"] if s["kind"] == "entry"): [0.0]}
        for e in (e for e in on["loops"] if e["cat"] == "iteration"):
            starts.setdefault(e["args"]["body"], []).append(e["ts"])
        yield head, pred, on, starts


def runs_of(events, key, runs_at: list[float], start_s: float) -> list[dict]:
    """The events `key` selects, in time order, checked to start at `start_s` into each run of their sequence."""
    got = sorted((e for e in events if key(e)), key=lambda e: e["ts"])
    assert [e["ts"] for e in got] == pytest.approx(sorted(t + us(start_s) for t in runs_at), abs=NS)
    return got


def test_the_trace_holds_the_json_ops_one_after_another(drawn):
    """--trace's file, parsed as a trace viewer reads it: per twin one process with a track for compute,
    one for loops and one per mesh axis of --json's prediction; every op of --json on the compute track
    once per run, at its start in each run of its loop body, for its seconds, with its bytes and source;
    the compute stream's waits its exposed time; ops and waits one after another, together the step."""
    for head, pred, on, starts in traced_twins(drawn):
        ops = [o for o in pred["ops"] if o["kind"] not in ("collective", "loop")]
        waits = [e for e in on["compute"] if e["cat"] == "exposed"]
        assert len(on["compute"]) - len(waits) == sum(o["runs"] for o in ops) > 0
        for o in ops:
            got = runs_of(on["compute"], lambda e: (e["args"]["computation"], e["name"]) == (o["computation"],
                                                                                            o["name"]),
                          starts[o["computation"]], o["start_s"])
            assert all(e["dur"] == pytest.approx(us(o["seconds"]), abs=NS) and e["args"]["bytes"] == o["bytes"]
                       and e["args"]["source"] == o["source"] and e["args"]["kind"] == o["kind"] for e in got)
        assert sum(e["dur"] for e in waits) == pytest.approx(us(pred["exposed_s"]), abs=len(waits) * NS)
        assert sum(e["dur"] for e in on["compute"]) == pytest.approx(us(pred["step_s"]), abs=len(on["compute"]) * NS)
        stream = sorted(on["compute"], key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(stream, stream[1:]))
        assert max(e["ts"] + e["dur"] for events in on.values() for e in events) <= us(pred["step_s"]) + NS
        assert f"step {pred['step_s'] * 1e3:.3f} ms" in head or f"step {us(pred['step_s']):.2f} us" in head


def test_the_trace_lays_out_every_loop_trip(drawn):
    """Each loop of --json on the loops track at its start, for its seconds, holding its trips of one
    body run each (the tiny model's two layers, forward then backward)."""
    for _, pred, on, starts in traced_twins(drawn):
        seconds = {s["name"]: s["seconds"] for s in pred["sequences"]}
        for e in (e for e in on["loops"] if e["cat"] == "iteration"):
            assert e["dur"] == pytest.approx(us(seconds[e["args"]["body"]]), abs=NS)
        loops = [e for e in on["loops"] if e["cat"].startswith("loop")]
        assert [(e["args"]["trips"], e["cat"]) for e in loops] == [(2, "loop,forward"), (2, "loop,backward")]
        for o in (o for o in pred["ops"] if o["kind"] == "loop"):
            (got,) = runs_of(loops, lambda e: (e["args"]["computation"], e["args"]["instruction"]) == (
                o["computation"], o["name"]), starts[o["computation"]], o["start_s"])
            assert got["dur"] == pytest.approx(us(o["seconds"]), abs=NS)
            assert len(starts[got["args"]["body"]]) == got["args"]["trips"] * len(starts[o["computation"]])


def test_the_trace_holds_the_json_collectives_on_their_axes(drawn):
    """Every collective of --json, once per run, on its mesh axis's track while it holds the link (from
    begin_s for comm_s), named by op and tensor, with its bytes, ring bytes and source line."""
    for _, pred, on, starts in traced_twins(drawn):
        transfers = [e for axis in pred["axes"] for e in on[axis] if e["cat"].startswith("collective")]
        assert len(transfers) == sum(c["runs"] for c in pred["collectives"]) > 0
        for c in pred["collectives"]:
            got = runs_of(on[c["axis"] or "-"], lambda e: (e["args"]["computation"], e["args"]["start"]) == (
                c["computation"], c["start"]), starts[c["computation"]], c["begin_s"])
            assert all(e["dur"] == pytest.approx(us(c["comm_s"]), abs=NS) and e["args"]["bytes"] == c["bytes"]
                       and e["args"]["ring_bytes"] == c["ring_bytes"] and e["args"]["source"] == c["source"]
                       and e["name"] == f"{c['op']} {c['tensor']}" for e in got)


def test_trace_beside_puts_the_prediction_at_the_measured_step(drawn, tmp_path):
    """tools/trace_beside.py: a measured trace's events kept as they are, the prediction's after them as
    processes numbered past the measured ones, shifted to the first measured event naming the step."""
    import gzip

    measured = {"displayTimeUnit": "ns", "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:TPU:0"}},
        {"ph": "X", "name": "host work", "pid": 3, "tid": 1, "ts": 100.0, "dur": 5.0},
        {"ph": "X", "name": "jit_train_step(42)", "pid": 7, "tid": 2, "ts": 7000.0, "dur": 900.0},
        {"ph": "X", "name": "jit_train_step(42)", "pid": 7, "tid": 2, "ts": 5000.5, "dur": 900.0}]}
    (tmp_path / "measured.json.gz").write_bytes(gzip.compress(json.dumps(measured).encode()))
    (tmp_path / "predicted.json").write_text(json.dumps(drawn["trace"]))
    proc = run("tools/trace_beside.py", f"--predicted={tmp_path}/predicted.json",
               f"--measured={tmp_path}/measured*.gz", f"--out={tmp_path}/both.json.gz")
    assert proc.returncode == 0, proc.stderr[-2000:]
    both = json.loads(gzip.decompress((tmp_path / "both.json.gz").read_bytes()))
    n = len(measured["traceEvents"])
    assert both["displayTimeUnit"] == "ns" and both["traceEvents"][:n] == measured["traceEvents"]
    moved, original = both["traceEvents"][n:], drawn["trace"]["traceEvents"]
    assert [e["pid"] for e in moved] == [e["pid"] + 8 for e in original]
    assert [e.get("ts") for e in moved] == [e["ts"] + 5000.5 if "ts" in e else None for e in original]
    assert "from 5000.500 us" in proc.stdout
    bad = run("tools/trace_beside.py", f"--predicted={tmp_path}/predicted.json",
              f"--measured={tmp_path}/measured.json.gz", f"--out={tmp_path}/x.json", "--step=jit_nothing")
    assert bad.returncode != 0 and "no complete event of the measured trace names 'jit_nothing'" in bad.stderr
