"""The library others install: the wheel, in a clean environment, offline, runs a user's own test.

The wheel is built from this checkout (hatchling, the build backend of pyproject.toml) and
installed with `--no-deps` into a new virtual environment that holds only this project's
locked third-party packages (`uv export --format pylock.toml`, installed `--offline` from uv's
cache, which `uv run --locked` filled); `uv pip check` then proves the wheel's declared
dependency ranges accept them. docs/hlo-assertions.md's pytest file (a test of the user's own
shard_map function) runs there, from a directory outside the repository, so only the installed package can be imported.
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
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out)], cwd=ROOT)
    (whl,) = out.glob("twinshard-*.whl")
    return whl


def test_wheel_installs_one_top_level_package(wheel: pathlib.Path) -> None:
    names = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {n for n in names if not n.endswith(".dist-info")} == {"twinshard"}, names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info"))
                                           + "/METADATA").decode()
    requires = re.findall(r"^Requires-Dist: (\S+?)([<>=!~].*)?$", metadata, re.M)
    jax_spec = dict(requires).get("jax", "")
    assert "<" in jax_spec and "==" not in jax_spec, f"jax should be a range in the wheel: {jax_spec!r}"


def test_users_own_test_passes_in_a_clean_environment(wheel: pathlib.Path, tmp_path: pathlib.Path) -> None:
    uv, env_dir = _uv(), tmp_path / "env"
    lock = tmp_path / "pylock.toml"
    _run([uv, "export", "--frozen", "--format", "pylock.toml", "--no-emit-project", "-o", str(lock)],
         cwd=ROOT)
    _run([uv, "venv", "-q", str(env_dir), "--python", sys.executable])
    python = str(env_dir / "bin" / "python")
    _run([uv, "pip", "install", "-q", "--offline", "--python", python, "-r", str(lock)])
    _run([uv, "pip", "install", "-q", "--offline", "--no-deps", "--python", python, str(wheel)])
    _run([uv, "pip", "check", "--python", python])
    user = tmp_path / "user"
    user.mkdir()
    (user / "test_my_collectives.py").write_text(snippet(containing="def test_"))
    proc = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_collectives.py"], cwd=user)
    assert re.search(r"\b2 passed\b", proc.stdout), proc.stdout
    where = _run([python, "-c", "import twinshard; print(twinshard.__file__)"], cwd=user).stdout
    assert str(env_dir) in where and str(ROOT) not in where, where
