"""The libraries others install, each in a clean environment, offline, running a user's own test.

Two wheels are built from this checkout (hatchling, the build backend of both pyproject.toml):
`twinshard` (the model, the cost model) and `twinshard-hlo` (twinshard-hlo/: the HLO ledger and
the `expect_*` assertions, twinshard/hlo/ and twinshard/testing.py). They share no file, so both
install into one environment; twinshard-hlo also installs alone, needing only jax and numpy.
twinshard-hlo is installed with `--no-deps` into a new virtual environment that holds only the
locked third-party packages it needs, then twinshard joins it with its own (`uv export --format
pylock.toml`: exact files, installed `--offline` from uv's cache, which this run's `uv run --locked`
filled, so an empty UV_CACHE_DIR works; a bare requirement such as `pytest` would need index metadata
that only an earlier networked install leaves in the cache); each time `uv pip check` proves the wheels' declared
dependency ranges accept them. docs/hlo-assertions.md's pytest file (a test of the user's own
shard_map function) runs there, from a directory outside the repository, so only the installed
packages can be imported.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from packaging.specifiers import SpecifierSet

from test_readme_snippet import snippet

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")  # `uv run` sets UV to its own binary
    assert uv, "uv not found: run the tests as the README says (`uv run --locked pytest`)"
    return uv


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS",
                                                            "JAX_PLATFORMS")}
    env["UV_PYTHON_DOWNLOADS"] = "never"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, pathlib.Path]:
    """{"twinshard": its wheel, "twinshard-hlo": its wheel}, built from this checkout."""
    out = tmp_path_factory.mktemp("dist")
    for where in (ROOT, ROOT / "twinshard-hlo"):
        _run([sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out)], cwd=where)
    (main,), (alone,) = out.glob("twinshard-*.whl"), out.glob("twinshard_hlo-*.whl")
    return {"twinshard": main, "twinshard-hlo": alone}


def _files(wheel: pathlib.Path) -> set[str]:
    return {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}


def _requires(wheel: pathlib.Path) -> dict[str, str]:
    """Requires-Dist without extras: name -> version range."""
    archive = zipfile.ZipFile(wheel)
    metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return dict(re.findall(r"^Requires-Dist: ([\w-]+)([^;\n]*)$", metadata, re.M))


def test_wheels_share_no_file_and_one_top_level_package(wheels: dict[str, pathlib.Path]) -> None:
    main, alone = _files(wheels["twinshard"]), _files(wheels["twinshard-hlo"])
    assert {n.split("/")[0] for n in main | alone} == {"twinshard"}, main | alone
    assert not main & alone, main & alone
    hlo_dir = {f"twinshard/hlo/{p.name}" for p in (ROOT / "twinshard" / "hlo").glob("*.py")}
    assert alone == hlo_dir | {"twinshard/testing.py"}, alone  # the whole directory, no __init__ above it
    assert "twinshard/__init__.py" in main and not any(n.startswith("twinshard/hlo/") for n in main)
    jax_spec = _requires(wheels["twinshard"])["jax"]
    assert "<" in jax_spec and "==" not in jax_spec, f"jax should be a range in the wheel: {jax_spec!r}"
    assert "twinshard-hlo" in _requires(wheels["twinshard"])


def test_assertions_require_only_jax_and_numpy_on_a_jax_range(wheels: dict[str, pathlib.Path]) -> None:
    requires = _requires(wheels["twinshard-hlo"])
    assert set(requires) == {"jax", "numpy"}, requires
    jax_range = SpecifierSet(requires["jax"])
    assert {"0.10.2", "0.12.0.1"} <= set(jax_range.filter(["0.10.2", "0.12.0.1"])), requires["jax"]


def _venv(tmp_path: pathlib.Path) -> str:
    """A new, empty virtual environment: its python."""
    _run([_uv(), "venv", "-q", str(tmp_path / "env"), "--python", sys.executable])
    return str(tmp_path / "env" / "bin" / "python")


def _install_locked(python: str, tmp_path: pathlib.Path, name: str, exported: list[str]) -> None:
    """Install into `python`'s environment the locked third-party packages `uv export` lists with `exported`."""
    lock = tmp_path / f"pylock.{name}.toml"
    _run([_uv(), "export", "--frozen", "--format", "pylock.toml", "--no-emit-workspace", *exported,
          "-o", str(lock)], cwd=ROOT)
    _run([_uv(), "pip", "install", "-q", "--offline", "--python", python, "-r", str(lock)])


def _users_test_passes(python: str, wheels: list[pathlib.Path], tmp_path: pathlib.Path) -> None:
    """Install `wheels` without their dependencies, check the ranges, run the user's pytest file."""
    _run([_uv(), "pip", "install", "-q", "--offline", "--no-deps", "--python", python, *map(str, wheels)])
    _run([_uv(), "pip", "check", "--python", python])
    user = tmp_path / "user"
    user.mkdir(exist_ok=True)
    (user / "test_my_collectives.py").write_text(snippet(containing="def test_"))
    proc = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_collectives.py"], cwd=user)
    assert re.search(r"\b2 passed\b", proc.stdout), proc.stdout
    where = _run([python, "-c", "import twinshard.testing; print(twinshard.testing.__file__)"], cwd=user).stdout
    assert str(python).rsplit("/bin/", 1)[0] in where and str(ROOT) not in where, where


def test_assertions_install_alone_then_beside_twinshard(wheels: dict[str, pathlib.Path],
                                                         tmp_path: pathlib.Path) -> None:
    """twinshard-hlo alone: its locked dependencies and the project's dev group (pytest), nothing of
    twinshard's; the user's test passes and flax, optax, orbax and the model are absent. Then
    twinshard's locked packages and its wheel join it (one environment, its jax installed once): both
    wheels in an environment of exactly twinshard's locked packages, and the user's test passes again."""
    python = _venv(tmp_path)
    # pytest pinned by uv.lock's dev group: a bare `pytest` requirement would need uv's index metadata,
    # which only an earlier networked install leaves in uv's cache (a fresh machine: "pytest was not
    # found in the cache")
    _install_locked(python, tmp_path, "hlo", ["--package", "twinshard-hlo", "--group", "dev"])
    _users_test_passes(python, [wheels["twinshard-hlo"]], tmp_path)
    absent = _run([python, "-c", "import importlib.util as u; print([m for m in ('flax', 'optax', "
                   "'orbax', 'twinshard.model') if u.find_spec(m)])"], cwd=tmp_path).stdout
    assert absent.strip() == "[]", absent
    _install_locked(python, tmp_path, "twinshard", [])
    _users_test_passes(python, [wheels["twinshard"]], tmp_path)
