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

The process: `run()` forks it from tests/zygote.py, a Python that has imported jax, flax,
optax and orbax once (~2.8 s of CPU per launch otherwise), unless the command changes a JAX_*
variable (jax reads those at import) or TWINSHARD_TEST_FORK=0 is set (every command a fresh
`python`, to check that the two agree). See tests/zygote.py for what the child is.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile

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
    environ = env(**extra_env)
    if _zygote_may_run(environ):
        return _Zygote.get().run(list(argv), pathlib.Path(cwd), timeout, environ)
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=timeout)


def _zygote_may_run(environ: dict[str, str]) -> bool:
    if os.environ.get("TWINSHARD_TEST_FORK", "1") == "0":
        return False
    jax_vars = lambda e: {k: v for k, v in e.items() if k.startswith("JAX_")}  # noqa: E731
    return jax_vars(environ) == jax_vars(env())


class _Zygote:
    """tests/zygote.py, started on first use (one per test process) with env()."""

    _instance: "_Zygote | None" = None

    @classmethod
    def get(cls) -> "_Zygote":
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], cwd=ROOT, env=env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line(120) == "ready", "tests/zygote.py did not start"
        atexit.register(self.proc.kill)

    def _line(self, timeout: float) -> str | None:
        """The zygote's next reply line, or None after `timeout` seconds."""
        if not select.select([self.proc.stdout], [], [], max(timeout, 0))[0]:
            return None
        return self.proc.stdout.readline().strip()

    def run(self, argv: list[str], cwd: pathlib.Path, timeout: float, environ: dict[str, str]):
        with tempfile.TemporaryDirectory() as d:
            out, err = pathlib.Path(d, "stdout"), pathlib.Path(d, "stderr")
            request = {"argv": argv, "cwd": str(cwd), "env": environ, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = int(self._line(60).removeprefix("pid "))
            status = self._line(timeout)
            if status is None:  # the child's whole session: a launcher's own subprocesses too
                os.killpg(pid, signal.SIGKILL)
                self._line(60)
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out.read_text(), err.read_text())
            code = int(status.removeprefix("exit "))
            return subprocess.CompletedProcess([sys.executable, *argv], code, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A failed run that says what is wrong in a few lines of stderr, without a traceback."""
    err = proc.stderr
    assert proc.returncode != 0, (proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and "Event loop" not in err, err[-3000:]
    assert len(err.strip().splitlines()) <= 4, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err
