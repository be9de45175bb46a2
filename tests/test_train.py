"""End to end: the launcher trains the tiny preset, checkpoints, and resumes exactly."""

import json
import os

import pytest
from absl import flags

from launch import train

FLAGS = flags.FLAGS


def run_train(tmp_path_factory, *args):
    cache = tmp_path_factory.getbasetemp() / "token_cache"
    FLAGS.unparse_flags()
    FLAGS(["train", "--preset=tiny", f"--cache_dir={cache}", "--log_every=2", "--eval_every=4", *args])
    train.main([])


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("full"))
    run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12")
    return workdir


def test_loss_falls_and_metrics_are_logged(full_run):
    recs = metrics(full_run)
    assert [r["step"] for r in recs] == [2, 4, 6, 8, 10, 12]
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time", "skipped"} <= set(recs[0])
    assert "eval_loss" in recs[1] and recs[-1]["eval_loss"] < 5.5  # ln(257) = 5.55 at chance


def test_resume_reproduces_the_uninterrupted_run(full_run, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("resumed"))
    run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", "--stop_after=6")
    assert [r["step"] for r in metrics(workdir)] == [2, 4, 6]
    run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", "--resume")
    a, b = metrics(full_run), metrics(workdir)
    assert [r["step"] for r in b] == [2, 4, 6, 8, 10, 12]
    for ra, rb in zip(a, b):
        for key in ("loss", "lr", "grad_norm", "eval_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)  # bitwise, not approximately


def test_refuses_to_overwrite_checkpoints(full_run, tmp_path_factory):
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        run_train(tmp_path_factory, f"--workdir={full_run}", "--steps=12")


def test_incompatible_checkpoint_is_a_clear_error(full_run, tmp_path_factory):
    with pytest.raises(ValueError, match="different model.*context_length"):
        run_train(tmp_path_factory, f"--workdir={full_run}", "--steps=12", "--resume", "--context_length=16")
    with pytest.raises(ValueError, match=r"different training settings.*'batch_size': \(8, 4\)"):
        run_train(tmp_path_factory, f"--workdir={full_run}", "--steps=12", "--resume", "--batch_size=4")


def test_bad_flags_fail_before_anything_is_written(tmp_path, tmp_path_factory):
    workdir = tmp_path / "never"
    cases = [(["--stop_after=12"], "stop_after=12 must be between 1 and steps-1"),
             (["--log_every=0"], "log_every=0 must be >= 1"),
             (["--eval_every=-1"], "eval_every=-1 must be >= 0"),
             (["--mesh=data:8,tensor:1"], "needs a parallel --strategy"),
             (["--resume"], "no checkpoint in"),
             (["--strategy=fsdp", "--mesh=data:3,tensor:1"], "3 devices but 8"),
             (["--preset=huge"], "unknown preset 'huge'")]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", *extra)
        assert not workdir.exists(), extra


def test_eval_runs_on_its_own_schedule(tmp_path, tmp_path_factory):
    run_train(tmp_path_factory, f"--workdir={tmp_path}", "--steps=8", "--log_every=3", "--eval_every=4")
    recs = metrics(tmp_path)
    assert [r["step"] for r in recs] == [3, 4, 6, 8]
    assert [r["step"] for r in recs if "eval_loss" in r] == [4, 8]


def test_missing_data_and_short_corpus_fail_before_writing(tmp_path, tmp_path_factory):
    workdir = tmp_path / "never"
    with pytest.raises(FileNotFoundError, match="--data"):
        run_train(tmp_path_factory, f"--workdir={workdir}", f"--data={tmp_path / 'nope.txt'}")
    short = tmp_path / "short.txt"
    short.write_text("x" * 30)
    with pytest.raises(ValueError, match="fewer than context_length"):
        run_train(tmp_path_factory, f"--workdir={workdir}", f"--data={short}")
    assert not workdir.exists()


def test_corrupt_checkpoint_is_a_clear_error(full_run, tmp_path_factory):
    import shutil

    workdir = tmp_path_factory.mktemp("corrupt") / "w"
    shutil.copytree(full_run, workdir)
    state_dir = workdir / "checkpoints" / "12" / "state"
    for path in state_dir.rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt or unreadable.*fresh --workdir"):
        run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", "--resume")


def test_sample_generates_from_a_checkpoint(full_run):
    import subprocess
    import sys

    # A subprocess: launch.sample and launch.train define flags of the same names.
    out = subprocess.run([sys.executable, "-m", "launch.sample", f"--workdir={full_run}",
                          "--prompt=ROMEO:", "--max_new_tokens=8"],
                         capture_output=True, text=True, check=True, env={**os.environ, "XLA_FLAGS": ""}).stdout
    assert out.startswith("ROMEO:") and len(out.rstrip("\n")) > len("ROMEO:")


def test_strategies_train_through_the_launcher_and_checkpoints_reshard(full_run, tmp_path_factory):
    """Manual FSDP trains to step 6 and checkpoints; auto DP resumes it (Orbax reads the
    FSDP-sharded arrays into the replicated layout); both match the single-device run."""
    workdir = str(tmp_path_factory.mktemp("strategies"))
    run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", "--stop_after=6",
              "--strategy=fsdp", "--impl=manual")
    run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", "--resume",
              "--strategy=dp", "--impl=auto")
    a, b = metrics(full_run), metrics(workdir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4, 6, 8, 10, 12]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-4), ra["step"]
        assert ("eval_loss" in ra) == ("eval_loss" in rb)
        if "eval_loss" in ra:
            assert rb["eval_loss"] == pytest.approx(ra["eval_loss"], abs=1e-4), ra["step"]
