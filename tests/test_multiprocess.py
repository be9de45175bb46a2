"""Multi-host launch, on one machine: two processes x 4 CPU devices (gloo) train one
8-device FSDP mesh with the unchanged launcher and match the single-device run."""

import os
import socket
import subprocess
import sys

import pytest

from test_train import metrics, run_train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_one_mesh_like_a_single_device(tmp_path, tmp_path_factory):
    port, workdir = _free_port(), tmp_path / "mp"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # each process asks for its own 4 devices
    args = [sys.executable, "-m", "launch.train", "--preset=tiny", "--strategy=fsdp", "--impl=manual",
            "--devices=4", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
            f"--workdir={workdir}", "--steps=6", "--log_every=2", "--eval_every=6",
            f"--cache_dir={tmp_path / 'cache'}"]
    procs = [subprocess.Popen(args + [f"--process_id={i}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert "step      6" in outs[0] and "step      6" not in outs[1]  # only process 0 reports

    single = tmp_path / "single"
    run_train(tmp_path_factory, f"--workdir={single}", "--steps=6", "--eval_every=6")
    for a, b in zip(metrics(single), metrics(workdir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-5), a["step"]
    assert metrics(workdir)[-1]["eval_loss"] == pytest.approx(metrics(single)[-1]["eval_loss"], abs=2e-5)
    assert (workdir / "checkpoints" / "6").is_dir()
