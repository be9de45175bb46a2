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

from absl import app, flags, logging

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
FLAGS = flags.FLAGS


def _intervals(cfg):
    t = cfg.train
    pick = lambda flag, default: default if flag is None else flag  # noqa: E731
    return (max(1, pick(FLAGS.log_every, t.log_every)), pick(FLAGS.eval_every, t.eval_every),
            pick(FLAGS.checkpoint_every, t.checkpoint_every))


def _write_metrics(path: str, records: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)


def _previous_metrics(path: str, upto_step: int) -> list[dict]:
    """Records of an earlier run up to the resumed step (later ones are recomputed)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["step"] <= upto_step]


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file rename at INFO
    common.default_platform()
    cfg = common.config_from_flags(FLAGS)
    log_every, eval_every, ckpt_every = _intervals(cfg)
    if FLAGS.strategy != "single":
        common.simulate_cpu_devices(FLAGS.devices)
    train_tokens, val_tokens = common.load_splits(cfg, FLAGS.data, FLAGS.cache_dir)

    import jax
    import numpy as np

    from twinshard import data
    from twinshard.checkpoint import Checkpointer

    runner = common.make_runner(FLAGS.strategy, FLAGS.impl, FLAGS.mesh, cfg)
    t, m = cfg.train, cfg.model
    os.makedirs(FLAGS.workdir, exist_ok=True)
    ckpt = Checkpointer(os.path.join(FLAGS.workdir, "checkpoints"))
    meta = {"model": dataclasses.asdict(m), "train": dataclasses.asdict(t),
            "data": str(FLAGS.data or "default"), "strategy": FLAGS.strategy, "impl": FLAGS.impl}
    metrics_path = os.path.join(FLAGS.workdir, "metrics.jsonl")

    if FLAGS.resume:
        state, _ = ckpt.restore(runner.abstract_state(), m)
        start = int(state.step)
        records = _previous_metrics(metrics_path, start)
        print(f"resumed from {ckpt.directory} at step {start}")
    else:
        if ckpt.latest_step() is not None:
            raise ValueError(f"{FLAGS.workdir} already holds checkpoints (latest step "
                             f"{ckpt.latest_step()}); pass --resume to continue, or a new --workdir.")
        state, start, records = runner.init_state(t.seed), 0, []

    n_params = m.num_params()
    label = FLAGS.strategy if FLAGS.strategy == "single" else f"{FLAGS.strategy}/{FLAGS.impl}"
    print(f"{label} preset={FLAGS.preset} params={n_params:,} "
          f"devices={jax.device_count()} batch={t.batch_size}x{m.context_length} steps={t.steps}")

    def eval_loss(params):
        losses = [runner.eval_loss(params, *runner.place_batch(
            *data.get_batch(val_tokens, t.batch_size, m.context_length, t.seed + 1, i)))
            for i in range(t.eval_batches)]
        return float(np.mean([float(l) for l in losses]))

    tick, tick_step, done = time.perf_counter(), start, start
    for step in range(start, t.steps):
        x, y = data.get_batch(train_tokens, t.batch_size, m.context_length, t.seed, step)
        state, metrics = runner.train_step(state, *runner.place_batch(x, y))
        done = step + 1
        if step == start:  # the first step compiles: keep it out of the throughput
            jax.block_until_ready(state)
            compile_s = time.perf_counter() - tick
            print(f"first step (compile + run): {compile_s:.1f}s", flush=True)
            tick, tick_step = time.perf_counter(), done
        if done % log_every == 0 or done == t.steps:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            step_time = (now - tick) / (done - tick_step) if done > tick_step else compile_s
            rec = {"step": done, **metrics, "step_time": step_time,
                   "tokens_per_s": t.batch_size * m.context_length / step_time}
            if eval_every and (done % eval_every == 0 or done == t.steps):
                rec["eval_loss"] = eval_loss(state.params)
            records.append(rec)
            _write_metrics(metrics_path, records)
            eta = (t.steps - done) * step_time
            print(f"step {done:6d} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                  f"{rec['tokens_per_s']:9.0f} tok/s | {1e3 * step_time:7.1f} ms/step | "
                  f"ETA {eta:6.0f}s" + (f" | eval {rec['eval_loss']:.4f}" if "eval_loss" in rec else ""),
                  flush=True)
        stop = done == t.steps or done == FLAGS.stop_after
        if (ckpt_every and done % ckpt_every == 0) or stop:
            ckpt.save(done, state, meta)
        if done % log_every == 0:  # eval and checkpoint time stay out of the throughput
            tick, tick_step = time.perf_counter(), done
        if stop:
            break
    print(f"done: step {done} of {t.steps}; metrics in {metrics_path}; checkpoints in {ckpt.directory}")


if __name__ == "__main__":
    app.run(main)
