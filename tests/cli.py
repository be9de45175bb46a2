"""Run a command line as a user would (`python -m launch.X ...`) in its own process.

Launcher flags are process-global (absl), and a user error ends the process
(twinshard.errors.guarded), so command-line behaviour is tested in subprocesses.
They get 8 simulated CPU devices from the launchers themselves (XLA_FLAGS here
carries no device count), the fast compile setting and the persistent compilation
cache of tests/conftest.py, and the shared bytecode cache (tests/harness/speed.py).
Each command is forked from a pre-imported Python (tests/harness/forked.py) where
that cannot change what it sees.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from harness import cache, forked

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cached_env(**extra: str) -> dict[str, str]:
    """os.environ (with tests/harness/speed.py's bytecode settings) and the compilation cache
    of tests/conftest.py."""
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache.directory()),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            **extra}


LAUNCHER_XLA_FLAGS = "--xla_backend_optimization_level=0"  # conftest's, but the device count (a launcher asks)


def env(**extra: str) -> dict[str, str]:
    return cached_env(**{"XLA_FLAGS": LAUNCHER_XLA_FLAGS, "JAX_PLATFORMS": "cpu",
                         "TWINSHARD_DEBUG": "0", **extra})


def run(*argv: str, cwd=ROOT, timeout: int = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """`python ARGV...` (e.g. run("-m", "launch.train", "--preset=tiny")), output captured."""
    environ = env(**extra_env)
    if forked.may_fork(environ, env()):
        return forked.Zygote.get(env(), ROOT).run(list(argv), pathlib.Path(cwd), timeout, environ)
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=timeout)


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A failed run that says what is wrong in a few lines of stderr, without a traceback."""
    err = proc.stderr
    assert proc.returncode != 0, (proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and "Event loop" not in err, err[-3000:]
    assert len(err.strip().splitlines()) <= 4, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def spawn(*argv: str, environ: dict[str, str], cwd=ROOT) -> "forked.Child | subprocess.Popen":
    """`python ARGV...` started in the background (stdout and stderr captured, as text): a Child
    of the zygote where run() would fork, else a subprocess.Popen."""
    if forked.may_fork(environ, env()):
        return forked.Child(list(argv), pathlib.Path(cwd), environ, forked.Zygote.get(env(), ROOT))
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
