"""Multi-host launch, on one machine: two processes x 4 CPU devices (gloo) train one
8-device FSDP mesh with the unchanged launcher and match the single-device run; two processes
train as two slices, and their checkpoint resumes on 4 slices and on 1; when
one process dies, the other stops with one line and its own exit code (launch/distributed.py).

No test here bounds a wall time from above: how soon a loss is seen depends on the load of
the machine, so each wait is a hang guard (a generous timeout that fails the test only when
a process never ends), and the behaviour is asserted by the exit code and the line."""

import re
import signal
import socket
import threading
import time

import pytest

from cli import LAUNCHER_XLA_FLAGS, cached_env, run, spawn
from launch import distributed
from test_train import metrics, run_train

# XLA_FLAGS: each process asks for its own 4 devices; opt level 0, the compilation cache as in
# conftest (after the first run, the processes start training in seconds) and the bytecode cache
_ENV = cached_env(JAX_PLATFORMS="cpu", XLA_FLAGS=LAUNCHER_XLA_FLAGS)


LONG = 100_000  # --steps of every 2-process run here: one program (see the first test)
HANG = 300  # seconds: a hang guard for each launcher process, not a claim about its speed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, port: int, process_id: int, *args: str, strategy: tuple[str, ...] = ("--strategy=fsdp",)):
    """One process of a 2-process tiny fsdp/manual run of launch.train (cli.spawn: forked from
    the pre-imported zygote, like every launcher process of the suite; a Popen-like object);
    `strategy`: the flags of another strategy and its mesh."""
    return spawn("-m", "launch.train", "--preset=tiny", *strategy, "--impl=manual", "--devices=4",
                 f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={process_id}",
                 f"--cache_dir={tmp_path / 'cache'}", *args, environ=_ENV)


def _wait_for_line(proc, prefix: str) -> None:
    """Read proc's stdout up to a line starting with `prefix`, within HANG seconds: a bare `for line
    in proc.stdout` blocks for ever on a process that hangs before printing it."""
    done, seen = threading.Event(), []

    def read():
        for line in proc.stdout:
            if line.startswith(prefix):
                break
            seen.append(line)
        done.set()  # the line, or the end of the output (the test's asserts then say what ended)

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(HANG), f"no line starting {prefix!r} within {HANG} s; last lines: {seen[-5:]}"


def test_two_processes_train_one_mesh_like_a_single_device(tmp_path, tmp_path_factory):
    port, workdir = _free_port(), tmp_path / "mp"
    # 6 of LONG steps: the lost-peer tests below train the same program (--steps is a constant of
    # the compiled step, through the lr schedule), loaded from the compilation cache
    procs = [_launch(tmp_path, port, i, f"--workdir={workdir}", f"--steps={LONG}", "--stop_after=6",
                     "--log_every=2", "--eval_every=6") for i in range(2)]
    outs = [p.communicate(timeout=HANG) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[0][-3000:] + e[-3000:] for o, e in outs)
    assert "step      6" in outs[0][0] and "step      6" not in outs[1][0]  # only process 0 reports

    single = tmp_path / "single"
    run_train(tmp_path_factory, f"--workdir={single}", f"--steps={LONG}", "--stop_after=6", "--eval_every=6")
    for a, b in zip(metrics(single), metrics(workdir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-5), a["step"]
    assert metrics(workdir)[-1]["eval_loss"] == pytest.approx(metrics(single)[-1]["eval_loss"], abs=2e-5)
    assert (workdir / "checkpoints" / "6").is_dir()


@pytest.mark.hsdp
def test_two_processes_train_as_two_slices_like_a_single_device(tmp_path, tmp_path_factory):
    """hsdp with each process a slice (--dcn_mesh=data:2: processes are the granules of
    create_hybrid_device_mesh on CPU, which has no slice_index): fsdp over each process's 4 devices,
    data parallel across the two. The single run is the first test's program (the compilation cache).
    The 2-slice run's checkpoint then resumes in this process on 4 slices and on 1 (_resume_on_other_slices)."""
    port, workdir = _free_port(), tmp_path / "slices"
    hsdp = ("--strategy=hsdp", "--dcn_mesh=data:2", "--mesh=fsdp:4")
    procs = [_launch(tmp_path, port, i, f"--workdir={workdir}", f"--steps={LONG}", "--stop_after=6",
                     "--log_every=2", "--eval_every=6", strategy=hsdp) for i in range(2)]
    outs = [p.communicate(timeout=HANG) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[0][-3000:] + e[-3000:] for o, e in outs)
    assert "across 2 slices (data:2 over DCN, by process)" in outs[0][0], outs[0][0][-2000:]

    single = tmp_path / "single"  # one step further than the 2-slice run: the resumed runs' step 7
    run_train(tmp_path_factory, f"--workdir={single}", f"--steps={LONG}", "--stop_after=7", "--log_every=1",
              "--eval_every=6")
    want = {r["step"]: r for r in metrics(single)}
    for b in metrics(workdir):
        assert b["loss"] == pytest.approx(want[b["step"]]["loss"], abs=2e-5), b["step"]
    assert metrics(workdir)[-1]["eval_loss"] == pytest.approx(want[6]["eval_loss"], abs=2e-5)
    _resume_on_other_slices(tmp_path, tmp_path_factory, workdir, want[7]["loss"])


# (strategy, --mesh, --dcn_mesh): 4 slices of 2 devices in this one process (simulated: its 8 devices
# split in order), and 1 slice (no --dcn_mesh): fsdp over all 8
OTHER_SLICES = [("hsdp", "fsdp:2", "data:4"), ("fsdp", "data:8,tensor:1", None)]


def _saved_params(step_dir):
    """The params of a checkpoint's state as Orbax wrote them, read back as plain NumPy (no sharding)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    reader = ocp.PyTreeCheckpointer()
    tree = reader.metadata(step_dir / "state").item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return reader.restore(step_dir / "state", args=ocp.args.PyTreeRestore(restore_args=as_numpy))["params"]


def _resume_on_other_slices(tmp_path, tmp_path_factory, workdir, loss7: float) -> None:
    """The 2-slice checkpoint of step 6 restores into each of OTHER_SLICES' meshes (Orbax reshards it):
    every param on that mesh and equal to the saved array; and launch.train --resume there trains
    step 7 to the single device's loss."""
    import dataclasses
    import shutil

    import jax
    import numpy as np

    from launch import common
    from twinshard.config import preset
    from twinshard.train.checkpoint import Checkpointer

    saved = _saved_params(workdir / "checkpoints" / "6")
    tiny = preset("tiny")
    cfg = dataclasses.replace(tiny, train=dataclasses.replace(tiny.train, steps=LONG))  # the runs' optimizer
    for strategy, mesh, dcn in OTHER_SLICES:
        runner = common.make_runner(strategy, "manual", mesh, cfg, dcn_spec=dcn)
        state, _ = Checkpointer(str(workdir / "checkpoints"), create=False).restore(runner.abstract_state(), {}, step=6)
        for path, got in jax.tree_util.tree_leaves_with_path(state.params):
            assert got.sharding.mesh == runner.mesh, path  # resharded onto this run's mesh
            want = saved
            for key in path:
                want = want[key.key]
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))

        again = tmp_path / f"on_{dcn or 'one_slice'}"
        shutil.copytree(workdir, again)
        run_train(tmp_path_factory, f"--workdir={again}", f"--strategy={strategy}", "--impl=manual", f"--mesh={mesh}",
                  *([f"--dcn_mesh={dcn}"] if dcn else []), f"--steps={LONG}", "--resume", "--stop_after=7",
                  "--log_every=1", "--eval_every=0")
        step7 = metrics(again)[-1]
        assert step7["step"] == 7 and step7["loss"] == pytest.approx(loss7, abs=2e-5), (strategy, mesh, dcn)


HEARTBEAT = 3  # seconds (--heartbeat_timeout)


# (victim, the line of process 0 after which it is killed): process 1 mid-training; the
# coordinator right after the run formed, while process 1 still builds and compiles.
@pytest.mark.parametrize("victim, kill_after", [(1, "step      1 "), (0, "fsdp/manual preset=tiny")])
def test_a_lost_process_stops_the_other_with_one_line(tmp_path, victim, kill_after):
    workdir = tmp_path / "run"
    port = _free_port()
    # --heartbeat_timeout=3, not the default 10: the same detection, less waiting (measured, the
    # killed peer mid-training: seen after 10.0 s at 10, 2.2 s at 3; the test 25 -> 18 s)
    procs = [_launch(tmp_path, port, i, f"--workdir={workdir}", f"--steps={LONG}", "--log_every=1",
                     "--eval_every=0", f"--heartbeat_timeout={HEARTBEAT}") for i in range(2)]
    survivor = procs[1 - victim]
    try:
        _wait_for_line(procs[0], kill_after)
        procs[victim].kill()
        err = survivor.communicate(timeout=HANG)[1]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert survivor.returncode == distributed.EXIT_PEER_LOST, err[-3000:]
    line, = err.splitlines()  # one line, the C++ runtime's ~40 lines went to the log it names
    # a killed peer is seen by its missing heartbeats; the coordinator's loss by its closed connection
    why = f"no heartbeat for {HEARTBEAT} s); stopping." if victim else ""
    assert line.startswith(f"process {1 - victim}: lost process {victim} ({why}"), line
    assert "--resume" in line and str(workdir / "logs" / f"process{1 - victim}.log") in line
    assert distributed._FATAL in (workdir / "logs" / f"process{1 - victim}.log").read_text()


def test_sigterm_to_one_process_stops_both_at_one_checkpointed_step(tmp_path):
    """A preemption reaches one host: both processes agree on the step to stop at (launch/train.py
    Preemption: an all-gathered flag per step), write that step's checkpoint together and exit
    with 128 + SIGTERM; process 0, which got no signal, says why in one line."""
    workdir, port = tmp_path / "run", _free_port()
    procs = [_launch(tmp_path, port, i, f"--workdir={workdir}", f"--steps={LONG}", "--log_every=1",
                     "--eval_every=0") for i in range(2)]
    try:
        _wait_for_line(procs[0], "step      2 ")
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=HANG) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, "\n".join(e[-3000:] for _, e in outs)
    stopped = [line for line in outs[0][0].splitlines() if line.startswith("stopped by SIGTERM after step")]
    assert len(stopped) == 1, outs[0][0][-3000:]
    step = int(re.match(r"stopped by SIGTERM after step (\d+):", stopped[0])[1])
    assert step >= 2 and max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == step


def test_an_unreachable_coordinator_fails_after_init_timeout(tmp_path):
    port, workdir = _free_port(), tmp_path / "run"  # nobody listens there
    started = time.monotonic()
    proc = _launch(tmp_path, port, 1, f"--workdir={workdir}", "--init_timeout=2")
    err = proc.communicate(timeout=HANG)[1]
    seconds = time.monotonic() - started
    assert proc.returncode == distributed.EXIT_JOIN_FAILED, err[-3000:]
    # It waited out --init_timeout: a lower bound, which load only lengthens (measured on a
    # quiet machine: --init_timeout + 5.2 s; no upper bound, that is the machine's speed).
    assert seconds >= 2, seconds
    assert err.splitlines() == [
        f"process 1: the run at --coordinator_address=127.0.0.1:{port} did not form within --init_timeout=2 s: "
        "start all --num_processes=2 processes with the same address (process 0 serves it) and check that it "
        "is reachable, or raise --init_timeout."]


def test_distributed_without_a_cluster_says_what_to_pass(tmp_path):
    code = ("import sys; from launch import distributed as d; "
            "d.initialize(d.Run(None, None, None, 5, 10, sys.argv[1] + '/logs/p.log'), sys.argv[1] + '/logs')")
    proc = run("-c", code, str(tmp_path), timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "ValueError: --distributed found no cluster to join (TPU pod, SLURM, Open MPI); elsewhere pass "
        "--coordinator_address=HOST:PORT --num_processes=N --process_id=I instead.")


# The C++ client's fatal log text, as measured in the runs above (JAX 0.12), trimmed.
_LOST_TASK = (f"F1130 client.h:86] {distributed._FATAL} This most likely indicates that another task died. "
              "absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n"
              "{tasks}\nThe tasks have crashed. Check the task logs for an earlier error.\n\n"
              "RPC: /xla.coordination.CoordinationService/PollForError\n*** Check failure stack trace: ***\n")
_LOST_LEADER = (f"F1130 client.h:86] {distributed._FATAL} absl::Status: UNAVAILABLE: Failed to send RPC to "
                "coordination service. Either the leader task was preempted/died/restarted unexpectedly or "
                "this task is experiencing network issues.\n:UNAVAILABLE:Stream removed (Socket closed)\n")


@pytest.mark.parametrize("text, me, lost", [
    (_LOST_TASK.format(tasks="1"), 0, "process 1 (no heartbeat for 10 s)"),
    (_LOST_TASK.format(tasks="/job:jax_worker/replica:0/task:2\n/job:jax_worker/replica:0/task:3"), 0,
     "process 2, 3 (no heartbeat for 10 s)"),
    (_LOST_LEADER, 1, "process 0 (the coordinator at h:1 is gone)")])
def test_verdict_names_the_lost_process(text, me, lost):
    run = distributed.Run("h:1", 4, me, 300, 10, "L", joined=True)
    code, line = distributed.verdict("E1130 earlier noise\n" + text, run)
    assert code == distributed.EXIT_PEER_LOST
    assert line == (f"process {me}: lost {lost}; stopping. Run the same command with --resume on every "
                    "process to continue from the last checkpoint (runtime log: L).")


def test_verdict_leaves_other_aborts_alone():
    run = distributed.Run("h:1", 2, 0, 300, 10, "L", joined=True)
    assert distributed.verdict("F1130 some_pass.cc:12] Check failed: x == y\n*** Check failure ***", run) is None


@pytest.mark.parametrize("flag, value, says", [
    ("coordinator", "10.0.0.1", "--coordinator_address=10.0.0.1 is not HOST:PORT"),
    ("coordinator", "h:99999", "is not HOST:PORT"),
    ("process_id", 2, "--process_id=2 must be one of 0..1"),
    ("num_processes", None, "needs --num_processes and --process_id"),
    ("heartbeat_timeout", 0, "--heartbeat_timeout=0 must be at least 1"),
    ("init_timeout", -5, "--init_timeout=-5 must be at least 1")])
def test_bad_distributed_flags_are_named(flag, value, says):
    run = distributed.Run("h:1", 2, 1, 300, 10, "L")
    setattr(run, flag, value)
    with pytest.raises(ValueError, match=re.escape(says)):
        distributed.check(run)


# The handler's mechanics without a run: fd 2 goes to the log, Python's stderr stays,
# and abort() after the C++ client's fatal text becomes the one line and exit code.
_ABORT = """
import os, sys
from launch import distributed
run = distributed.Run("h:1", 2, 1, 300, 10, sys.argv[1], joined=True)
distributed._native_stderr_to(run.log_path)
distributed._on_abort(run)
print("python's stderr", file=sys.stderr, flush=True)
os.write(2, sys.argv[2].encode())  # as the C++ runtime writes before it abort()s
os.abort()
"""


@pytest.mark.parametrize("native", [_LOST_LEADER, "F1130 pass.cc:12] Check failed: x == y\n"])
def test_abort_handler_replaces_a_coordination_abort_only(tmp_path, native):
    log = tmp_path / "process1.log"
    proc = run("-c", _ABORT, str(log), native, timeout=120)
    assert log.read_text() == native  # the C++ text went to the log, not the terminal
    expected = distributed.verdict(native, distributed.Run("h:1", 2, 1, 300, 10, str(log), joined=True))
    if expected:
        assert proc.returncode == expected[0] == distributed.EXIT_PEER_LOST
        assert proc.stderr.splitlines() == ["python's stderr", expected[1]]
    else:  # any other abort: its log is shown, and it still aborts
        assert proc.returncode == -signal.SIGABRT
        assert proc.stderr == "python's stderr\n" + native
