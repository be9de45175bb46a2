"""The mutants of tests/mutants/ still fit the code and the tests: every snippet occurs exactly once
in the file it names, the mutated file still parses (a mutant is a bug, not a syntax error), and
every test a mutant selects is one pytest collects. Static: no mutant runs here (tools/mutate.py
runs them); seconds."""

from __future__ import annotations

import ast
import pathlib

import pytest

import suite
from mutants import MUTANTS

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return {f: (ROOT / f).read_text() for f in {m.file for m in MUTANTS} if (ROOT / f).is_file()}


def test_ids_are_unique_and_each_mutant_changes_its_snippet():
    ids = [m.id for m in MUTANTS]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert not [m.id for m in MUTANTS if m.original == m.replacement or not m.tests]


def test_every_snippet_occurs_once_in_its_file_and_the_mutant_parses(sources):
    missing = sorted({m.file for m in MUTANTS} - set(sources))
    assert not missing, f"mutants name files that do not exist: {missing}"
    stale = [(m.id, m.file, sources[m.file].count(m.original)) for m in MUTANTS
             if sources[m.file].count(m.original) != 1]
    assert not stale, f"(id, file, occurrences): fix these mutants' snippets or files in tests/mutants/: {stale}"
    broken = []
    for m in MUTANTS:
        if m.file.endswith(".py"):
            try:
                ast.parse(sources[m.file].replace(m.original, m.replacement))
            except SyntaxError as e:
                broken.append((m.id, str(e)))
    assert not broken, f"mutants that only break the syntax: {broken}"


def test_every_selected_test_is_collected():
    """A node id that names no collected test would make pytest fail on it, and the mutant look caught."""
    ids = {i["nodeid"] for i in suite.collect()}
    functions = {nodeid.split("[")[0] for nodeid in ids}
    unknown = sorted({(m.id, t) for m in MUTANTS for t in m.tests
                      if ("::" in t and t not in ids and t not in functions) or ("::" not in t and not (ROOT / t).exists())})
    assert not unknown, f"(mutant, selection) pytest does not collect: {unknown}"
