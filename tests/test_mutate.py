"""tools/mutate.py follows code that moves unchanged, and calls a mutant stale only when its code changed."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import mutate  # noqa: E402  (tools/ is not a package)
from mutants import Mutant  # noqa: E402

MUTANT = Mutant(id="sign", category="unit", file="pkg/a.py", original="return x + y",
                replacement="return x - y", tests=("tests/test_a.py",), description="a sign slip")


def snap(files: dict[str, str]) -> dict[str, tuple[bytes, int]]:
    return {p: (text.encode(), 0o644) for p, text in {"tests/test_a.py": "", **files}.items()}


def test_a_mutant_applies_where_it_is_declared() -> None:
    tree = snap({"pkg/a.py": "def f(x, y):\n    return x + y\n", "pkg/b.py": ""})
    assert mutate.locate(MUTANT, tree) == "pkg/a.py" and mutate.stale_reason(MUTANT, tree) == ""


def test_a_mutant_follows_its_code_to_another_file() -> None:
    tree = snap({"pkg/a.py": "", "pkg/sub/b.py": "def f(x, y):\n    return x + y\n"})
    assert mutate.locate(MUTANT, tree) == "pkg/sub/b.py" and mutate.stale_reason(MUTANT, tree) == ""


def test_a_mutant_whose_code_changed_or_repeats_is_stale() -> None:
    changed = snap({"pkg/a.py": "def f(x, y):\n    return y + x\n"})
    twice = snap({"pkg/b.py": "return x + y\n", "pkg/c.py": "return x + y\n"})
    for tree in (changed, twice):
        assert mutate.locate(MUTANT, tree) is None
        assert "not exactly once" in mutate.stale_reason(MUTANT, tree)


def test_list_reports_staleness_and_only_check_fails_on_it(monkeypatch, capsys) -> None:
    monkeypatch.setattr(mutate, "tree_files", lambda: ["pkg/a.py", "tests/test_a.py"])
    monkeypatch.setattr(mutate, "snapshot", lambda files: snap({"pkg/a.py": "return y + x\n"}))
    assert mutate.list_mutants([MUTANT]) == 0
    assert mutate.list_mutants([MUTANT], check=True) == 1
    assert "STALE" in capsys.readouterr().out
