"""launch/collectives.py end to end: auto dp and auto fsdp on tiny, plus its input errors.

absl flags are process-global and launch.train (imported by other test modules)
defines flags of the same names, so the CLI runs in one subprocess, which parses
fresh flags for each run and calls `main` (one import of jax for all runs). The
subprocess gets no device count in XLA_FLAGS: the CLI sets 8 simulated CPU
devices itself, as it does when run by hand. (`--xla_backend_optimization_level=0`
halves compile time and leaves the collectives unchanged; see DESIGN.md.)
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
        ["--strategy=fsdp", "--preset=tiny", "--topology=v5e:4x4"],
    ]
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
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
    assert [(r["op"], r["axes"], r["measured_count"], r["measured_bytes"], r["match"])
            for r in doc["comparison"]] == [("all-reduce", ["data"], 22, 4 * 155968 + 4, True)]
    text = runs["texts"][0]
    assert "== measured vs model" in text and "TOTAL" in text and "ok" in text
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


def test_bad_input_is_a_clear_error(runs):
    single, tp8, bad_dir, topo = runs["texts"][2:]
    assert "ValueError: --strategy=single has no collectives" in single
    assert "ValueError: heads=4 is not divisible by mesh axis tensor=8" in tp8
    assert "ValueError: --json=/no/such/dir/x.json: directory /no/such/dir does not exist" in bad_dir
    assert "install the tpu extra: uv sync --extra tpu" in topo or "compiled in" in topo
