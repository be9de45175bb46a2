"""Join a multi-process run, and leave it with one line when a peer is lost.

jax.distributed (JAX 0.12) treats every error of its coordination service as fatal:
the C++ client logs ~40 lines (an F-line with the status, a C++ stack trace, the
Python stacks) and abort()s, rc 134 (measured, 2 processes x 4 CPU devices):

- a peer killed (kill -9): process 0's service notices the missing heartbeats and
  tells every survivor, which aborts within heartbeat_timeout_seconds of the kill;
  until then the survivor hangs in its gloo collective (gloo itself reports nothing);
- the coordinator (process 0) killed: every other process aborts at once
  (its error-polling RPC to the service fails);
- nobody at --coordinator_address (refused or unresolvable), or a process missing:
  connect() aborts a few seconds after initialization_timeout, on every process that
  did start.

The C++ client's hook for this, `missed_heartbeat_callback`, is unusable from
Python: jaxlib cannot convert its absl::Status argument, and a Python callback ends
in std::terminate (std::bad_cast), still rc 134, without the status. So a
distributed run sends the C++ runtime's stderr (fd 2) to a per-process log file,
keeps Python's own stderr on the terminal, and catches SIGABRT: the handler reads
the fatal status from the log, prints one line (which process was lost, and that
--resume continues) and exits with EXIT_PEER_LOST or EXIT_JOIN_FAILED. Any other
abort copies the log's tail to stderr and aborts as before.
"""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import os
import re
import signal
import sys

from absl import flags

from launch.common import define

EXIT_PEER_LOST = 75    # EX_TEMPFAIL: the run can continue with --resume
EXIT_JOIN_FAILED = 69  # EX_UNAVAILABLE: the processes never formed the run

# The C++ client's fatal message (xla/pjrt/distributed/client.h), then the status.
_FATAL = "Terminating process because the JAX distributed service detected fatal errors."
_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):\s*(.*?)\s*The tasks", re.S)


@dataclasses.dataclass
class Run:
    """What the abort handler needs to word its line; filled before jax starts."""
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    init_timeout: int
    heartbeat_timeout: int
    log_path: str
    log_start: int = 0  # the log is appended to (a resumed run reuses it): read from here
    joined: bool = False


def verdict(log_text: str, run: Run) -> tuple[int, str] | None:
    """(exit code, one line) for the coordination service's fatal error in log_text; None if absent."""
    at = log_text.rfind(_FATAL)
    if at < 0:
        return None
    status = log_text[at + len(_FATAL):]
    me = "this process" if run.process_id is None else f"process {run.process_id}"
    where = f"--coordinator_address={run.coordinator}" if run.coordinator else "the auto-detected coordinator"
    if not run.joined:
        return EXIT_JOIN_FAILED, (
            f"{me}: the run at {where} did not form within --init_timeout="
            f"{run.init_timeout} s: start all --num_processes={run.num_processes} processes with the same "
            f"address (process 0 serves it) and check that it is reachable, or raise --init_timeout.")
    unhealthy = _UNHEALTHY.search(status)
    if unhealthy:
        ids = re.findall(r"task:(\d+)", unhealthy.group(1)) or re.findall(r"\d+", unhealthy.group(1))
        lost = "process " + ", ".join(ids) if ids else "a peer process"
        how = f"no heartbeat for {run.heartbeat_timeout} s"
    elif "Failed to send RPC to coordination service" in status:
        lost, how = "process 0", f"the coordinator{' at ' + run.coordinator if run.coordinator else ''} is gone"
    else:
        first = status.split("absl::Status:", 1)[-1].strip().splitlines()[:1]
        lost, how = "a peer process", first[0] if first else "coordination service error"
    return EXIT_PEER_LOST, (
        f"{me}: lost {lost} ({how}); stopping. Run the same command with --resume on every process "
        f"to continue from the last checkpoint (runtime log: {run.log_path}).")


def check(run: Run) -> None:
    """ValueErrors naming the flag, before anything starts."""
    if run.coordinator is not None:
        host, _, port = run.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator_address={run.coordinator} is not HOST:PORT; pass process 0's "
                             "address and a free port, e.g. --coordinator_address=10.0.0.1:23456.")
        if run.num_processes is None or run.process_id is None:
            raise ValueError("--coordinator_address needs --num_processes and --process_id "
                             "(e.g. --num_processes=2 --process_id=0 on the first host).")
        if run.num_processes < 1 or not 0 <= run.process_id < run.num_processes:
            raise ValueError(f"--process_id={run.process_id} must be one of 0..{run.num_processes - 1} "
                             f"(--num_processes={run.num_processes}); give each process its own index.")
    for name in ("init_timeout", "heartbeat_timeout"):
        if getattr(run, name) < 1:
            raise ValueError(f"--{name}={getattr(run, name)} must be at least 1 (seconds).")


def initialize(run: Run, log_dir: str) -> None:
    """jax.distributed.initialize with bounded waits and the one-line fault report.

    Must run before anything touches a jax backend."""
    import jax

    os.makedirs(log_dir, exist_ok=True)
    run.log_start = os.path.getsize(run.log_path) if os.path.exists(run.log_path) else 0
    _native_stderr_to(run.log_path)
    _on_abort(run)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU: cross-process collectives
    try:
        jax.distributed.initialize(coordinator_address=run.coordinator, num_processes=run.num_processes,
                                   process_id=run.process_id, initialization_timeout=run.init_timeout,
                                   heartbeat_timeout_seconds=run.heartbeat_timeout)
    except ValueError as e:  # measured: "coordinator_address should be defined." when nothing is detected
        if run.coordinator is not None:
            raise
        raise ValueError("--distributed found no cluster to join (TPU pod, SLURM, Open MPI); elsewhere pass "
                         "--coordinator_address=HOST:PORT --num_processes=N --process_id=I instead.") from e
    run.process_id, run.num_processes = jax.process_index(), jax.process_count()
    run.joined = True


def _native_stderr_to(path: str) -> None:
    """fd 2 (C++ logs) -> path, appended; sys.stderr, absl logging and faulthandler keep the terminal."""
    from absl import logging

    terminal = os.dup(2)
    sys.stderr.flush()
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = open(terminal, "w", buffering=1, encoding=sys.stderr.encoding,  # noqa: SIM115
                      errors="backslashreplace")
    logging.get_absl_handler().python_handler.setStream(sys.stderr)
    if faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr)


_handler = None  # the C function pointer must outlive the process's last abort


def _on_abort(run: Run) -> None:
    """SIGABRT -> the one line and a chosen exit code, if the coordination service caused it.

    A Python signal.signal handler would never run: abort() kills the process as soon
    as the C-level handler returns, and the main thread is blocked inside XLA. A ctypes
    handler runs Python on the aborting thread itself (it takes the GIL)."""
    global _handler

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)

    def handler(signum: int) -> None:
        with open(run.log_path, "rb") as f:
            f.seek(max(run.log_start, os.fstat(f.fileno()).st_size - (64 << 10)))
            tail = f.read().decode(errors="replace")
        found = verdict(tail, run)
        if found:
            sys.stdout.flush()
            os.write(sys.stderr.fileno(), (found[1] + "\n").encode())
            os._exit(found[0])
        os.write(sys.stderr.fileno(), tail[-4000:].encode())  # another abort: show its log, then die
        libc.signal(signal.SIGABRT, int(signal.SIG_DFL))  # signal.signal works on the main thread only
        os.kill(os.getpid(), signal.SIGABRT)  # delivered when this handler returns

    _handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(handler)
    libc.signal(signal.SIGABRT, ctypes.cast(_handler, ctypes.c_void_p))


def define_flags() -> None:
    """The flags that join a multi-process run (launch.train's); `join_if_asked` reads them."""
    define(flags.DEFINE_bool, "distributed", False,
           "Join a multi-process run with jax.distributed.initialize() (auto-detected on TPU pods and "
           "SLURM; run the same command on every host).")
    define(flags.DEFINE_string, "coordinator_address", None,
           "host:port of process 0, for multi-process runs that cannot auto-detect (CPU, bare GPU hosts).")
    define(flags.DEFINE_integer, "num_processes", None, "With --coordinator_address: number of processes.")
    define(flags.DEFINE_integer, "process_id", None, "With --coordinator_address: this process's index.")
    define(flags.DEFINE_integer, "init_timeout", 300,
           "Seconds every process waits for all --num_processes to join at the coordinator; about 5 s later "
           f"it exits (code {EXIT_JOIN_FAILED}) with one line saying so.")
    define(flags.DEFINE_integer, "heartbeat_timeout", 10,
           "Seconds without a heartbeat after which a process counts as lost; every other process then "
           f"exits (code {EXIT_PEER_LOST}) with one line naming it. The coordinator's (process 0's) loss "
           "is seen at once.")


def join_if_asked(FLAGS) -> None:
    """jax.distributed.initialize when asked; must run before any jax computation.

    On CPU the cross-process collectives go over gloo (measured here: 2 processes x
    4 simulated devices form one 8-device mesh). A lost peer or a run that never forms
    ends every process with one line on stderr (`initialize`'s abort handler); the C++
    runtime's own log goes to <workdir>/logs/process<I>.log."""
    if not (FLAGS.distributed or FLAGS.coordinator_address):
        return
    log_dir = os.path.join(getattr(FLAGS, "workdir", None) or ".", "logs")
    name = f"process{FLAGS.process_id}" if FLAGS.process_id is not None else f"pid{os.getpid()}"
    run = Run(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
              FLAGS.init_timeout, FLAGS.heartbeat_timeout, os.path.join(log_dir, name + ".log"))
    check(run)
    initialize(run, log_dir)
