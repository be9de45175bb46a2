"""launch/collectives.py end to end: auto dp and auto fsdp on tiny, manual fsdp compiled for a
v5e:4x4 TPU pod (16 chips, 4 hosts; needs libtpu, the `tpu` extra), plus its input errors.

absl flags are process-global and launch.train (imported by other test modules)
defines flags of the same names, so the CLI runs in one subprocess, which parses
fresh flags for each run and calls `main` (one import of jax for all runs). The
subprocess gets no device count in XLA_FLAGS: the CLI sets 8 simulated CPU
devices itself, as it does when run by hand. (`--xla_backend_optimization_level=0`
halves compile time and leaves the collectives unchanged: docs/design.md.)
"""

import json
import re
from pathlib import Path

import pytest

from cli import run
from twinshard.hardware import topology
from twinshard.train import xla_options

TPU = topology.libtpu_installed()
DRIVER = r"""
import json, sys
from absl import flags
from launch import collectives
for argv in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["collectives", *argv])
    try:
        collectives.main(["collectives"])
    except ValueError as e:
        print(f"ValueError: {e}")
    print("=== end of run", flush=True)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    argvs = [
        ["--strategy=dp", "--preset=tiny", "--mesh=data:8,tensor:1", f"--json={out}/dp.json",
         f"--hlo={out}/dp.hlo"],
        ["--strategy=fsdp", "--preset=tiny", f"--json={out}/fsdp.json"],  # default mesh data:8
        ["--strategy=single", "--preset=tiny"],
        ["--strategy=tp", "--preset=tiny", "--mesh=data:1,tensor:8"],
        ["--strategy=dp", "--preset=tiny", "--json=/no/such/dir/x.json"],
        ["--strategy=fsdp", "--preset=tiny", "--topology=v5e-16"],
        ["--strategy=dp", "--preset=tiny", "--impl=auto,manual"],  # default mesh data:8
        ["--strategy=cp", "--preset=tiny", "--impl=auto,nope"],
    ]
    if TPU:  # batch 16: one sequence per chip
        # Load libtpu here first, as a test run does before this subprocess: two processes that
        # load libtpu must not fight over /tmp/libtpu_lockfile (twinshard.hardware.topology.devices).
        topology.devices("v5e:4x4")
        argvs.append(["--strategy=fsdp", "--impl=manual", "--preset=tiny", "--batch_size=16",
                      "--mesh=data:16,tensor:1", "--topology=v5e:4x4", f"--json={out}/tpu.json"])
    # last (texts[-1]): pipeline + FSDP under zb_h1, tiny's 2 layers on 2 stages, each data shard's 2 rows in 2
    # micro-batches
    argvs.append(["--strategy=pp_fsdp", "--impl=manual", "--preset=tiny", "--mesh=stage:2,data:4",
                  "--microbatches=2", "--schedule=zb_h1", f"--json={out}/pp_fsdp.json",
                  f"--timeline={out}/pp_fsdp.svg"])  # a pipeline's picture needs no --topology
    proc = run("-c", DRIVER, json.dumps(argvs), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts = proc.stdout.split("=== end of run")[:-1]
    assert len(texts) == len(argvs), proc.stdout[-3000:]
    return {"out": out, "texts": texts}


def load(runs, name):
    with open(runs["out"] / f"{name}.json") as f:
        return json.load(f)


def test_dp_ledger_equals_the_model(runs):
    doc = load(runs, "dp")
    assert doc["mesh"] == {"data": 8, "tensor": 1} and doc["platform"] == "cpu"
    assert doc["ledger"]["records"] and doc["model"]["collectives"]
    assert doc["ledger"]["unparsed"] == []
    # Same bytes (every parameter + the f32 loss), other counts: GSPMD (auto) all-reduces each
    # block gradient inside the backward layer loop, once per layer (9 x L + 4 = 22); the model
    # is the manual twin's, which means each stacked [L, ...] gradient leaf once (12 + the loss).
    assert [(r["op"], r["axes"], r["measured_count"], r["model_count"], r["measured_bytes"], r["model_bytes"])
            for r in doc["comparison"]] == [("all-reduce", ["data"], 22, 13, 4 * 155968 + 4, 4 * 155968 + 4)]
    text = runs["texts"][0]
    assert "== measured vs model" in text and "TOTAL" in text and "DIFFERS" in text
    assert doc["compiler_options"] == {} and "XLA options of the train step: none (the compiler's defaults)" in text
    with open(runs["out"] / "dp.hlo") as f:
        assert "all-reduce" in f.read()


def test_fsdp_shows_the_cpu_reduce_scatter_note(runs):
    doc = load(runs, "fsdp")
    assert doc["mesh"] == {"data": 8, "tensor": 1}
    summary = {(r["op"], tuple(r["axes"])): r for r in doc["ledger"]["summary"]}
    model = {(r["op"], tuple(r["axes"])): r for r in doc["model"]["summary"]}
    assert ("all-gather", ("data",)) in summary and ("reduce-scatter", ("data",)) in model
    # GSPMD on XLA:CPU: no reduce-scatter; the model's row is reported, not hidden.
    rs = next(r for r in doc["comparison"] if r["op"] == "reduce-scatter")
    assert rs["measured_count"] == 0 and rs["model_count"] == 16 and not rs["match"]
    assert any("XLA:CPU never emits reduce-scatter" in n for n in doc["notes"])
    assert "NOTE: XLA:CPU never emits reduce-scatter" in runs["texts"][1]
    assert "DIFFERS" in runs["texts"][1]


def test_memory_per_device_beside_the_model(runs):
    doc = load(runs, "dp")  # CPU: no tile padding, so every column agrees
    mem = doc["memory"]
    assert mem["arguments"]["params"]["bytes"] == mem["model"]["params"] == 155968 * 4
    assert mem["arguments"]["optimizer"]["bytes"] == mem["model"]["optimizer"]
    assert mem["analysis"]["argument_size_in_bytes"] == mem["arguments"]["total"]["padded"] \
        == mem["arguments"]["total"]["bytes"]
    assert "== memory per device: compiled.memory_analysis() beside the model ==" in runs["texts"][0]


@pytest.mark.skipif(not TPU, reason="needs libtpu: uv run --locked --extra tpu pytest")
def test_topology_compiles_for_a_multi_host_tpu_pod(runs):
    text = runs["texts"][8]
    assert (runs["out"] / "tpu.json").exists(), text[-3000:]
    doc = load(runs, "tpu")
    assert (doc["platform"], doc["device_kind"], doc["hosts"]) == ("tpu", "TPU v5 lite", 4)
    assert doc["mesh"] == {"data": 16, "tensor": 1}
    assert doc["ledger"]["records"] and doc["ledger"]["unparsed"] == []
    # the raw model differs (bf16 gathers, reduce-scatters as all-reduce + slice) and says so;
    # the model as TPU compiles the manual twin matches row for row
    assert not all(r["match"] for r in doc["comparison"])
    assert doc["tpu_comparison"] and all(r["match"] for r in doc["tpu_comparison"])
    assert any("TPU gathers the weights a matmul reads in bf16" in n for n in doc["notes"])
    mem = doc["memory"]  # per chip: 1/16 of the weights, each shard padded to its TPU tile
    assert mem["arguments"]["params"]["bytes"] == mem["model"]["params"]
    assert mem["arguments"]["optimizer"]["bytes"] == mem["model"]["optimizer"]
    assert mem["analysis"]["argument_size_in_bytes"] == mem["arguments"]["total"]["padded"] \
        > mem["arguments"]["total"]["bytes"]
    assert "fsdp/manual on TPU v5 lite (4 hosts) mesh data:16,tensor:1" in text
    assert "== measured vs model as the TPU compiler prints it" in text and "as stored" in text
    # the options the train step's jit compiled with, read back from its lowering
    assert doc["compiler_options"] == xla_options.ASYNC_COLLECTIVES
    assert "XLA options of the train step: --xla_enable_async_all_gather=true --xla_enable_async_all_reduce=true" in text
    assert "--xla_jf_crs_combiner_threshold_in_bytes=0" in text


def test_bad_input_is_a_clear_error(runs):
    single, tp8, bad_dir, topo = runs["texts"][2:6]
    assert "ValueError: --strategy=single has no collectives" in single
    assert "ValueError: heads=4 is not divisible by mesh axis tensor=8" in tp8
    assert "ValueError: --json=/no/such/dir/x.json: directory /no/such/dir does not exist" in bad_dir
    assert "ValueError: TPU topology 'v5e-16' is not of the form GENERATION:AxB[xC]" in topo


def test_pp_fsdp_ledger_equals_the_model(runs):
    """The manual pp_fsdp step under zb_h1 from the command line: its table drawn, and every (op, axes)
    row of the ledger equals the cost model, the stage hops (2 per tick of the table) and the gathers
    over data among them."""
    doc = load(runs, "pp_fsdp")
    assert doc["mesh"] == {"stage": 2, "data": 4, "tensor": 1}, runs["texts"][-1][-3000:]
    rows = {(r["op"], tuple(r["axes"])): r for r in doc["comparison"]}
    assert all(r["match"] for r in doc["comparison"]), runs["texts"][-1][-3000:]
    assert rows[("collective-permute", ("stage",))]["measured_count"] == 2 * 7  # 2 per tick
    assert ("zb_h1: S=2 M=2, 7 ticks, bubble 14.3%\n"
            "s0 F0 F1 .  B0 W0 B1 W1\n"
            "s1 .  F0 B0 F1 B1 W0 W1") in runs["texts"][-1]
    assert rows[("all-gather", ("data",))]["measured_count"] > 0


def test_pp_fsdp_timeline_draws_the_step_read_from_the_compiled_program(runs):
    """--timeline of a pipeline step: a lane per stage, a box per op; the boxes are the grid the reader
    found in the compiled program (--json's ticks; the text prints it under the table's), the bubble
    is the table's (each data shard of a stage runs the same ticks: the reader took its first)."""
    import xml.etree.ElementTree as ET

    doc, svg = load(runs, "pp_fsdp"), "{http://www.w3.org/2000/svg}"
    grid = doc["ticks"]["grid"]
    assert doc["ticks"]["form"] == "table" and grid == [["F0", None], ["F1", "F0"], [None, "B0"], ["B0", "F1"],
                                                        ["W0", "B1"], ["B1", "W0"], ["W1", "W1"]]
    assert doc["ticks"]["bubble"] == pytest.approx(1 / 7)
    assert "(table; %" in runs["texts"][-1] and "7 ticks, bubble 14.3%\ns0 F0 F1 .  B0 W0 B1 W1" in runs["texts"][-1]
    boxes = [g for g in ET.parse(runs["out"] / "pp_fsdp.svg").getroot().iter(svg + "g") if g.get("class") == "op"]
    drawn = {(int(g.get("data-tick")), int(g.get("data-stage"))): g.get("data-op") + g.get("data-microbatch")
             for g in boxes}
    assert len(boxes) == len(drawn) == 12
    assert drawn == {(t, s): c for t, row in enumerate(grid) for s, c in enumerate(row) if c is not None}


def test_twins_side_by_side(runs):
    """--impl=auto,manual: one table, a column group per twin and the model's, each row marked where
    the twins differ (GSPMD all-reduces dp's block gradients per layer: 22 against the manual 13 on
    tiny's 2 layers, the same bytes), the legend under it, and the auto twin's note for dp with its
    docs section; an unknown twin in the list is one line before anything compiles."""
    text = runs["texts"][6].strip()
    lines = text.splitlines()
    assert "dp on cpu mesh data:8,tensor:1, batch 8x32: twins side by side" in lines[0]
    head = next(line for line in lines if line.startswith("op "))
    assert head.split() == ["op", "axes", "|", "auto", "count", "auto", "bytes", "|", "manual", "count",
                            "manual", "bytes", "|", "model", "count", "model", "bytes", "|"]
    reduce = next(line for line in lines if line.startswith("all-reduce")).split()
    assert reduce[:4] == ["all-reduce", "data", "|", "22"] and reduce[6:8] == ["|", "13"]
    assert reduce[4:6] == reduce[8:10] == reduce[12:14]  # the same bytes
    assert text.count("twins differ; auto differs from the model") == 2  # the row and its TOTAL
    assert any(line.startswith("Legend: bytes:") and "ring bytes:" in line and "records:" in line
               and "collectives:" in line for line in lines)
    assert "NOTE: The model describes the manual (shard_map) twin" in text
    assert "once per layer and leaf" in text and "(docs/design.md#auto_paralleldppy)" in text
    assert text.count("== measured per twin") == 1 and "== measured: collectives" not in text
    assert runs["texts"][7].strip() == "ValueError: --impl=nope is not a twin; choose one of auto, manual, explicit."


def test_no_inf_ratio_and_no_escaped_quote(runs):
    """A model row of 0 bytes reads `model: none`, sources print as written (no \\' escapes)."""
    from twinshard import cost

    gathers = {("all-gather", ("context",)): {"count": 8, "bytes": 512, "ring_bytes": 384.0}}  # cp/auto's
    row = cost.compare_table(cost.compare(gathers, {})).splitlines()[2]
    assert row.split()[:8] == ["all-gather", "context", "8/0", "512", "B", "0", "B", "model:"], row
    for text in runs["texts"]:
        assert not re.search(r"\binf\b", text) and "\\'" not in text, text[-2000:]


def test_every_note_links_a_docs_section_that_exists():
    """Each strategy's auto note and each explicit twin's docs link name a heading of that page."""
    from launch import collectives, common

    def anchors(page: str) -> set[str]:  # GitHub's: lower case, punctuation but - and _ dropped, spaces -> -
        heads = re.findall(r"^#+ (.+)$", (Path(__file__).parents[1] / page).read_text(), re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

    links = [doc for _, doc in collectives.AUTO_NOTES.values()] + list(collectives.EXPLICIT_DOCS.values())
    assert set(collectives.AUTO_NOTES) == set(common.PARALLEL)
    for link in links:
        page, anchor = link.split("#")
        assert anchor in anchors(page), link


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
@pytest.mark.parametrize("has_reduce_scatter", [False, True])
def test_each_twins_notes_follow_its_strategy_platform_and_reduce_scatter(platform, has_reduce_scatter):
    """twin_notes over every (strategy, twin, platform, model has a reduce-scatter): the manual twin gets none
    (the model describes it, and its psum_scatter is a real reduce-scatter on every backend); the auto twin its
    strategy's note and link; the explicit twin the shared note with its strategy's link; after them the
    XLA:CPU reduce-scatter note, only on CPU and only where the model has a reduce-scatter."""
    from launch import common, twin_notes as tn
    from twinshard.parallel import support

    assert set(tn.EXPLICIT_DOCS) == set(support.written_by("explicit"))  # every explicit twin has its link
    cpu = [tn.CPU_REDUCE_SCATTER_NOTE] if (platform, has_reduce_scatter) == ("cpu", True) else []
    for strategy in common.PARALLEL:
        assert tn.twin_notes(strategy, "manual", platform, has_reduce_scatter) == [], strategy
        what, doc = tn.AUTO_NOTES[strategy]
        assert doc.startswith("docs/") and what not in (tn.EXPLICIT_NOTE, tn.CPU_REDUCE_SCATTER_NOTE)
        assert tn.twin_notes(strategy, "auto", platform, has_reduce_scatter) == \
            [f"{tn.MODEL_NOTE}{what} ({doc})."] + cpu, strategy
        if strategy in tn.EXPLICIT_DOCS:
            assert tn.twin_notes(strategy, "explicit", platform, has_reduce_scatter) == \
                [f"{tn.MODEL_NOTE}{tn.EXPLICIT_NOTE} ({tn.EXPLICIT_DOCS[strategy]})."] + cpu, strategy
