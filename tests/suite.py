"""The suite as pytest collects it, read in a fresh process (a test cannot collect the suite it runs in).

`collect(*paths)` -> one row per test: its node id, its markers, the strategies it names itself
(tests/harness/markers.py `named`) and its parameters' words. One collection of the whole suite
takes ~2 s; a process collects each selection once.
"""

from __future__ import annotations

import functools
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

_COLLECT = """
import json, sys
sys.path.insert(0, "tests")
import pytest
from harness import markers

class Report:
    def pytest_collection_finish(self, session):
        self.items = [{"nodeid": i.nodeid, "markers": sorted({m.name for m in i.iter_markers()}),
                       "named": sorted(i.stash.get(markers.NAMED, ())), "words": sorted(markers.param_words(i))}
                      for i in session.items]

report = Report()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *sys.argv[2:]], plugins=[report])
json.dump({"code": int(code), "items": getattr(report, "items", [])}, open(sys.argv[1], "w"))
"""


@functools.cache
def collect(*paths: str) -> tuple[dict, ...]:
    """Every test under `paths` (default: tests/), as pytest collects it; a collection error fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "items.json"
        proc = subprocess.run([sys.executable, "-c", _COLLECT, str(out), *(paths or ("tests",))], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        result = json.loads(out.read_text()) if out.exists() else {"code": proc.returncode, "items": []}
    assert result["code"] == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tuple(result["items"])
