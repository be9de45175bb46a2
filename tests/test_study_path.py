"""docs/study-tp.md walks the manual tp and fsdp twins function by function: every `path:name` it
names must exist (a function, class, method `Class.method` or module-level name of that file),
and the README's first screen links to it."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "study-tp.md"


def _names(tree: ast.AST, prefix: str = "") -> set[str]:
    """Every name a module defines: functions, classes, `Class.method`, assigned names."""
    out: set[str] = set()
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(prefix + node.name)
            if isinstance(node, ast.ClassDef):
                out |= _names(node, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not prefix:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def test_every_path_and_function_on_the_study_page_exists() -> None:
    refs = re.findall(r"`([\w/]+\.py):([\w.]+)`", PAGE.read_text())
    assert len(refs) >= 30, refs  # the walk names its steps
    missing = []
    for path, name in refs:
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{path} (no such file)")
        elif name not in _names(ast.parse(file.read_text())):
            missing.append(f"{path}:{name}")
    assert not missing, f"docs/study-tp.md names what does not exist: {missing}"


def test_the_readme_links_the_study_path_on_its_first_screen() -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert "docs/study-tp.md" in first_screen
