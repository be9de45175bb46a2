"""Run a command line as a user would (`python -m launch.X ...`) in its own process.

Launcher flags are process-global (absl), and a user error ends the process
(twinshard.errors.guarded), so command-line behaviour is tested in subprocesses.
They get 8 simulated CPU devices from the launchers themselves (XLA_FLAGS here
carries no device count), the fast compile setting and the persistent compilation
cache of tests/conftest.py, and one Python bytecode cache (`cached_env()`).

The bytecode cache: tests/conftest.py points every test process and subprocess at
.cache/pycache (PYTHONPYCACHEPREFIX, out of the tree; without it, with this project's
PYTHONDONTWRITEBYTECODE=1, each subprocess compiled the sources of jax, flax, orbax and
optax again: 4.5 s of CPU per process, 1.6 s with the cache, measured), except in
tools/mutate.py's runs, which only read the cache.

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
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cached_env(**extra: str) -> dict[str, str]:
    """os.environ with the compilation cache of tests/conftest.py and a shared bytecode cache."""
    # The bytecode settings are tests/conftest.py's (already in os.environ): the shared cache,
    # or tools/mutate.py's read-only one.
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".cache" / "jax"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            **extra}


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


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A failed run that says what is wrong in a few lines of stderr, without a traceback."""
    err = proc.stderr
    assert proc.returncode != 0, (proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and "Event loop" not in err, err[-3000:]
    assert len(err.strip().splitlines()) <= 4, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


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
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buffer, self.exits = b"", {}  # exits: pid -> exit code, as the zygote reports them
        assert self._line(120) == "ready", "tests/zygote.py did not start"
        atexit.register(self.proc.kill)

    def _line(self, timeout: float) -> str | None:
        """The zygote's next reply line, or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if not select.select([self.proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError("tests/zygote.py exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _pump(self, timeout: float) -> str | None:
        """Read one reply line (an exit report is filed in self.exits); None after `timeout` s."""
        line = self._line(timeout)
        if line is not None and line.startswith("exit "):
            _, pid, code = line.split()
            self.exits[int(pid)] = int(code)
        return line

    def start(self, argv: list[str], cwd: pathlib.Path, environ: dict[str, str], stdout: pathlib.Path,
              stderr: pathlib.Path) -> int:
        request = {"argv": argv, "cwd": str(cwd), "env": environ, "stdout": str(stdout), "stderr": str(stderr)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while not (line := self._pump(60) or "").startswith("pid "):
            if not line:
                raise RuntimeError("tests/zygote.py did not start the command")
        return int(line.removeprefix("pid "))

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """pid's exit code, or None if it still runs after `timeout` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.exits:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return None
            self._pump(left)
        return self.exits[pid]

    def run(self, argv: list[str], cwd: pathlib.Path, timeout: float, environ: dict[str, str]):
        return finish(Child(argv, cwd, environ, self), timeout)


def finish(child: "Child", timeout: float) -> subprocess.CompletedProcess:
    """Wait for `child`; past `timeout` seconds, kill it with its own children and raise
    subprocess.TimeoutExpired (what run() does with each command it forks)."""
    try:
        out, err = child.communicate(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


class Child:
    """A command forked by the zygote, with the part of subprocess.Popen's interface the tests
    use: pid, returncode, poll(), wait(), kill(), send_signal(), communicate(), and `stdout` read line by
    line while the child writes it."""

    def __init__(self, argv: list[str], cwd: pathlib.Path, environ: dict[str, str], zygote: _Zygote):
        self._dir = tempfile.TemporaryDirectory()
        self._out, self._err = pathlib.Path(self._dir.name, "stdout"), pathlib.Path(self._dir.name, "stderr")
        # Created here, not only by the child: the zygote answers "pid N" right after fork(), before
        # the child has opened them, and `stdout` may read at once (a CI run on a loaded 2-core
        # machine: FileNotFoundError in test_multiprocess). The child truncates them: still empty.
        self._out.touch()
        self._err.touch()
        self.args, self._zygote, self.returncode = [sys.executable, *argv], zygote, None
        self.pid = zygote.start(argv, cwd, environ, self._out, self._err)

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, timeout)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to the child's session (a launcher's own subprocesses too)."""
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def send_signal(self, signum: int) -> None:
        """`signum` to the child itself (as SLURM's SIGTERM reaches a job's process)."""
        if self.returncode is None:
            os.kill(self.pid, signum)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self.wait(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout, self._read(self._out), self._read(self._err))
        return self._read(self._out), self._read(self._err)

    @staticmethod
    def _read(path: pathlib.Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def stdout(self):
        """Its stdout, line by line as written, until it ends."""
        with open(self._out, errors="replace") as f:
            partial = ""
            while True:
                partial += f.readline()
                if partial.endswith("\n"):
                    yield partial
                    partial = ""
                elif self.poll() is not None:
                    rest = partial + f.read()
                    yield from rest.splitlines(keepends=True)
                    return
                else:
                    time.sleep(0.02)


def spawn(*argv: str, environ: dict[str, str], cwd=ROOT) -> "Child | subprocess.Popen":
    """`python ARGV...` started in the background (stdout and stderr captured, as text): a Child
    of the zygote where run() would fork, else a subprocess.Popen."""
    if _zygote_may_run(environ):
        return Child(list(argv), pathlib.Path(cwd), environ, _Zygote.get())
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
