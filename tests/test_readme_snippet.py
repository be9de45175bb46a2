"""The README's example on the project's own step ("Collective assertions for your own tests") runs as written.

The code block is read from README.md (an edit that breaks it fails here) and run
as `python example.py` in a fresh process with neither XLA_FLAGS nor JAX_PLATFORMS
set: the snippet must set its own device flags before importing jax. Its counts
are also checked, without compiling, against the analytic cost model they cite.
The examples that moved to docs/hlo-assertions.md are read from there (`snippet`).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

from harness import cache
from twinshard import cost, hlo
from twinshard.config import preset

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTION = "## Collective assertions for your own tests"
GUIDE = "docs/hlo-assertions.md"


def snippet(containing: str = "make_runner") -> str:
    """The one ```python block that contains `containing`, in the README's section (up to the next
    `## ` heading) or in docs/hlo-assertions.md."""
    readme = (ROOT / "README.md").read_text()
    assert SECTION in readme, f"README.md lost its section {SECTION!r}"
    text = readme.split(SECTION, 1)[1].split("\n## ", 1)[0] + (ROOT / GUIDE).read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if containing in b]
    assert len(blocks) == 1, f"expected one ```python block with {containing!r} under {SECTION!r} or in {GUIDE}"
    return blocks[0]


def test_snippet_counts_are_the_cost_models() -> None:
    code = snippet()
    asserted = {op: int(n) for op, n in re.findall(
        r'expect_collectives\(led, "([\w-]+)", \("data",\), count=(\d+)\)', code)}
    cfg = preset("tiny")
    model = cost.cost(cfg.model, "fsdp", {"data": 8, "tensor": 1}, batch_size=cfg.train.batch_size)
    assert asserted == {op: s["count"] for (op, axes), s in model.summary().items() if axes == ("data",)}
    # 2(7L+2)-1, 7L+2, and the norm gains' 3 leaves (ln1, ln2 stacked [L, D]; ln_final) + grad norm + loss
    assert asserted == {"all-gather": 31, "reduce-scatter": 16, "all-reduce": 5}
    bound = re.search(r'expect_no_collective\(led, op="all-reduce", larger_than=([\d *]+)\)', code)
    largest = max(r.bytes // r.count for r in model.collectives if r.op == "all-reduce")
    m = cfg.model
    assert bound and math.prod(int(f) for f in bound[1].split("*")) == largest == 4 * m.num_layers * m.d_model


def test_snippet_runs_as_written(tmp_path: pathlib.Path) -> None:
    (tmp_path / "example.py").write_text(snippet())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache.directory())  # reruns skip the compile
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {}
    for words in (line.split() for line in proc.stdout.splitlines()):
        if words[:1] and words[0] in ("all-gather", "reduce-scatter", "all-reduce"):
            reduction = words.pop(1) if words[1] in hlo.REDUCTIONS.values() else ""
            rows[words[0]] = [reduction, *words[1:3]]  # reduction, axes, count
    assert rows == {"all-gather": ["", "data", "31"], "reduce-scatter": ["sum", "data", "16"],
                    "all-reduce": ["sum", "data", "5"]}, proc.stdout
    assert proc.stdout.rstrip().endswith("unparsed: 0"), proc.stdout


def test_standalone_examples_run() -> None:
    """The README's example for your own project and docs/hlo-assertions.md's GSPMD `jit` case run as
    written (this process has the 8 simulated devices they ask for)."""
    namespace: dict = {}
    exec(snippet(containing="x.sum(axis=0)"), namespace)
    assert namespace["led"].count("all-reduce", "data", reduction="sum") == 1
    exec(snippet(containing="def test_"), namespace)  # the imports and sizes of the pytest file
    exec(snippet(containing="gspmd_mlp"), namespace)
    assert namespace["mlp_led"].count("all-reduce", "tensor", phase="forward") == 1


def test_permute_example_runs() -> None:
    """docs/hlo-assertions.md's expect_permute block runs as written, after the imports of its pytest file."""
    namespace: dict = {}
    exec(snippet(containing="def test_"), namespace)
    exec(snippet(containing="expect_permute(hop_led"), namespace)
    assert namespace["hop_led"].patterns() == {"stage +1": 1, "stage ring -1": 1}  # the block's comment
