"""Train the LM: `python -m launch.train --preset=small --steps=300 --workdir=runs/small`.

Every flag is validated, and the corpus is found and tokenized, before anything
is compiled or written. Each log line gives step, loss, lr, tokens/s, step time,
model TFLOP/s per device and MFU (`Utilization`), the compiled step's peak memory (and the runtime's
peak on a GPU, whose allocator holds the step's temporaries; `Utilization`), and ETA; every
`--eval_every` steps a held-out loss; every record also goes to `<workdir>/metrics.jsonl` and, as
TensorBoard scalars, to `<workdir>/events.out.tfevents.*` (twinshard/train/tensorboard.py).
`--profile_steps=START:COUNT` traces those steps with jax.profiler into
`<workdir>/plugins/profile/<run>/`, so `tensorboard --logdir=<workdir>` shows the curves and the
traces together. SIGTERM or SIGINT (a preemption) finishes the step in
flight, checkpoints it and exits with 128 + the signal's number (`Preemption`). `--resume` continues from the latest complete checkpoint
in `--workdir` (`--resume_step=N`: from step N) and reproduces the uninterrupted run
exactly: batches are a pure function of (seed, step), and the whole train state is
checkpointed. A resume with another corpus, tokenizer or training settings than the
checkpoint's run is refused before anything compiles; each checkpoint records the
corpus's and the tokenizer's content hashes for that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import time

from absl import flags, logging

from launch import common, distributed, fit

common.define(flags.DEFINE_string, "workdir", "runs/default", "Output directory: metrics.jsonl and checkpoints/.")
flags.DEFINE_integer("log_every", None, "Log every N steps (default: the preset's).")
flags.DEFINE_integer("eval_every", None, "Held-out eval every N steps (0: never; default: the preset's).")
flags.DEFINE_integer("checkpoint_every", None, "Checkpoint every N steps (0: only at the end).")
flags.DEFINE_integer("keep", 3, "Checkpoints kept: the latest N (older ones are deleted as new ones complete).")
flags.DEFINE_bool("resume", False, "Resume from the latest complete checkpoint in --workdir.")
flags.DEFINE_integer("resume_step", None, "Resume from the checkpoint of this step in --workdir (implies "
                     "--resume); the later ones are replaced when this run writes its first checkpoint.")
flags.DEFINE_integer("stop_after", None, "Stop (with a checkpoint) after this step, as a preemption "
                     "would; the schedule still runs to --steps, so --resume continues it exactly.")
flags.DEFINE_string("profile_steps", None, "START:COUNT: a jax.profiler trace of steps START..START+COUNT-1 "
                    "(1-based; skip step 1, it compiles) in <workdir>/plugins/profile/, for TensorBoard and Perfetto.")
common.define_model_flags()
common.define_data_flags()
distributed.define_flags()
FLAGS = flags.FLAGS


# Settings a resumed run may change: how often it reports, not what it computes.
_REPORTING = ("log_every", "eval_every", "eval_batches", "checkpoint_every")
# Orbax saves step N into `N.orbax-checkpoint-tmp...` and renames it to `N` when complete.
_INCOMPLETE = re.compile(r"(\d+)\.orbax-checkpoint-tmp.*")


def _intervals(cfg) -> tuple[int, int, int]:
    """(log_every, eval_every, checkpoint_every), validated; 0 disables eval / periodic checkpoints."""
    t = cfg.train
    pick = lambda flag, default: default if flag is None else flag  # noqa: E731
    log_every, eval_every, ckpt_every = (pick(FLAGS.log_every, t.log_every), pick(FLAGS.eval_every, t.eval_every),
                                         pick(FLAGS.checkpoint_every, t.checkpoint_every))
    if log_every < 1:
        raise ValueError(f"--log_every={log_every} must be >= 1.")
    for name, value in (("eval_every", eval_every), ("checkpoint_every", ckpt_every)):
        if value < 0:
            raise ValueError(f"--{name}={value} must be >= 0 (0 turns it off).")
    return log_every, eval_every, ckpt_every


def _checkpoint_steps(ckpt_dir: str) -> tuple[list[int], list[int]]:
    """(complete, incomplete) checkpoint steps in `ckpt_dir`, ascending, read from its names."""
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    complete = sorted(int(n) for n in names if n.isdigit())
    incomplete = sorted(int(m.group(1)) for n in names if (m := _INCOMPLETE.fullmatch(n)))
    return complete, incomplete


def _check_flags(cfg) -> tuple[str, int | None, str | None]:
    """Everything that can be checked before touching devices or disk: (checkpoint dir, the
    step to resume from or None for a new run, a line on skipped incomplete checkpoints)."""
    common.check_writable_dir(FLAGS.workdir, "workdir")
    common.check_writable_dir(FLAGS.cache_dir, "cache_dir")
    if FLAGS.keep < 1:
        raise ValueError(f"--keep={FLAGS.keep} must be >= 1 (the checkpoint a --resume continues from).")
    profile_steps(cfg.train.steps)  # validated here, before anything is written
    if FLAGS.stop_after is not None and not 0 < FLAGS.stop_after < cfg.train.steps:
        raise ValueError(f"--stop_after={FLAGS.stop_after} must be between 1 and steps-1 = "
                         f"{cfg.train.steps - 1}; drop it to train to the end.")
    ckpt_dir = os.path.join(FLAGS.workdir, "checkpoints")
    complete, incomplete = _checkpoint_steps(ckpt_dir)
    resume = FLAGS.resume or FLAGS.resume_step is not None
    if resume and not complete:
        raise ValueError(f"--resume: no checkpoint in {ckpt_dir!r}; pass the --workdir of an earlier "
                         "run, or drop --resume to start a new one.")
    if not resume and complete:
        raise ValueError(f"{FLAGS.workdir} already holds checkpoints; pass --resume to continue, "
                         "or a new --workdir.")
    if not resume:
        return ckpt_dir, None, None
    step, note = FLAGS.resume_step, None
    if step is not None and step not in complete:
        why = " (its save was interrupted)" if step in incomplete else ""
        raise ValueError(f"--resume_step={step}: no complete checkpoint of step {step} in {ckpt_dir!r}{why}; "
                         f"the steps there are {complete}: pass one of them, or drop --resume_step for the latest.")
    if step is None:
        step = complete[-1]
        if newer := [s for s in incomplete if s > step]:
            note = (f"checkpoint step {newer[-1]} in {ckpt_dir} is incomplete (its save was interrupted); "
                    f"resuming from step {step}, the latest complete one.")
    if FLAGS.stop_after is not None and FLAGS.stop_after <= step:
        raise ValueError(f"--stop_after={FLAGS.stop_after} is not after the resumed step {step}.")
    return ckpt_dir, step, note


def profile_steps(steps: int) -> range | None:
    """The 1-based steps --profile_steps=START:COUNT traces, validated against --steps."""
    if FLAGS.profile_steps is None:
        return None
    m = re.fullmatch(r"(\d+):(\d+)", FLAGS.profile_steps)
    start, count = (int(m[1]), int(m[2])) if m else (0, 0)
    if not m or start < 1 or count < 1 or start + count - 1 > steps:
        raise ValueError(f"--profile_steps={FLAGS.profile_steps} must be START:COUNT with 1 <= START and "
                         f"START + COUNT - 1 <= --steps={steps} (e.g. --profile_steps=3:2: steps 3 and 4; step 1 "
                         "compiles).")
    return range(start, start + count)


class Preemption:
    """SIGTERM (what SLURM and a preempted TPU VM send before the kill) and SIGINT, caught: the
    step in flight finishes, the loop checkpoints it and exits with 128 + the signal's number.
    A signal during a checkpoint write only sets the flag, so the write completes. Every process
    of a multi-host run stops at the same step: `stop()` asks all of them (an all-gather of one
    flag per process), so none waits forever in a collective its peers left."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self) -> Preemption:
        # caught: what this process's handler saw; signum: the signal every process stops for
        self.caught = self.signum = None
        self.previous = {s: signal.signal(s, self._caught) for s in self.SIGNALS}
        return self

    def _caught(self, signum, _frame) -> None:
        self.caught = signum

    def stop(self) -> bool:
        import jax

        if jax.process_count() == 1:
            self.signum = self.caught
            return self.signum is not None
        import numpy as np
        from jax.experimental import multihost_utils

        sent = self.caught  # read once: the handler may run during the exchange (its value goes next step)
        try:
            everyone = multihost_utils.process_allgather(np.array([-1 if sent is None else sent]))
        except jax.errors.JaxRuntimeError:
            # A peer left mid-exchange (gloo: "Connection reset by peer"). The coordination service
            # aborts this process with its one line (launch/distributed.py) once the peer's
            # heartbeats stop: wait for that verdict instead of printing this traceback.
            time.sleep(3 * FLAGS.heartbeat_timeout + 10)
            raise
        # Decided from the gathered values alone, so every process decides the same. Measured: a
        # SIGTERM handled between the exchange and this decision made one process save (and wait
        # in Orbax's barrier) while its peer trained on: both hung.
        hits = everyone[everyone >= 0]
        self.signum = int(hits[0]) if hits.size else None
        return self.signum is not None

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _check_same_run(saved: dict, meta: dict, step: int, where: str) -> None:
    """A resume must see the checkpoint's model, corpus, tokenizer and training settings: a ValueError
    naming both values and the fix otherwise. Metadata only: nothing is read or compiled."""
    from twinshard.train.checkpoint import CheckpointError, model_difference

    if diff := model_difference(saved.get("model"), meta["model"]):
        fix = " ".join(f"--{k}={was}" for k, (was, _) in diff.items() if k in common.MODEL_FLAGS and was is not None)
        raise CheckpointError(f"--resume: checkpoint {where} holds another model ((checkpoint, now) = {diff}), whose "
                              f"arrays do not restore into this run's; pass {fix or 'the --preset that wrote it'}, "
                              "or use a new --workdir for this model.")
    key = "corpus" if "corpus" in saved else "data"  # checkpoints without content hashes: the paths
    if saved.get(key) != meta[key]:
        was, now = (m["data"] if m["data"] != "default" else "the default corpus" for m in (saved, meta))
        fix = f"--data={saved['data']}" if saved["data"] != "default" else "no --data (the default corpus)"
        raise ValueError(f"--resume with another corpus: checkpoint step {step} was trained on {was} (sha256 "
                         f"{saved.get('corpus')}), this run reads {now} (sha256 {meta['corpus']}); pass {fix}, "
                         "or start a new --workdir to train on this one.")
    was, now = saved["train"]["tokenizer"], meta["train"]["tokenizer"]
    if (saved["tokenizer"] != meta["tokenizer"]) if "tokenizer" in saved else was != now:
        named = lambda name, ident: name if ident in (None, name) else f"{name} ({ident})"  # noqa: E731
        was_named, now_named = named(was, saved.get("tokenizer")), named(now, meta["tokenizer"])
        raise ValueError(f"--resume with another tokenizer: checkpoint step {step} was trained with --tokenizer="
                         f"{was_named}, this run uses --tokenizer={now_named}; pass --tokenizer={was}, or start a "
                         "new --workdir to train with this one.")
    # the tokenizer was compared by content above, not by the name or path in the train config
    saved_run = {k: v for k, v in saved["train"].items() if k not in (*_REPORTING, "tokenizer")}
    same_run = {k: v for k, v in meta["train"].items() if k not in (*_REPORTING, "tokenizer")}
    if saved_run != same_run:
        diff = {k: (saved_run.get(k), v) for k, v in same_run.items() if saved_run.get(k) != v}
        raise ValueError(f"--resume with different training settings ((checkpoint, now) = {diff}): "
                         "an exact continuation needs the same ones; use a new --workdir to change them.")


class Utilization:
    """Model FLOP/s per device and MFU of a step time, and the device's peak memory.

    FLOPs: the cost model's per step in MFU's convention (twinshard/cost/flops.py `model_total`: 6 x
    the matmul parameters x tokens plus attention's QK^T and AV, causal attention counted half:
    flash and splash kernels skip the masked half; MaxText's convention since mid-2025). The peak: the chip
    table's (twinshard/hardware/chips.py) for the run's dtype x the devices; on a CPU, a float32
    matmul measured at start-up, for the whole machine (simulated devices share its cores)."""

    def __init__(self, cfg, n_devices: int):
        import jax

        from twinshard import cost
        from twinshard.hardware import chips, measure

        self.flops = cost.flops(cfg.model, cfg.train.batch_size, cfg.model.context_length).model_total
        self.n_devices, self.device = n_devices, jax.local_devices()[0]
        chip = chips.chip_for(self.device.device_kind)
        if chip is not None:
            per_chip, which = chips.matmul_peak_flops(chip, cfg.model.dtype)
            self.peak, self.what = per_chip * n_devices, f"{chip.name} {which} peak x {n_devices}"
        elif self.device.platform == "cpu":
            self.peak = measure.matmul_peak("float32", 1024, 5, self.device)["flops_per_s"]
            self.what = "this CPU's measured float32 matmul rate (shared by the simulated devices)"
        else:
            self.peak, self.what = None, f"no peak known for {self.device.device_kind}"
        self.program_bytes = None  # the compiled step's peak (fit.compiled_bytes), where it was compiled ahead
        # The runtime's peak_bytes_in_use, only where it counts the step's temporaries: a GPU's allocator
        # serves them. A TPU's does not: on a v5e (jax 0.10.2) it read 1.84 GiB for gpt2_125m and 4.30 GiB
        # for llama_v5e, each the train state's arguments alone, beside compiled peaks of 8-11 GiB (measured).
        self.runtime_peak = self.device.platform == "gpu"
    def record(self, step_time: float) -> dict[str, float]:
        rec = {"tflops_per_device": self.flops / self.n_devices / step_time / 1e12}
        if self.peak:
            rec["mfu"], rec["peak_flops"] = self.flops / step_time / self.peak, self.peak
        if self.program_bytes is not None:
            rec["program_memory_bytes"] = self.program_bytes
        stats = self.device.memory_stats() if self.runtime_peak else None  # None on CPU
        if stats and "peak_bytes_in_use" in stats:
            rec["peak_memory_bytes"] = int(stats["peak_bytes_in_use"])
        return rec

    @staticmethod
    def text(rec: dict) -> str:
        out = f" | {rec['tflops_per_device']:.3g} TFLOP/s/dev"
        out += f" | MFU {100 * rec['mfu']:.1f}% (causal attention counted half)" if "mfu" in rec else ""
        if "program_memory_bytes" in rec:
            out += f" | compiled step {rec['program_memory_bytes'] / 2**30:.2f} GiB"
        return out + (f" | runtime peak_bytes_in_use {rec['peak_memory_bytes'] / 2**30:.2f} GiB"
                      if "peak_memory_bytes" in rec else "")


def _scalar(x) -> float:
    """A replicated scalar as a Python number; on a pod, from this host's own copy."""
    return float(x.addressable_data(0))


def _write_metrics(path: str, records: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)


def _record(line: str) -> dict:
    record = json.loads(line)  # JSONDecodeError is a ValueError
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError("no integer 'step'")
    return record


def _previous_metrics(path: str) -> list[dict]:
    """Every record of the earlier run, read before anything is written (a resumed run keeps
    those up to its checkpoint's step and recomputes the later ones)."""
    if not os.path.exists(path):
        return []
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                try:
                    records.append(_record(line))
                except ValueError as e:
                    raise ValueError(
                        f"--resume: {path} line {number} is not a metrics record ({str(e)[:80]}): the "
                        "file was cut short or edited. Fix or remove that line, then resume again (the "
                        "checkpoints are untouched).") from None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else f"not UTF-8 text: {e.reason}"
        raise ValueError(f"--resume: cannot read {path} ({why}); fix it, then resume again.") from None
    return records


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file rename at INFO
    common.default_platform()
    cfg = common.config_from_flags(FLAGS)
    log_every, eval_every, ckpt_every = _intervals(cfg)
    ckpt_dir, resume_from, skipped = _check_flags(cfg)
    resume = resume_from is not None
    metrics_path = os.path.join(FLAGS.workdir, "metrics.jsonl")
    earlier = _previous_metrics(metrics_path) if resume else []
    train_tokens, val_tokens = common.load_splits(cfg, FLAGS.data, FLAGS.cache_dir)  # no jax yet
    from twinshard.train import data, tokenizer

    identity = {"data": str(FLAGS.data or "default"),
                "corpus": data.fingerprint(FLAGS.data or data.DEFAULT_CORPUS, FLAGS.data_dtype),
                "tokenizer": tokenizer.fingerprint(cfg.train.tokenizer)}
    parallel = FLAGS.strategy in common.PARALLEL  # single (strategies.SINGLE) runs on one device
    if parallel:
        common.simulate_cpu_devices(FLAGS.devices)  # per process
    distributed.join_if_asked(FLAGS)
    devices = common.run_devices(FLAGS.devices, FLAGS["devices"].present) if parallel else None
    import jax

    # on a TPU, the fast path's choices (logged): before the run resolves, so every check sees them
    cfg = common.fast_path(cfg, FLAGS, FLAGS.strategy, print if jax.process_index() == 0 else lambda *a: None)
    run = common.resolve_run(FLAGS.strategy, FLAGS.impl, FLAGS.mesh, cfg, devices,  # every check, once
                            dcn_spec=FLAGS.dcn_mesh)
    fit.check_model(run)  # before anything compiles

    from twinshard.train.checkpoint import Checkpointer

    t, m = cfg.train, cfg.model
    meta = {"model": dataclasses.asdict(m), "train": dataclasses.asdict(t), **identity,
            "strategy": FLAGS.strategy, "impl": FLAGS.impl}
    # a Checkpointer makes its directory: before compiling only on a resume, whose directory exists
    ckpt = Checkpointer(ckpt_dir, keep=FLAGS.keep) if resume else None
    if resume:  # the strategy, mesh and slice count may change (Orbax reshards); the model, data and optimisation may not
        _check_same_run(ckpt.read_meta(resume_from), meta, resume_from, ckpt.step_dir(resume_from))
    runner = common.runner_of(run)
    compiled = fit.check_step(runner, run)  # compiled, its memory_analysis checked, before any write
    ckpt = ckpt or Checkpointer(ckpt_dir, keep=FLAGS.keep)

    import numpy as np

    from twinshard.train.trainer import router_summary

    main_process = jax.process_index() == 0  # every host runs this loop; one reports
    log = print if main_process else (lambda *a, **k: None)  # noqa: E731
    stale = []  # checkpoints after the resumed step: deleted before this run's first save

    if resume:
        # into this run's shardings (runner.abstract_state: its mesh, across however many slices);
        # a checkpoint keeps the layers in model order (an interleaved pipeline's state stores them round-robin)
        state, _ = ckpt.restore(runner.abstract_state(), {"model": meta["model"]}, step=resume_from)
        placed = jax.tree.map(lambda a: a.sharding, state)  # the runner's layout, as restored
        state = jax.device_put(runner.to_stored(state), placed)
        start = int(_scalar(state.step))
        records = [r for r in earlier if r["step"] <= start]
        if skipped:
            log(skipped)
        log(f"resumed from {ckpt.directory} at step {start}")
        stale = [s for s in ckpt.steps() if s > start]
        if stale:
            log(f"checkpoint steps {stale} continue another run from step {start}: they are replaced when "
                "this one writes its first checkpoint.")
    else:
        state, start, records = runner.init_state(t.seed), 0, []

    label = f"{run.strategy}/{run.twin}" if run.mesh else run.strategy
    n_devices = math.prod(run.mesh.values())  # the resolved mesh: 1 for single
    log(f"{label} preset={FLAGS.preset} params={m.num_params():,} "
        f"devices={n_devices} batch={t.batch_size}x{m.context_length} steps={t.steps}")
    if run.dcn:
        from twinshard.parallel import mesh as mesh_lib

        log(mesh_lib.slices_line(run.mesh, run.dcn, runner.mesh.devices.flat))
    utilization = Utilization(cfg, n_devices)
    log(f"MFU against {utilization.what}")
    log(common.attention_line(cfg, FLAGS.strategy))
    if compiled is not None and (program := fit.compiled_bytes(compiled)) is not None:
        utilization.program_bytes = program["peak"]
        log(f"compiled step: {program['peak'] / 2**30:.2f} GiB per device by XLA's memory_analysis (every "
            f"allocation of the program: arguments {program['arguments'] / 2**30:.2f} GiB and its temporaries)")
    # jax.profiler.start_trace(DIR) writes DIR/plugins/profile/<run>/, where TensorBoard's profile plugin
    # looks: the workdir itself, so one `tensorboard --logdir` shows the traces beside the scalars
    profiled, profile_dir = profile_steps(t.steps), FLAGS.workdir
    from twinshard.train import tensorboard

    board = tensorboard.Scalars(FLAGS.workdir, start) if main_process else contextlib.nullcontext()

    def eval_loss(params):
        losses = [runner.eval_loss(params, *runner.place_batch(
            *data.get_batch(val_tokens, t.batch_size, m.context_length, t.seed + 1, i)))
            for i in range(t.eval_batches)]
        return float(np.mean([_scalar(l) for l in losses]))

    tick, tick_step, done = time.perf_counter(), start, start
    with Preemption() as preemption, board:
        for step in range(start, t.steps):
            if profiled is not None and step + 1 == profiled.start:
                jax.profiler.start_trace(profile_dir, create_perfetto_trace=True)
            x, y = data.get_batch(train_tokens, t.batch_size, m.context_length, t.seed, step)
            state, metrics = runner.train_step(state, *runner.place_batch(x, y))
            done = step + 1
            if profiled is not None and done == profiled[-1]:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                log(f"profile of steps {profiled.start}-{done} in {profile_dir}/plugins/profile: TensorBoard "
                    f"(tensorboard --logdir={profile_dir}, with tensorboard-plugin-profile: the Profile tab beside "
                    "the scalars) or Perfetto (ui.perfetto.dev: its perfetto_trace.json.gz)", flush=True)
            if step == start:  # the first step compiles: keep it out of the throughput
                jax.block_until_ready(state)
                compile_s = time.perf_counter() - tick
                log(f"first step (compile + run): {compile_s:.1f}s", flush=True)
                tick, tick_step = time.perf_counter(), done
            last = done == t.steps
            do_log, do_eval = done % log_every == 0 or last, eval_every and (done % eval_every == 0 or last)
            if do_log or do_eval:
                jax.block_until_ready(metrics)  # dispatch is async: time finished steps, not queued ones
                now = time.perf_counter()
                step_time = (now - tick) / (done - tick_step) if done > tick_step else compile_s
                rec = {"step": done, **{k: _scalar(v) for k, v in metrics.items()}, "step_time": step_time,
                       "tokens_per_s": t.batch_size * m.context_length / step_time, **utilization.record(step_time)}
                if do_eval:
                    rec["eval_loss"] = eval_loss(state.params)
                if m.num_experts:  # the router on this step's batch, under the updated params
                    rec.update(router_summary(jax.device_get(runner.router_stats(state.params,
                                                                                 *runner.place_batch(x, y))[1])))
                records.append(rec)
                if main_process:
                    _write_metrics(metrics_path, records)
                    board.add(rec)
                log(f"step {done:6d} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                    f"{rec['tokens_per_s']:9.0f} tok/s | {1e3 * step_time:7.1f} ms/step{utilization.text(rec)} | "
                    f"ETA {(t.steps - done) * step_time:6.0f}s"
                    + (f" | eval {rec['eval_loss']:.4f}" if do_eval else "")
                    + (f" | router aux {rec['router_aux']:.3f} dropped {100 * rec['dropped_fraction']:.1f}%"
                       if m.num_experts else ""), flush=True)
            stop = last or done == FLAGS.stop_after or preemption.stop()
            if (ckpt_every and done % ckpt_every == 0) or stop:
                for old in stale:
                    ckpt.delete(old)
                stale = []
                saving = time.perf_counter()
                ckpt.save(done, runner.to_model(state), meta, wait=stop)  # asynchronous, but for the run's last one
                log(f"checkpoint {done}: the step waited {time.perf_counter() - saving:.3f}s"
                    + ("" if stop else " (written in the background)"), flush=True)
            if do_log or do_eval:  # eval and checkpoint time stay out of the throughput
                tick, tick_step = time.perf_counter(), done
            if stop:
                break
    if preemption.signum is not None and done < t.steps:
        log(f"stopped by {signal.Signals(preemption.signum).name} after step {done}: checkpoint {done} is in "
            f"{ckpt.directory}; --resume continues the run exactly.", flush=True)
        raise SystemExit(128 + preemption.signum)
    log(f"done: step {done} of {t.steps}; metrics in {metrics_path}; checkpoints in {ckpt.directory}")

if __name__ == "__main__":
    common.run(main, "launch.train")
