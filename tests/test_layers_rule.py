"""The layer rule of docs/design.md ("Layers"), read from the source's import statements with
`ast`: nothing is imported, no jax."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("twinshard", "auto_parallel", "manual_parallel", "explicit_parallel", "launch")
TWINS = ("auto_parallel", "manual_parallel", "explicit_parallel")

# module (or package prefix) -> its layer; the longest prefix wins
UNITS = {
    "twinshard.config": "base", "twinshard.field_types": "base", "twinshard.errors": "base",
    "twinshard.splash_blocks": "base",
    "twinshard.optimizer_state": "base",
    "twinshard.parallel.axes": "axes",
    "twinshard.model": "model",
    "twinshard.train": "train",
    "twinshard.parallel": "parallel",
    "twinshard.placed": "placed",
    "twinshard.hlo": "hlo",
    "twinshard.cost": "cost",
    "twinshard.hardware.chips": "machine", "twinshard.hardware.links": "machine",
    "twinshard.hardware": "hardware",
    "twinshard.testing": "testing",
    **{t: t for t in TWINS},
    "launch": "launch",
    "tests": "tests",
}
RUN_TIME = {"base", "axes", "model", "train", "parallel"}
LIBRARY = RUN_TIME | {"hlo", "cost", "machine", "hardware"}
# layer -> the other layers it may import
MAY_IMPORT = {
    "base": set(),
    "axes": set(),
    "model": {"base"},
    "train": {"base", "model"},
    "parallel": {"base", "axes"},
    "hlo": set(),
    "cost": {"base", "axes", "parallel", "hlo"},
    "machine": {"axes"},
    "hardware": LIBRARY - {"model"},
    "testing": {"hlo"},  # installs alone with the ledger (twinshard-hlo): jax, numpy and hlo
    "placed": RUN_TIME,
    **{t: RUN_TIME | {"placed"} for t in TWINS},
    "explicit_parallel": RUN_TIME | {"placed", "testing"},  # expect_sharding: the twin's types checked at trace time
    "launch": LIBRARY | {"placed"} | set(TWINS),
}
# (importer, imported layer) -> why it may, until the module is restructured
KNOWN: dict[tuple[str, str], str] = {}

# (importer, module.private name) -> why it may read it
KNOWN_PRIVATE = {
    ("launch.tokenize", "twinshard.train.data._MAX_CARRY"): "names the forced-cut length the reader uses",
    ("launch.tokenize", "twinshard.train.data._READ_BYTES"): "names the forced-cut length the reader uses",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for root in (*CHECKED, "tests") for p in (ROOT / root).rglob("*.py")}


def layer(module: str) -> str | None:
    if module == "twinshard":
        return "base"  # the empty package; its modules each have a layer of their own
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in UNITS:
            return UNITS[".".join(parts[:n])]
    return None


def imports(module: str, tree: ast.AST, modules: set[str]):
    """(line, imported module, names taken from it) of every import of a project module,
    at module or function level; `from pkg import sub` counts as an import of pkg.sub."""
    package = module if module_name_is_package(module, modules) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if layer(a.name) is not None:
                    yield node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            if layer(base) is None:
                continue
            names = []
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    yield node.lineno, f"{base}.{a.name}", ()
                else:
                    names.append(a.name)
            if names:
                yield node.lineno, base, tuple(names)


def module_name_is_package(module: str, modules: set[str]) -> bool:
    return any(m.startswith(module + ".") for m in modules)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(module: str, source: str, modules: set[str]) -> list[str]:
    """Each import of `module`'s source that breaks the rule, as one line."""
    own = layer(module)
    if own is None:
        return [f"{module}: in no layer; add it to UNITS here and to docs/design.md 'Layers'"]
    tree = ast.parse(source)
    found, aliases = [], {}
    for line, target, names in imports(module, tree, modules):
        theirs = layer(target)
        where = f"{module}:{line} imports {target}"
        if theirs != own and theirs not in MAY_IMPORT[own] and (module, theirs) not in KNOWN:
            found.append(f"{where}: layer {own} may not import layer {theirs}")
        if target != module:
            found += [f"{where}: {n} is private to it" for n in names if private(n)]
    for node in ast.walk(tree):  # `import a.b as m` / `from a import b` -> m._x is private to a.b
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if layer(a.name)})
        elif isinstance(node, ast.ImportFrom) and node.module and layer(node.module):
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                            if f"{node.module}.{a.name}" in modules})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and private(node.attr)
                and aliases.get(node.value.id, module) != module
                and (module, f"{aliases[node.value.id]}.{node.attr}") not in KNOWN_PRIVATE):
            found.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}, private to it")
    return found


MODULES = project_modules()


def test_the_code_keeps_the_layers():
    checked = {m: p for m, p in MODULES.items() if m.split(".")[0] in CHECKED}
    assert {m.split(".")[0] for m in checked} == set(CHECKED)  # the walk found the tree
    found = [v for m, p in sorted(checked.items()) for v in violations(m, p.read_text(), set(MODULES))]
    assert not found, "\n".join(found)


def test_every_known_exception_is_still_needed():
    """An exception the code no longer takes is dropped from KNOWN (and from docs/design.md)."""
    used = set()
    for module, theirs in KNOWN:
        tree = ast.parse(MODULES[module].read_text())
        used |= {(module, layer(t)) for _, t, _ in imports(module, tree, set(MODULES))}
    assert set(KNOWN) <= used, set(KNOWN) - used
    for module, name in KNOWN_PRIVATE:
        assert name.rpartition(".")[2] in MODULES[module].read_text(), (module, name)


def loads_by_name(source: str) -> list[int]:
    """Lines that import a module named at run time (importlib, __import__): an edge no import statement shows."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if (isinstance(node, (ast.Import, ast.ImportFrom))
                and any(a.name.split(".")[0] == "importlib" for a in node.names)
                or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "importlib")
            or isinstance(node, ast.Name) and node.id == "__import__"]


def test_no_module_loads_another_by_name():
    """The twins are reached through their packages' registries, imported by statement; a module that
    loaded a twin as f"{twin}_parallel.{name}" would hide an upward edge from the rule above."""
    checked = {m: p for m, p in MODULES.items() if m.split(".")[0] in CHECKED}
    found = {m: lines for m, p in sorted(checked.items()) if (lines := loads_by_name(p.read_text()))}
    assert not found, found
    assert loads_by_name("import importlib\nm = importlib.import_module(f'{twin}_parallel')\n") == [1]
    assert loads_by_name("def f(name):\n    return __import__(name)\n") == [2]


BAD = {  # importer, source, what the check must say
    "hardware links read the strategy registry": (
        "twinshard.hardware.links", "from twinshard.parallel.strategies import ORDER\n",
        "layer machine may not import layer parallel"),
    "the cost model reads the trainer, in a function": (
        "twinshard.cost.memory", "def f():\n    from twinshard.train.optim import make_optimizer\n",
        "layer cost may not import layer train"),
    "a twin imports another twin": (
        "explicit_parallel.tp", "from manual_parallel import tp as manual_tp\n",
        "layer explicit_parallel may not import layer manual_parallel"),
    "a run-time path imports the test helper": (
        "manual_parallel.runner", "from twinshard import testing\n",
        "layer manual_parallel may not import layer testing"),
    "launch imports tests/": (
        "launch.common", "import tests.reference\n", "layer launch may not import layer tests"),
    "the trainer imports the cost model": (
        "twinshard.train.trainer", "import twinshard.cost as c\n", "layer train may not import layer cost"),
    "a private name imported across modules": (
        "twinshard.hlo.records", "from twinshard.hlo.parse import Instr, _unquoted\n", "_unquoted is private"),
    "a private name used through its module": (
        "twinshard.cost.memory", "from twinshard.parallel import mesh as m\nm._is_base('dp')\n",
        "uses twinshard.parallel.mesh._is_base, private to it"),
    "a module in no layer": ("twinshard.newthing", "", "in no layer"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_new_import_that_breaks_the_rule_is_named(case):
    module, source, said = BAD[case]
    found = violations(module, source, set(MODULES))
    assert len(found) == 1 and said in found[0], found


def test_imports_the_rule_allows_pass():
    ok = ("from twinshard.hlo.parse import Instr\n"  # public, same layer
          "from twinshard.parallel import mesh\nmesh.factorings\n"
          "from . import rows\n"  # relative, same package
          "def f():\n    import twinshard.hlo\n    self._x = 1\n")
    assert violations("twinshard.cost.memory", ok, set(MODULES)) == []
