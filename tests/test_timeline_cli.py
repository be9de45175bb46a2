"""`launch.collectives --timeline`: one training step of both fsdp twins on a v5e:2x2 (compiled ahead of
time, needs libtpu), read back from the SVG file: the twins' bands, their lanes, the collective boxes
in them and their order, the loop bodies drawn once with their trips; and the same numbers in --json.
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
               f"--json={out}/fsdp.json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    twins = {}
    for band in ET.parse(out / "fsdp.svg").getroot().iter(SVG + "g"):
        if band.get("class") == "twin":
            lanes = {lane.get("data-lane"): lane.findall(SVG + "g") for lane in band.findall(SVG + "g")
                     if lane.get("class") == "lane"}
            twins[band.get("data-twin")] = (band, lanes)
    with open(out / "fsdp.json") as f:
        doc = json.load(f)
    return {"twins": twins, "doc": {d["impl"]: d for d in doc["twins"]}, "text": proc.stdout}


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
