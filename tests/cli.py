"""Run a command line as a user would (`python -m launch.X ...`) in its own process.

Launcher flags are process-global (absl), and a user error ends the process
(launch.common.guarded), so command-line behaviour is tested in subprocesses.
They get 8 simulated CPU devices from the launchers themselves (XLA_FLAGS here
carries no device count), the fast compile setting and the persistent compilation
cache of tests/conftest.py, and one Python bytecode cache (`cached_env()`).

The bytecode cache: with PYTHONDONTWRITEBYTECODE=1 in the environment (this project's
shells set it) every subprocess compiled the Python sources of jax, flax, orbax and
optax again: 4.5 s of CPU per process, 1.6 s with the cache (measured; the suite
starts ~50 of them). PYTHONPYCACHEPREFIX keeps the .pyc files under .cache/pycache,
out of the tree. (tools/mutate.py's runs set PYTHONDONTWRITEBYTECODE again: they only
read it, so no .pyc of a mutated file is ever written.)
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cached_env(**extra: str) -> dict[str, str]:
    """os.environ with the compilation cache of tests/conftest.py and a shared bytecode cache."""
    out = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**out, "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".cache" / "jax"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "PYTHONPYCACHEPREFIX": str(ROOT / ".cache" / "pycache"), **extra}


def env(**extra: str) -> dict[str, str]:
    return cached_env(**{"XLA_FLAGS": "--xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu",
                         "TWINSHARD_DEBUG": "0", **extra})


def run(*argv: str, cwd=ROOT, timeout: int = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """`python ARGV...` (e.g. run("-m", "launch.train", "--preset=tiny")), output captured."""
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A failed run that says what is wrong in a few lines of stderr, without a traceback."""
    err = proc.stderr
    assert proc.returncode != 0, (proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and "Event loop" not in err, err[-3000:]
    assert len(err.strip().splitlines()) <= 4, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err
