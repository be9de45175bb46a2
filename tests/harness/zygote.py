"""A Python that has imported jax, flax, optax and orbax once and forks a child per command.

tests/harness/forked.py sends it one JSON request per line on stdin ({"argv", "cwd", "env", "stdout",
"stderr"}); it forks at once and answers "pid N", and "exit N CODE" whenever child N ends
(CODE as subprocess reports it: negative for a signal), so several children may run at once
(test_multiprocess's two processes of one run). The child is what `python ARGV...` would be,
minus the imports already done:

- the process: its own session (forked.py kills the group on a timeout), cwd, the request's
  environment in full, stdin /dev/null, fds 1 and 2 on the request's files;
- the interpreter: sys.argv, sys.path[0] (`-m`: the cwd; a script: its directory;
  `-c`: ''), `-m` through runpy as `__main__`; an uncaught exception prints its traceback
  and exits 1, SystemExit as Python treats it; at the end, non-daemon threads are joined
  and atexit handlers run (orbax finishes its writes there), as at interpreter exit;
- what the imports printed to stderr here is written first to every child's stderr, so a
  test that asserts a quiet stderr still sees the import-time warnings a user would.

What can differ from a fresh process: settings that the preloaded modules read from the
environment at import (jax reads JAX_* variables then): forked.py forks only when the request
changes no JAX_* variable from this process's, and starts a real process otherwise. XLA reads
XLA_FLAGS when a backend first starts, in the child (measured: a child that sets
--xla_force_host_platform_device_count=3 gets 3 devices). numpy's OpenBLAS keeps one thread
here; it re-creates its pool after fork (pthread_atfork), as under multiprocessing's fork.

Measured (2-core VM): the imports cost ~2.8 s of CPU per launcher process; the suite starts
~50 launcher processes through cli.run.
"""

import json
import os
import select
import sys
import tempfile
import time
import warnings

import speed  # tests/harness/speed.py (sys.path[0] is this folder): stdlib imports only

PRELOAD = ("numpy", "jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint", "absl.app", "absl.flags",
           "absl.logging", "tiktoken")


def _preload() -> bytes:
    """Import PRELOAD; return what the imports wrote to fd 2 (and keep fd 2 as it was)."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as err:
        os.dup2(err.fileno(), 2)
        try:
            for name in PRELOAD:
                __import__(name)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return err.read()


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _main_program(argv: list[str]) -> None:
    """Run `python ARGV...`'s program in this process, as __main__."""
    import runpy

    if argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _child(request: dict, import_stderr: bytes) -> None:
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], write), (2, request["stderr"], write)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)  # fds 0-2 only, as a fresh process has
    os.write(2, import_stderr)
    record = None
    if os.environ.get("TWINSHARD_SUITE_PROFILE"):
        import suite_profile  # tests/harness/suite_profile.py

        record = suite_profile.record_launcher(request["argv"])
    code = 0
    try:
        _main_program(request["argv"])
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001  (as the interpreter does with an uncaught exception)
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next  # it starts at the program (`python -m` would show 2 runpy frames)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    try:  # interpreter exit: join non-daemon threads, then the atexit handlers
        import atexit
        import threading

        threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    finally:
        if record:
            record()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code & 0xFF)  # as the OS keeps it (SystemExit(-1) -> 255)


_children: set[int] = set()  # pids of the running children


def main() -> None:
    import_stderr = _preload()
    speed.tune_gc()
    # OpenBLAS's one worker thread makes Python warn at every fork (see the module docstring).
    warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning)
    reply = sys.stdout
    print("ready", file=reply, flush=True)
    requests = sys.stdin.buffer.raw  # unbuffered: select() below sees every line that arrives
    pending, open_ = b"", True
    while open_ or _children:
        if open_ and select.select([requests], [], [], 0.02)[0]:
            chunk = os.read(requests.fileno(), 1 << 20)
            open_ = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line), import_stderr)
                _children.add(pid)
                print(f"pid {pid}", file=reply, flush=True)
        elif not open_:
            time.sleep(0.02)
        for pid in list(_children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _children.discard(pid)
                print(f"exit {pid} {os.waitstatus_to_exitcode(status)}", file=reply, flush=True)


if __name__ == "__main__":
    main()
