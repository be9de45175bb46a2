"""End to end: the launcher trains the tiny preset, checkpoints, and resumes exactly."""

import contextlib
import dataclasses
import functools
import json
import os
import pathlib

import pytest
from absl import flags

from cli import assert_user_error, run
from launch import train
from twinshard.hardware import measure
from twinshard.parallel import strategies

FLAGS = flags.FLAGS


@pytest.fixture(autouse=True, scope="module")
def one_matmul_peak():
    """On a CPU the launcher measures the machine's float32 matmul rate (MFU's peak) at each start:
    0.8 s of CPU and ~3 s of wall on the loaded 2-core machine (measured), and this module starts it
    in process ~12 times. Its runs share the first run's measurement (the same device and arguments);
    test_log_reports_model_flops_and_mfu checks the records against it."""
    patch = pytest.MonkeyPatch()
    patch.setattr(measure, "matmul_peak", functools.cache(measure.matmul_peak))
    yield
    patch.undo()


def run_train(tmp_path_factory, *args):
    cache = tmp_path_factory.getbasetemp() / "token_cache"
    FLAGS.unparse_flags()
    FLAGS(["train", "--preset=tiny", f"--cache_dir={cache}", "--log_every=2", "--eval_every=4", *args])
    train.main([])


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def board(workdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of the TensorBoard event files in `workdir`, as TensorBoard's own reader
    sees them (its purge of a restarted run's later points included)."""
    from tensorboard.backend.event_processing import event_accumulator

    reader = event_accumulator.EventAccumulator(str(workdir), size_guidance={event_accumulator.SCALARS: 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def f32(x) -> float:
    """A value as an event file holds it (a float32)."""
    import numpy as np

    return float(np.float32(x))


def board_of(records) -> dict[str, list[tuple[int, float]]]:
    """What board() should read for these metrics.jsonl records: each number at its step."""
    from twinshard.train import tensorboard

    out = {}
    for r in records:
        for tag, value in tensorboard.scalars(r).items():
            out.setdefault(tag, []).append((r["step"], f32(value)))
    return out


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


def test_tensorboard_scalars_are_the_metrics_records(full_run):
    """The event files in the workdir, read back by TensorBoard's reader, hold every number of every
    metrics.jsonl record at its step and nothing else: the loss, eval loss, lr, tokens/s, step time
    and MFU under the tags named here (a CPU run has no memory figure: the next test writes those)."""
    recs, read = metrics(full_run), board(full_run)
    named = {"loss/train": "loss", "loss/eval": "eval_loss", "optimizer/lr": "lr", "speed/tokens_per_s":
             "tokens_per_s", "speed/step_time_s": "step_time", "speed/mfu": "mfu"}
    for tag, key in named.items():
        assert read[tag] == [(r["step"], f32(r[key])) for r in recs if key in r], tag
    assert [step for step, _ in read["loss/eval"]] == [4, 8, 12]  # eval on its own schedule
    assert read == board_of(recs)


def test_tensorboard_memory_lists_and_a_restart_read_back(tmp_path):
    """Hand-written records: memory figures go under memory/, a list one scalar per element, and a
    second writer opened in the same second as a run resumed from step 2 neither overwrites the first
    file nor leaves its step 3 beside the resumed run's."""
    from twinshard.train import tensorboard

    gib = 2**30
    first = [{"step": s, "loss": 3.0 - s, "program_memory_bytes": 5 * gib + s, "peak_memory_bytes": gib,
              "tokens_per_expert": [s, 10 - s]} for s in (1, 2, 3)]
    with tensorboard.Scalars(str(tmp_path)) as run:
        for r in first:
            run.add(r)
    with tensorboard.Scalars(str(tmp_path), start=2) as resumed:
        resumed.add({"step": 3, "loss": 9.5})
    assert board(tmp_path) == {
        "loss/train": [(1, 2.0), (2, 1.0), (3, 9.5)],
        "memory/program_memory_bytes": [(1, f32(5 * gib + 1)), (2, f32(5 * gib + 2))],
        "memory/peak_memory_bytes": [(1, gib), (2, gib)],
        "train/tokens_per_expert/0": [(1, 1.0), (2, 2.0)], "train/tokens_per_expert/1": [(1, 9.0), (2, 8.0)]}


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


def test_log_reports_model_flops_and_mfu(full_run):
    """Each record's TFLOP/s per device is the cost model's FLOPs per step over the step time (one
    device), and MFU that rate over the peak it names (the CPU's measured matmul rate: measured
    under whatever load the machine has, so no bound on the fraction is asserted)."""
    from twinshard import cost
    from twinshard.config import preset

    cfg = preset("tiny")
    f = cost.flops(cfg.model, cfg.train.batch_size, cfg.model.context_length)
    step_flops = f.model_total  # causal attention counted half
    assert step_flops == 3 * (f.forward_matmul + f.forward_attention // 2) < f.total
    for r in metrics(full_run):
        assert r["tflops_per_device"] * 1e12 * r["step_time"] == pytest.approx(step_flops, rel=1e-9)
        assert r["peak_flops"] > 0 and r["mfu"] == pytest.approx(step_flops / r["step_time"] / r["peak_flops"])


def test_sigterm_checkpoints_the_step_and_resume_is_exact(full_run, tmp_path_factory, monkeypatch):
    """SIGTERM while step 6 runs (sent from its batch's read, so the test does not depend on timing):
    step 6 finishes, is checkpointed, the run exits with 128 + 15 and one line; --resume then
    reproduces the uninterrupted run bit for bit."""
    import signal

    from twinshard.train import data

    real = data.get_batch

    def get_batch(tokens, batch, context, seed, step):
        if step == 5:  # 0-based: the batch of step 6
            os.kill(os.getpid(), signal.SIGTERM)
        return real(tokens, batch, context, seed, step)

    workdir = str(tmp_path_factory.mktemp("preempted"))
    monkeypatch.setattr(data, "get_batch", get_batch)
    with pytest.raises(SystemExit) as stopped:
        run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12")
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the launcher's handler is gone again
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["6"]
    monkeypatch.setattr(data, "get_batch", real)
    run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", "--resume")
    for ra, rb in zip(metrics(full_run), metrics(workdir), strict=True):
        for key in ("loss", "lr", "grad_norm", "eval_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)


def test_profile_steps_write_a_trace_of_the_train_step(tmp_path_factory):
    """--profile_steps=2:2 writes a Perfetto trace (and TensorBoard's xplane) under <workdir>/plugins/profile
    whose events include the jitted train step; a bad range is refused before anything runs."""
    import gzip

    workdir = tmp_path_factory.mktemp("profiled")
    run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", "--stop_after=3", "--profile_steps=2:2")
    traces = list(workdir.glob("plugins/profile/*/perfetto_trace.json.gz"))  # where TensorBoard looks
    assert len(traces) == 1 and list(traces[0].parent.glob("*.xplane.pb"))
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    assert any("train_step" in e.get("name", "") for e in events)
    with pytest.raises(ValueError, match=r"--profile_steps=11:3 must be START:COUNT .* <= --steps=12"):
        run_train(tmp_path_factory, f"--workdir={tmp_path_factory.mktemp('bad')}", "--steps=12",
                  "--profile_steps=11:3")


def test_refuses_to_overwrite_checkpoints(full_run, tmp_path_factory):
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        run_train(tmp_path_factory, f"--workdir={full_run}", "--steps=12")


def test_incompatible_checkpoint_is_a_clear_error(full_run, tmp_path_factory):
    with pytest.raises(ValueError, match=r"^--resume: checkpoint \S+ holds another model \(\(checkpoint, now\) = "
                                         r"\{'context_length': \((\d+), 16\)\}\), .* pass --context_length=\1, or use") as e:
        run_train(tmp_path_factory, f"--workdir={full_run}", "--steps=12", "--resume", "--context_length=16")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"different training settings.*'batch_size': \(8, 4\)"):
        run_train(tmp_path_factory, f"--workdir={full_run}", "--steps=12", "--resume", "--batch_size=4")


def test_a_config_field_newer_than_the_checkpoint_reads_as_its_default():
    """A checkpoint written before ModelConfig had first_dense_layers restores into a model that
    leaves it at 0, and only there."""
    import dataclasses

    from twinshard.config import preset
    from twinshard.train.checkpoint import CheckpointError, _check_same

    now = dataclasses.asdict(preset("tiny_moe").model)
    older = {k: v for k, v in now.items() if k != "first_dense_layers"}
    _check_same("model", older, now, "ckpt/3")
    with pytest.raises(CheckpointError, match=r"different model .*'first_dense_layers': \(None, 1\)"):
        _check_same("model", older, {**now, "first_dense_layers": 1}, "ckpt/3")


def test_restore_compares_the_checkpoints_settings_before_reading_its_arrays(tmp_path):
    """Checkpointer.restore itself refuses a checkpoint written with other settings, naming the field
    (launch.train checks before it compiles, so its runs never reach this check: the API is tested here),
    and restores one written with the same."""
    import jax.numpy as jnp

    from twinshard.train.checkpoint import CheckpointError, Checkpointer

    ckpt, state = Checkpointer(str(tmp_path / "ckpt")), {"w": jnp.arange(4.0)}
    meta = {"model": {"d_model": 64, "num_layers": 2}, "train": {"batch_size": 8}}
    ckpt.save(3, state, meta)
    with pytest.raises(CheckpointError, match=r"different model .*'num_layers': \(2, 3\)"):
        ckpt.restore(state, {**meta, "model": {"d_model": 64, "num_layers": 3}})
    restored, got = ckpt.restore(state, meta)
    assert got == meta and restored["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_bad_flags_fail_before_anything_is_written(tmp_path, tmp_path_factory):
    workdir = tmp_path / "never"
    cases = [(["--stop_after=12"], "stop_after=12 must be between 1 and steps-1"),
             (["--log_every=0"], "log_every=0 must be >= 1"),
             (["--eval_every=-1"], "eval_every=-1 must be >= 0"),
             (["--mesh=data:8,tensor:1"], rf"needs a parallel --strategy \({', '.join(strategies.NAMES)}\)"),
             (["--resume"], "no checkpoint in"),
             (["--strategy=fsdp", "--mesh=data:3,tensor:1"], "3 devices but 8"),
             (["--preset=huge"], "unknown preset 'huge'")]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", *extra)
        assert not workdir.exists(), extra


def test_eval_runs_on_its_own_schedule(kept_run):
    """kept_run logs every 3 steps and evaluates every 4 (run_train's --eval_every): its records are
    the log steps and the eval step between them, the eval loss at step 4 only."""
    recs = metrics(kept_run)
    assert [r["step"] for r in recs] == [3, 4, 6]
    assert [r["step"] for r in recs if "eval_loss" in r] == [4]


def test_eval_averages_eval_batches_batches_of_the_same_state(full_run, tmp_path, tmp_path_factory, monkeypatch):
    """The preset's eval_batches (no flag sets it): 1 evaluates the state full_run evaluated at step 4
    (tiny's 2 batches) on its first batch alone, another mean. (The preset replaced by an equal one
    with eval_batches 2 gave full_run's value bit for bit, measured: the replacement changes nothing else.)"""
    import dataclasses

    from twinshard import config

    tiny = config.preset("tiny")
    monkeypatch.setitem(config._PRESETS, "tiny", dataclasses.replace(
        tiny, train=dataclasses.replace(tiny.train, eval_batches=1)))
    run_train(tmp_path_factory, f"--workdir={tmp_path}", "--steps=12", "--stop_after=4")
    one = [r["eval_loss"] for r in metrics(tmp_path) if "eval_loss" in r]
    preset_eval = [r["eval_loss"] for r in metrics(full_run) if "eval_loss" in r][:1]
    assert tiny.train.eval_batches == 2 and len(one) == 1 and one != preset_eval, (one, preset_eval)


def test_missing_data_and_short_corpus_fail_before_writing(tmp_path, tmp_path_factory):
    workdir = tmp_path / "never"
    with pytest.raises(FileNotFoundError, match="--data"):
        run_train(tmp_path_factory, f"--workdir={workdir}", f"--data={tmp_path / 'nope.txt'}")
    short = tmp_path / "short.txt"
    short.write_text("x" * 30)
    with pytest.raises(ValueError, match="fewer than context_length"):
        run_train(tmp_path_factory, f"--workdir={workdir}", f"--data={short}")
    assert not workdir.exists()


def corrupt_copy(full_run, tmp_path_factory, damage) -> str:
    """A copy of full_run whose step-12 state files went through `damage(path)`."""
    import shutil

    workdir = tmp_path_factory.mktemp("corrupt") / "w"
    shutil.copytree(full_run, workdir)
    for path in (workdir / "checkpoints" / "12" / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            damage(path)
    return str(workdir)


# Three failed restores in one process: an Orbax read coroutine abandoned by one failure can be
# finalized by the garbage collector during the NEXT restore (measured in CI: corrupt1's
# coroutine during corrupt2's), where pytest's unraisable-exception hook reports it.
# In a launcher there is one restore per process, and twinshard/train/checkpoint.py drops what such
# finalizers print (test_corrupt_checkpoint_on_the_command_line_is_a_few_lines checks the CLI).
@pytest.mark.filterwarnings("ignore:Exception ignored in. <coroutine object _read_array_index_and_device_put"
                            ":pytest.PytestUnraisableExceptionWarning")
def test_corrupt_checkpoint_is_a_clear_error(full_run, tmp_path_factory):
    # garbage everywhere: a JSON metadata file is named; truncated array data: the array and its file
    garbage = corrupt_copy(full_run, tmp_path_factory, lambda p: p.write_bytes(b"garbage"))
    with pytest.raises(ValueError, match=r"checkpoint step 12 in .*/checkpoints/12 is corrupt: "
                                         r".*/checkpoints/12/state/\S+ is not readable JSON"):
        run_train(tmp_path_factory, f"--workdir={garbage}", "--steps=12", "--resume")
    def cut(under: str):
        return lambda p: p.write_bytes(p.read_bytes()[:100]) if p.parent.match(under) else None

    arrays = corrupt_copy(full_run, tmp_path_factory, cut("ocdbt.process_*/d"))
    with pytest.raises(ValueError, match=r"step 12 .* is corrupt: the arrays in .*/12/state do not read "
                                         r"\(ValueError: .*Error reading \"[a-z_.0-9]+/[0-9.]+\" in OCDBT"):
        run_train(tmp_path_factory, f"--workdir={arrays}", "--steps=12", "--resume")
    index = corrupt_copy(full_run, tmp_path_factory, cut("state/d"))
    with pytest.raises(ValueError, match=r"step 12 .* is corrupt: the array index in .*/12/state "
                                         r"\(manifest.ocdbt and d/\) does not read"):
        run_train(tmp_path_factory, f"--workdir={index}", "--steps=12", "--resume")


def test_a_readable_checkpoint_is_never_called_corrupt(full_run):
    """A checkpoint that reads but does not fit the target is reported as such, with no advice
    to delete it (never 'corrupt ... delete that step directory')."""
    import jax

    from twinshard.train.checkpoint import Checkpointer
    from twinshard.config import preset
    from twinshard.train.trainer import SingleDevice

    cfg = preset("tiny")
    abstract = SingleDevice(cfg.model, cfg.train).abstract_state()
    params = dict(abstract.params, extra={"weight": jax.ShapeDtypeStruct((3,), "float32")})
    with pytest.raises(ValueError, match="is readable but does not restore into this run") as err:
        Checkpointer(os.path.join(full_run, "checkpoints"), create=False).restore(
            abstract._replace(params=params), expect={})
    assert "corrupt" not in str(err.value) and "delete" not in str(err.value)


def test_a_resumed_single_device_run_runs_the_fresh_runs_program(full_run):
    """The restored state (committed on its device) lowers the same train step as a fresh init
    and as abstract_state() (measured, JAX 0.12: an uncommitted init lowered without the sdy
    shardings a committed restore gets, so every --resume compiled its step again)."""
    import jax
    import numpy as np

    from twinshard.train.checkpoint import Checkpointer
    from twinshard.config import preset
    from twinshard.train.trainer import SingleDevice

    cfg = preset("tiny")
    runner = SingleDevice(cfg.model, cfg.train)
    restored, _ = Checkpointer(os.path.join(full_run, "checkpoints"), create=False).restore(
        runner.abstract_state(), expect={})
    x = np.zeros((cfg.train.batch_size, cfg.model.context_length), np.int32)
    xs = jax.ShapeDtypeStruct(x.shape, x.dtype)
    fresh = runner.train_step.lower(runner.init_state(0), x, x).as_text()
    assert runner.train_step.lower(restored, x, x).as_text() == fresh
    assert runner.train_step.lower(runner.abstract_state(), xs, xs).as_text() == fresh


@pytest.fixture(scope="module")
def moves_run(tmp_path_factory):
    """One run of 12 steps in four legs, each resuming the previous leg's checkpoint on another
    device count and layout (Orbax reads it into the new one): fsdp/auto on 8 devices ->
    fsdp_tp/auto on 2x2 -> single device -> fsdp/manual on 8, which writes the last checkpoint.
    `--devices=4` runs on the first 4 of this test process's 8 devices. (tests/test_bench.py's
    fsdp twins on 8 devices are these legs' programs: the compilation cache shares them.)"""
    workdir = str(tmp_path_factory.mktemp("moves"))
    legs = [["--strategy=fsdp", "--impl=auto", "--stop_after=3"],
            ["--strategy=fsdp_tp", "--impl=auto", "--devices=4", "--mesh=data:2,tensor:2", "--stop_after=6"],
            ["--strategy=single", "--stop_after=9"],
            ["--strategy=fsdp", "--impl=manual"]]
    for i, leg in enumerate(legs):
        run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", *leg, *(["--resume"] if i else []))
    return workdir


def test_checkpoints_move_between_device_counts_and_strategies(full_run, moves_run):
    """8 -> 4 -> 1 -> 8 devices, auto FSDP -> auto FSDP+TP -> single -> manual FSDP: the legs'
    metrics equal the uninterrupted single-device run's. Measured: losses within 1e-6 (9.5e-7 at
    most), asserted 1e-4. (A sharded checkpoint into the replicated layout is
    test_every_strategy_checkpoint_*'s.)"""
    a, b = metrics(full_run), metrics(moves_run)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4, 6, 8, 10, 12]
    for ra, rb in zip(a, b):
        for key in ("loss", "eval_loss", "grad_norm"):
            assert (key in ra) == (key in rb)
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], abs=1e-4), (ra["step"], key)


@functools.cache
def logits_program(cfg):
    """The model's logits [1, T, V] of params and a [1, T] window, jitted once for every greedy() call of
    cfg (a fixed [1, T]: one compile, shared by the restored and the fresh params)."""
    import jax
    from flax import nnx

    from twinshard.train.trainer import graphdef

    return jax.jit(lambda p, x: nnx.merge(graphdef(cfg), p)(x)[0])


def greedy(params, cfg, prompt: str, n: int) -> str:
    """Greedy decoding written out here (prompt + n < context_length): argmax over the real
    (unpadded) vocab of the logits after the prefix."""
    import jax.numpy as jnp
    import numpy as np

    from twinshard.train.tokenizer import get_encoding

    enc = get_encoding("bytes")
    logits_of = logits_program(cfg)
    ids = enc.encode_ordinary(prompt)
    for _ in range(n):  # causal: the zeros after the prefix do not change its logits
        window = np.zeros((1, cfg.context_length), np.int32)
        window[0, :len(ids)] = ids
        logits = np.asarray(logits_of(params, jnp.asarray(window)))[len(ids) - 1]
        ids.append(int(np.argmax(logits[:cfg.vocab_size])))
    return enc.decode(ids)


def test_sample_uses_the_checkpoint_weights(moves_run):
    """launch.sample on ONE device (its own process) from a checkpoint written on 8 (fsdp/manual):
    its greedy text equals a greedy decode of the restored params, and differs from a fresh init's."""
    from twinshard.train.checkpoint import Checkpointer
    from twinshard.config import preset
    from twinshard.train.trainer import SingleDevice, create_params

    proc = run("-m", "launch.sample", f"--workdir={moves_run}", "--prompt=ROMEO:", "--max_new_tokens=12",
               "--temperature=0", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = preset("tiny")
    state, _ = Checkpointer(os.path.join(moves_run, "checkpoints"), create=False).restore(
        SingleDevice(cfg.model, cfg.train).abstract_state(), expect={})
    expected = greedy(state.params, cfg.model, "ROMEO:", 12)
    assert proc.stdout.removesuffix("\n") == expected
    assert greedy(create_params(cfg.model, cfg.train.seed), cfg.model, "ROMEO:", 12) != expected


def test_corrupt_checkpoint_on_the_command_line_is_a_few_lines(full_run, tmp_path_factory):
    """launch.sample and launch.train --resume on a checkpoint with cut array files: a short
    message naming the step and the file, no traceback or Orbax/asyncio noise (hundreds of
    lines ending in 'Event loop is closed'); the checkpoint is left as it was."""

    workdir = corrupt_copy(full_run, tmp_path_factory,
                           lambda p: p.write_bytes(p.read_bytes()[:100]) if p.parent.match("ocdbt.process_*/d") else None)
    before = {p: p.read_bytes() for p in sorted(pathlib.Path(workdir).rglob("*")) if p.is_file()}
    needles = ["checkpoint step 12 in", "/checkpoints/12 is corrupt: the arrays in",
               "/checkpoints/12/state do not read", "in OCDBT database at local file"]
    assert_user_error(run("-m", "launch.sample", f"--workdir={workdir}"), *needles)
    assert_user_error(run("-m", "launch.train", "--preset=tiny", f"--workdir={workdir}", "--steps=12", "--resume",
                          f"--cache_dir={tmp_path_factory.getbasetemp() / 'token_cache'}"), *needles)
    assert {p: p.read_bytes() for p in sorted(pathlib.Path(workdir).rglob("*")) if p.is_file()} == before


def test_orbax_noise_is_held_back_only_when_the_read_fails(capfd, monkeypatch):
    """What reaches file descriptor 2 during a checkpoint read (C++ threads, absl, the
    finalizers of Orbax's abandoned coroutines) is written out when the read works and dropped
    when it fails, garbage collection included: CI once printed a finalizer's traceback before
    the one-line message of a corrupt checkpoint."""
    import gc

    from twinshard.train.checkpoint import _stderr_held_on_failure

    class Noisy:  # an abandoned object whose finalizer writes to fd 2, like Orbax's coroutines
        def __del__(self):
            os.write(2, b"finalizer noise\n")

    monkeypatch.setenv("TWINSHARD_DEBUG", "0")
    with _stderr_held_on_failure():
        os.write(2, b"a warning of a read that works\n")
    assert capfd.readouterr().err == "a warning of a read that works\n"

    gc.disable()  # the cycle below is freed only by the collection inside the window
    try:
        with pytest.raises(ValueError, match="corrupt"):
            with _stderr_held_on_failure():
                cycle = [Noisy()]
                cycle.append(cycle)
                del cycle
                os.write(2, b"Traceback: noise of a failed read\n")
                raise ValueError("corrupt")
    finally:
        gc.enable()
    gc.collect()  # without the window's own collection, the finalizer would print here
    assert capfd.readouterr().err == ""

    monkeypatch.setenv("TWINSHARD_DEBUG", "1")  # debugging: nothing is hidden
    with pytest.raises(ValueError):
        with _stderr_held_on_failure():
            os.write(2, b"kept for debugging\n")
            raise ValueError("corrupt")
    assert capfd.readouterr().err == "kept for debugging\n"


# every dense strategy (ep and fsdp_ep: tests/test_experts.py), on its default mesh over n devices
CHECKPOINTED = (("dp", 8), ("fsdp", 8), ("tp", 4), ("fsdp_tp", 8), ("tp_sp", 4), ("fsdp_tp_sp", 8), ("cp", 4),
                ("fsdp_cp", 8), ("ulysses", 4), ("fsdp_ulysses", 8), ("pp", 2), ("pp_fsdp", 4))
# The checkpoints written: one per layout of the state. These four place it as the strategy they
# name, on the same mesh, and each manual twin as its GSPMD twin (both asserted below): with the state
# placed from the host their checkpoints would hold the same bytes, sharded alike, so each layout is
# written once, by its GSPMD twin. (The manual fsdp_tp writer went with the sharded inits: it wrote
# auto fsdp_tp's bytes in auto fsdp_tp's layout.)
SAME_LAYOUT = {"tp_sp": "tp", "fsdp_tp_sp": "fsdp_tp", "ulysses": "cp", "fsdp_ulysses": "fsdp_cp"}
WRITERS = [("auto", s) for s, _ in CHECKPOINTED if s not in SAME_LAYOUT]


@pytest.mark.dp
@pytest.mark.fsdp
@pytest.mark.tp
@pytest.mark.fsdp_tp
@pytest.mark.tp_sp
@pytest.mark.fsdp_tp_sp
@pytest.mark.cp
@pytest.mark.fsdp_cp
@pytest.mark.ulysses
@pytest.mark.fsdp_ulysses
@pytest.mark.pp
@pytest.mark.pp_fsdp
def test_every_strategy_checkpoint_restores_on_one_device(tmp_path):
    """The single-device initial state placed in each strategy's layout (tp on 4 devices: tiny has
    4 heads), saved sharded, restores into the single-device layout bit for bit. Placed from the host
    (compiles nothing), not each writer's sharded init (one cold compile each, 9 here: ~12 s of CPU,
    measured): that init is the same code for every strategy (twinshard/placed.py), held bitwise by
    test_data_tensor.py::test_initial_params_are_bitwise_single_device and test_pipeline.py.
    Measured without the fix: here, where the writer's devices exist, Orbax silently restored
    the writer's sharding (the device-set assertion fails); on 1 device it raised."""
    import jax
    import numpy as np

    from launch import common
    from twinshard.train.checkpoint import Checkpointer
    from twinshard.config import preset
    from twinshard.train.trainer import SingleDevice, abstract_state

    cfg = preset("tiny")
    pipelined = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=2))  # 2 fill 2 stages
    runners = {(impl, strategy): common.make_runner(strategy, impl, None, pipelined if strategy.startswith("pp")
                                                    else cfg, jax.devices()[:n])
               for impl in ("auto", "manual") for strategy, n in CHECKPOINTED}  # (nothing compiles)

    def layout(runner):
        return dict(runner.mesh.shape), [s.spec for s in jax.tree.leaves(runner.state_shardings)]

    for (impl, strategy), runner in runners.items():
        assert layout(runner) == layout(runners["auto", SAME_LAYOUT.get(strategy, strategy)]), (impl, strategy)
    single = SingleDevice(cfg.model, cfg.train)
    want = jax.device_get(single.init_state(cfg.train.seed))
    for impl, strategy in WRITERS:
        runner = runners[impl, strategy]  # the state in its stored layer order, on its shardings
        state = jax.device_put(runner.to_stored(want), runner.state_shardings)
        ckpt = Checkpointer(str(tmp_path / f"{impl}_{strategy}"))
        ckpt.save(0, state, {"strategy": strategy})
        # into SingleDevice's layout, and into a target without shardings (jax.eval_shape's),
        # which Checkpointer places on this process's first device
        for target in (single.abstract_state(), abstract_state(cfg.model, single.tx)):
            got, meta = ckpt.restore(target, expect={"strategy": strategy})
            assert {leaf.sharding.device_set == {jax.devices()[0]} for leaf in jax.tree.leaves(got)} == {True}
            for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(jax.device_get(got)), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{strategy}/{impl}")


# --- Which checkpoint a resume restores, and what it refuses ---------------------------------------

@pytest.fixture(scope="module")
def kept_run(tmp_path_factory):
    """6 of 12 steps with a checkpoint every 2: steps 2, 4 and 6 are kept (max_to_keep=3), so a
    resume has a choice. --steps=12: full_run's program. Logged every 3 steps, so that its records
    also show eval's own schedule (test_eval_runs_on_its_own_schedule)."""
    workdir = tmp_path_factory.mktemp("kept") / "w"
    run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", "--stop_after=6", "--checkpoint_every=2",
              "--log_every=3")
    assert train._checkpoint_steps(str(workdir / "checkpoints")) == ([2, 4, 6], [])
    return workdir


def kept_copy(kept_run, tmp_path_factory) -> pathlib.Path:
    import shutil

    workdir = tmp_path_factory.mktemp("kept_copy") / "w"
    shutil.copytree(kept_run, workdir)
    return workdir


def saved_params(step_dir: pathlib.Path):
    """The params in one checkpoint directory, read as plain NumPy by Orbax's PyTree reader
    (no CheckpointManager, so no choice of step is involved)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    reader = ocp.PyTreeCheckpointer()
    tree = reader.metadata(step_dir / "state").item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return reader.restore(step_dir / "state", args=ocp.args.PyTreeRestore(restore_args=args))["params"]


def same_params(a, b) -> bool:
    import jax
    import numpy as np

    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))


def spy_restores(monkeypatch) -> list:
    """The params of each Checkpointer.restore in this process, appended as they are restored."""
    import jax

    from twinshard.train.checkpoint import Checkpointer

    restored, original = [], Checkpointer.restore

    def spy(self, *a, **k):
        state, meta = original(self, *a, **k)
        restored.append(jax.device_get(state.params))
        return state, meta

    monkeypatch.setattr(Checkpointer, "restore", spy)
    return restored


def resume_and_capture(tmp_path_factory, monkeypatch, capsys, workdir, *args):
    """Resume in this process; returns (the params Checkpointer.restore gave the launcher, its stdout)."""
    restored = spy_restores(monkeypatch)
    capsys.readouterr()
    run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", *args)
    assert len(restored) == 1
    return restored[0], capsys.readouterr().out


def test_resume_restores_the_latest_complete_checkpoint(kept_run, tmp_path_factory, monkeypatch, capsys):
    """Of steps 2, 4, 6 the resume restores 6: the log names it and the launcher's state holds
    step 6's params as they are on disk, which differ from step 4's. With step 6 left as an
    interrupted save leaves it (Orbax renames `6.orbax-checkpoint-tmp` to `6` only when complete)
    it restores step 4 and says so in one line. That resume reads the corpus from another path:
    the same bytes, so the same corpus."""
    import gzip
    import shutil

    from twinshard.train import data

    workdir = kept_copy(kept_run, tmp_path_factory)
    ckpts = workdir / "checkpoints"
    step4, step6 = saved_params(ckpts / "4"), saved_params(ckpts / "6")
    assert not same_params(step4, step6)  # else the comparisons below could not tell them apart
    params, out = resume_and_capture(tmp_path_factory, monkeypatch, capsys, workdir, "--resume", "--stop_after=7")
    assert f"resumed from {ckpts} at step 6\n" in out and "incomplete" not in out
    assert same_params(params, step6)

    workdir = kept_copy(kept_run, tmp_path_factory)
    ckpts = workdir / "checkpoints"
    (ckpts / "6").rename(ckpts / "6.orbax-checkpoint-tmp")
    moved = workdir.parent / "corpus.txt.gz"
    shutil.copyfile(data.DEFAULT_CORPUS, moved)
    assert gzip.decompress(moved.read_bytes()) == gzip.decompress(data.DEFAULT_CORPUS.read_bytes())
    params, out = resume_and_capture(tmp_path_factory, monkeypatch, capsys, workdir, "--resume", "--stop_after=5",
                                     f"--data={moved}")
    notes = [line for line in out.splitlines() if "incomplete" in line]
    assert notes == [f"checkpoint step 6 in {ckpts} is incomplete (its save was interrupted); resuming from "
                     "step 4, the latest complete one."], out
    assert f"resumed from {ckpts} at step 4\n" in out
    assert same_params(params, step4)


def test_sample_restores_the_latest_complete_checkpoint(kept_run, tmp_path_factory, monkeypatch):
    """Of steps 2, 4, 6 launch.sample restores 6's params as they are on disk; with 6 left as an
    interrupted save leaves it, 4's."""
    from launch import sample

    restored = spy_restores(monkeypatch)
    workdir = kept_copy(kept_run, tmp_path_factory)
    ckpts = workdir / "checkpoints"
    for latest, older in ((6, 4), (4, 2)):
        assert not same_params(saved_params(ckpts / str(latest)), saved_params(ckpts / str(older)))
        FLAGS.unparse_flags()
        FLAGS(["sample", f"--workdir={workdir}", "--max_new_tokens=1", "--temperature=0"])
        sample.main([])
        assert same_params(restored.pop(), saved_params(ckpts / str(latest))), latest
        (ckpts / str(latest)).rename(ckpts / f"{latest}.orbax-checkpoint-tmp")


@contextlib.contextmanager
def jax_traces():
    """The jax.monitoring compile events (trace, lower, backend compile) heard inside the block."""
    import jax

    heard = []

    def listener(event, duration, **_):
        if event.startswith("/jax/core/compile/"):
            heard.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield heard
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def files_of(workdir: pathlib.Path) -> dict:
    return {p: p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}


def test_resume_step_names_the_checkpoint(kept_run, tmp_path_factory, monkeypatch, capsys):
    """--resume_step=4 restores step 4 (not the latest, 6) and the run continues from it: its
    first checkpoint (5) replaces 6, the abandoned continuation, so the latest is this run's.
    A step with no checkpoint is a one-line error naming the value and the steps there, raised
    before anything is traced or compiled and before anything is written."""
    workdir = kept_copy(kept_run, tmp_path_factory)
    ckpts = workdir / "checkpoints"
    step4 = saved_params(ckpts / "4")
    before = files_of(workdir)
    for step in (5, 0):
        with jax_traces() as heard, pytest.raises(ValueError) as err:
            run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", f"--resume_step={step}")
        assert str(err.value) == (f"--resume_step={step}: no complete checkpoint of step {step} in {str(ckpts)!r}; "
                                  "the steps there are [2, 4, 6]: pass one of them, or drop --resume_step for the "
                                  "latest.")
        assert heard == [] and files_of(workdir) == before
    with jax_traces() as heard:
        params, out = resume_and_capture(tmp_path_factory, monkeypatch, capsys, workdir, "--resume_step=4",
                                         "--stop_after=5", "--log_every=1")
    assert heard  # the listener hears a run that compiles (else `heard == []` above proves nothing)
    assert f"resumed from {ckpts} at step 4\n" in out
    assert same_params(params, step4)
    assert train._checkpoint_steps(str(ckpts)) == ([2, 4, 5], [])
    assert [r["step"] for r in metrics(workdir)] == [3, 4, 5]
    # TensorBoard too drops the abandoned run's step 6 (the resumed run's event file marks step 5 a restart)
    assert board(workdir) == board_of(metrics(workdir))


def test_resume_refuses_another_corpus_or_tokenizer(kept_run, tmp_path_factory):
    """A resume that reads another corpus (other bytes) or tokenizes with another tokenizer (a
    ranks file of the same 256 bytes in another order: the same vocab size, so the model config
    alone would not tell) is a one-line error naming both and the fix, before anything is traced
    or compiled and without touching the checkpoints."""
    from twinshard.train import data, tokenizer

    workdir = pathlib.Path(kept_run)
    other = workdir.parent / "other.txt"
    other.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200)))
    ranks = workdir.parent / "reversed.tiktoken"
    tokenizer.save_ranks({bytes([b]): 255 - b for b in range(256)}, ranks)
    before = files_of(workdir)
    corpus = (f"--resume with another corpus: checkpoint step 6 was trained on the default corpus (sha256 "
              f"{data.fingerprint(data.DEFAULT_CORPUS)}), this run reads {other} (sha256 {data.fingerprint(other)}); "
              "pass no --data (the default corpus), or start a new --workdir to train on this one.")
    tokens = (f"--resume with another tokenizer: checkpoint step 6 was trained with --tokenizer=bytes, this run uses "
              f"--tokenizer={ranks} ({tokenizer.fingerprint(str(ranks))}); pass --tokenizer=bytes, or start a new "
              "--workdir to train with this one.")
    for extra, message in (([f"--data={other}"], corpus), ([f"--tokenizer={ranks}"], tokens)):
        with jax_traces() as heard, pytest.raises(ValueError) as err:
            run_train(tmp_path_factory, f"--workdir={workdir}", "--steps=12", "--resume", *extra)
        assert str(err.value) == message
        assert heard == [] and files_of(workdir) == before
