"""Train the LM: `python -m launch.train --preset=small --steps=300 --workdir=runs/small`.

Every flag is validated, and the corpus is found and tokenized, before anything
is compiled or written. Each log line gives step, loss, lr, tokens/s, step time
and ETA; every `--eval_every` steps a held-out loss; every record also goes to
`<workdir>/metrics.jsonl`. `--resume` continues from the latest checkpoint in
`--workdir` and reproduces the uninterrupted run exactly: batches are a pure
function of (seed, step), and the whole train state is checkpointed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import flags, logging

from launch import common

common.define(flags.DEFINE_string, "workdir", "runs/default", "Output directory: metrics.jsonl and checkpoints/.")
flags.DEFINE_integer("log_every", None, "Log every N steps (default: the preset's).")
flags.DEFINE_integer("eval_every", None, "Held-out eval every N steps (0: never; default: the preset's).")
flags.DEFINE_integer("checkpoint_every", None, "Checkpoint every N steps (0: only at the end).")
flags.DEFINE_bool("resume", False, "Resume from the latest checkpoint in --workdir.")
flags.DEFINE_integer("stop_after", None, "Stop (with a checkpoint) after this step, as a preemption "
                     "would; the schedule still runs to --steps, so --resume continues it exactly.")
common.define_model_flags()
common.define_data_flags()
common.define_distributed_flags()
FLAGS = flags.FLAGS


# Settings a resumed run may change: how often it reports, not what it computes.
_REPORTING = ("log_every", "eval_every", "eval_batches", "checkpoint_every")


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


def _check_flags(cfg) -> str:
    """Everything that can be checked before touching devices or disk; returns the checkpoint dir."""
    common.check_writable_dir(FLAGS.workdir, "workdir")
    common.check_writable_dir(FLAGS.cache_dir, "cache_dir")
    if FLAGS.stop_after is not None and not 0 < FLAGS.stop_after < cfg.train.steps:
        raise ValueError(f"--stop_after={FLAGS.stop_after} must be between 1 and steps-1 = "
                         f"{cfg.train.steps - 1}; drop it to train to the end.")
    ckpt_dir = os.path.join(FLAGS.workdir, "checkpoints")
    has_ckpt = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    if FLAGS.resume and not has_ckpt:
        raise ValueError(f"--resume: no checkpoint in {ckpt_dir!r}; pass the --workdir of an earlier "
                         "run, or drop --resume to start a new one.")
    if not FLAGS.resume and has_ckpt:
        raise ValueError(f"{FLAGS.workdir} already holds checkpoints; pass --resume to continue, "
                         "or a new --workdir.")
    return ckpt_dir


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
    ckpt_dir = _check_flags(cfg)
    metrics_path = os.path.join(FLAGS.workdir, "metrics.jsonl")
    earlier = _previous_metrics(metrics_path) if FLAGS.resume else []
    train_tokens, val_tokens = common.load_splits(cfg, FLAGS.data, FLAGS.cache_dir)  # no jax yet
    if FLAGS.strategy != "single":
        common.simulate_cpu_devices(FLAGS.devices)  # per process
    common.init_distributed(FLAGS)
    devices = common.run_devices(FLAGS.devices, FLAGS["devices"].present) if FLAGS.strategy != "single" else None
    runner = common.make_runner(FLAGS.strategy, FLAGS.impl, FLAGS.mesh, cfg, devices)  # validates the mesh

    import jax
    import numpy as np

    from twinshard import data
    from twinshard.checkpoint import Checkpointer

    main_process = jax.process_index() == 0  # every host runs this loop; one reports
    log = print if main_process else (lambda *a, **k: None)  # noqa: E731
    t, m = cfg.train, cfg.model
    meta = {"model": dataclasses.asdict(m), "train": dataclasses.asdict(t),
            "data": str(FLAGS.data or "default"), "strategy": FLAGS.strategy, "impl": FLAGS.impl}
    ckpt = Checkpointer(ckpt_dir)

    if FLAGS.resume:
        same_run = {k: v for k, v in meta["train"].items() if k not in _REPORTING}
        state, saved = ckpt.restore(runner.abstract_state(), {"model": meta["model"], "data": meta["data"]})
        # the strategy may change (Orbax reshards); the optimisation may not
        saved_run = {k: v for k, v in saved["train"].items() if k not in _REPORTING}
        if saved_run != same_run:
            diff = {k: (saved_run.get(k), v) for k, v in same_run.items() if saved_run.get(k) != v}
            raise ValueError(f"--resume with different training settings ((checkpoint, now) = {diff}): "
                             "an exact continuation needs the same ones; use a new --workdir to change them.")
        start = int(_scalar(state.step))
        if FLAGS.stop_after is not None and FLAGS.stop_after <= start:
            raise ValueError(f"--stop_after={FLAGS.stop_after} is not after the resumed step {start}.")
        records = [r for r in earlier if r["step"] <= start]
        log(f"resumed from {ckpt.directory} at step {start}")
    else:
        state, start, records = runner.init_state(t.seed), 0, []

    label = FLAGS.strategy if FLAGS.strategy == "single" else f"{FLAGS.strategy}/{FLAGS.impl}"
    log(f"{label} preset={FLAGS.preset} params={m.num_params():,} "
        f"devices={jax.device_count() if devices is None else len(devices)} batch={t.batch_size}x{m.context_length} steps={t.steps}")

    def eval_loss(params):
        losses = [runner.eval_loss(params, *runner.place_batch(
            *data.get_batch(val_tokens, t.batch_size, m.context_length, t.seed + 1, i)))
            for i in range(t.eval_batches)]
        return float(np.mean([_scalar(l) for l in losses]))

    tick, tick_step, done = time.perf_counter(), start, start
    for step in range(start, t.steps):
        x, y = data.get_batch(train_tokens, t.batch_size, m.context_length, t.seed, step)
        state, metrics = runner.train_step(state, *runner.place_batch(x, y))
        done = step + 1
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
                   "tokens_per_s": t.batch_size * m.context_length / step_time}
            if do_eval:
                rec["eval_loss"] = eval_loss(state.params)
            records.append(rec)
            if main_process:
                _write_metrics(metrics_path, records)
            log(f"step {done:6d} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                f"{rec['tokens_per_s']:9.0f} tok/s | {1e3 * step_time:7.1f} ms/step | "
                f"ETA {(t.steps - done) * step_time:6.0f}s"
                + (f" | eval {rec['eval_loss']:.4f}" if do_eval else ""), flush=True)
        stop = last or done == FLAGS.stop_after
        if (ckpt_every and done % ckpt_every == 0) or stop:
            ckpt.save(done, state, meta)
        if do_log or do_eval:  # eval and checkpoint time stay out of the throughput
            tick, tick_step = time.perf_counter(), done
        if stop:
            break
    log(f"done: step {done} of {t.steps}; metrics in {metrics_path}; checkpoints in {ckpt.directory}")


if __name__ == "__main__":
    common.run(main, "launch.train")
