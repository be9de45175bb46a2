"""Launcher commands forked from tests/harness/zygote.py, a Python that has imported jax, flax,
optax and orbax once, behind the part of subprocess.Popen's interface the tests use.

tests/cli.py's run() and spawn() fork through here unless the command changes a JAX_* variable
(jax reads those at import) or TWINSHARD_TEST_FORK=0 is set (every command a fresh `python`;
tests/test_harness.py checks that the two agree). See tests/harness/zygote.py for what the child is.
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

HERE = pathlib.Path(__file__).resolve().parent


def may_fork(environ: dict[str, str], default: dict[str, str]) -> bool:
    """Whether a command with `environ` may be forked from a zygote started with `default`."""
    if os.environ.get("TWINSHARD_TEST_FORK", "1") == "0":
        return False
    jax_vars = lambda e: {k: v for k, v in e.items() if k.startswith("JAX_")}  # noqa: E731
    return jax_vars(environ) == jax_vars(default)


class Zygote:
    """tests/harness/zygote.py, started on first use (one per test process) with `environ`."""

    _instance: "Zygote | None" = None

    @classmethod
    def get(cls, environ: dict[str, str], cwd: pathlib.Path) -> "Zygote":
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls(environ, cwd)
        return cls._instance

    def __init__(self, environ: dict[str, str], cwd: pathlib.Path):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "zygote.py")], cwd=cwd, env=environ,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buffer, self.exits = b"", {}  # exits: pid -> exit code, as the zygote reports them
        assert self._line(120) == "ready", "tests/harness/zygote.py did not start"
        atexit.register(self.proc.kill)

    def _line(self, timeout: float) -> str | None:
        """The zygote's next reply line, or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if not select.select([self.proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError("tests/harness/zygote.py exited")
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
                raise RuntimeError("tests/harness/zygote.py did not start the command")
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

    def __init__(self, argv: list[str], cwd: pathlib.Path, environ: dict[str, str], zygote: Zygote):
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
