"""One v5e's predicted step (twinshard.hardware.step_time, the chip's measured efficiencies) against
the step measured on the chip, for the TPU presets' runs of BENCHMARKS.md, "TPU (one v5e)".

    uv run --extra tpu python tools/predict_chip.py                 # every run below (~1 min each here)
    uv run --extra tpu python tools/predict_chip.py --only=llama_v5e --json=predicted.json

Each run's single-device train step is compiled ahead of time for a one-chip `v5e:1x1` topology on
this CPU (libtpu, the tpu extra) and priced op by op; nothing runs on a chip. The measured steps and
per-kind profiles are the chip's (BENCHMARKS.md gives each one's command and commit); the
efficiencies come from tools/chip_micro.py (a matmul, an HBM pass and the splash kernel alone),
never from these steps. Kinds compared with tools/step_profile.py's: matmul (matmul fusions),
attention (the splash kernels), memory (elementwise, reductions, copies, dynamic-update-slices, fills).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import NamedTuple

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The tool's flags, defined when it runs (importing it, as its tests do, defines none)."""
    flags.DEFINE_list("only", None, "Runs whose name starts with one of these (default: all).")
    flags.DEFINE_string("json", None, "Write predictions and measurements as JSON here.")

BF16 = {"dtype": "bfloat16", "weight_dtype": "bfloat16"}
FAST = {"logits_dtype": "compute", "norm_dtype": "compute", "qkv_layout": "heads"}


class Run(NamedTuple):
    name: str
    preset: str
    batch: int
    model: dict
    measured_ms: float  # the chip's step (BENCHMARKS.md)
    profile_ms: dict | None = None  # the chip's profile by kind, where one was taken
    train: dict | None = None  # TrainConfig fields beside the batch (grad_accum)


# The chip's figures: launch.bench and tools/step_profile.py on one v5e, jax 0.10.2 (BENCHMARKS.md).
RUNS = (
    Run("gpt2_125m float32 weights", "gpt2_125m", 16, {"dtype": "bfloat16"}, 166.3,
        {"matmul": 76.0, "attention": 36.1, "memory": 16.2 + 13.0 + 12.4 + 10.1 + 0.5}),
    Run("gpt2_125m", "gpt2_125m", 16, BF16, 160.0),
    Run("gpt2_125m + speed options", "gpt2_125m", 16, BF16 | FAST, 147.9),
    Run("gpt2_350m save_dot_except_mlp, 4 chunks", "gpt2_350m", 16,
        BF16 | {"remat": "save_dot_except_mlp", "loss_chunks": 4}, 455.3,
        {"matmul": 242.4, "attention": 87.3, "memory": 42.2 + 18.1 + 56.3 + 5.6 + 1.3}),
    Run("gpt2_350m save_dot_except_mlp", "gpt2_350m", 16, BF16 | {"remat": "save_dot_except_mlp"}, 448.2),
    Run("llama_v5e no remat", "llama_v5e", 2, BF16 | {"remat": "none"}, 157.5,
        {"matmul": 96.3, "attention": 18.7, "memory": 23.1 + 5.3 + 4.4 + 5.7 + 2.1}),
    Run("llama_v5e no remat + speed options", "llama_v5e", 2, BF16 | {"remat": "none"} | FAST, 149.5),
    # the best configurations of tools/tpu_bench.sh: the layer stack unrolled
    Run("gpt2_125m + speed options, unrolled", "gpt2_125m", 16, BF16 | FAST | {"scan_unroll": 12}, 132.4),
    Run("gpt2_350m save_dot_except_mlp + speed options, unrolled", "gpt2_350m", 16,
        BF16 | FAST | {"remat": "save_dot_except_mlp", "scan_unroll": 24}, 439.8),
    Run("llama_v5e no remat + speed options, unrolled", "llama_v5e", 2,
        BF16 | {"remat": "none"} | FAST | {"scan_unroll": 14}, 138.5,
        {"matmul": 94.8, "attention": 16.0, "memory": 17.0 + 3.0 + 2.9 + 2.3 + 0.6 + 0.3}),
    Run("gpt2_350m no remat + speed options, unrolled", "gpt2_350m", 16,
        BF16 | FAST | {"remat": "none", "scan_unroll": 24}, 419.7,
        {"matmul": 238.6, "attention": 74.5, "memory": 41.3 + 31.5 + 16.0 + 15.6 + 0.4 + 0.1}),
    Run("gpt2_350m no remat, 2 micro-batches + speed options, unrolled", "gpt2_350m", 16,
        BF16 | FAST | {"remat": "none", "scan_unroll": 24}, 367.9, train={"grad_accum": 2}),
    Run("llama_v5e no remat + speed options, unrolled, 4 sequences", "llama_v5e", 4,
        BF16 | {"remat": "none"} | FAST | {"scan_unroll": 14}, 256.6,
        {"matmul": 185.4, "attention": 32.8, "memory": 21.7 + 5.8 + 4.4 + 4.1 + 0.6 + 0.2}),
)
KINDS = ("matmul", "attention", "memory")


def compile_one_chip(run: Run):
    """The run's single-device train step compiled for one v5e, ahead of time."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from twinshard.config import preset
    from twinshard.hardware import topology
    from twinshard.model import layers
    from twinshard.train.trainer import SingleDevice

    cfg = preset(run.preset)
    model = dataclasses.replace(cfg.model, **run.model)
    train = dataclasses.replace(cfg.train, batch_size=run.batch, **(run.train or {}))
    one = SingleDeviceSharding(topology.devices("v5e:1x1", (1, 1, 1))[0])
    runner = SingleDevice(model, train)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), runner.abstract_state())
    tokens = jax.ShapeDtypeStruct((run.batch, model.context_length), jax.numpy.int32, sharding=one)
    with layers.compiling_for("tpu"):
        lowered = runner.train_step.lower(state, tokens, tokens)
    return topology.compile_for_pod(lowered)


def by_kind(pred) -> dict[str, float]:
    """Predicted ms per step of each profile kind (module docstring)."""
    kinds = pred.by_kind()
    return {"matmul": 1e3 * kinds.get("matmul", 0.0), "attention": 1e3 * kinds.get("attention", 0.0),
            "memory": 1e3 * sum(v for k, v in kinds.items() if k not in ("matmul", "attention"))}


def main(argv):
    del argv
    from twinshard.hardware import topology

    topology.default_to_cpu()
    from twinshard.hardware.step_time import predict_step

    runs = [r for r in RUNS if not FLAGS.only or any(r.name.startswith(o) for o in FLAGS.only)]
    if not runs:
        raise app.UsageError(f"--only={','.join(FLAGS.only)} matches no run; runs: {[r.name for r in RUNS]}")
    rows = []
    for run in runs:
        t0 = time.perf_counter()
        pred = predict_step(compile_one_chip(run), "v5e")
        predicted = 1e3 * pred.step_s
        rows.append({"run": run.name, "preset": run.preset, "batch": run.batch, "model": run.model,
                     "measured_ms": run.measured_ms, "predicted_ms": predicted,
                     "error": predicted / run.measured_ms - 1, "predicted_by_kind_ms": by_kind(pred),
                     "measured_by_kind_ms": run.profile_ms, "compile_s": time.perf_counter() - t0})
        print(f"{run.name}: predicted {predicted:.1f} ms, measured {run.measured_ms:.1f} ms "
              f"({rows[-1]['error']:+.1%}); by kind " + ", ".join(f"{k} {v:.1f}" for k, v in by_kind(pred).items())
              + (f"; measured " + ", ".join(f"{k} {run.profile_ms[k]:.1f}" for k in KINDS) if run.profile_ms else ""),
              flush=True)
    print(f"\nefficiencies: {pred.rates.source}")
    print("| run | measured | predicted | error | predicted matmul / attention / memory (measured) |")
    print("|---|---|---|---|---|")
    for r in rows:
        kinds = " / ".join(f"{r['predicted_by_kind_ms'][k]:.1f}" for k in KINDS)
        if r["measured_by_kind_ms"]:
            kinds += " (" + " / ".join(f"{r['measured_by_kind_ms'][k]:.1f}" for k in KINDS) + ")"
        print(f"| {r['run']} | {r['measured_ms']:.1f} ms | {r['predicted_ms']:.1f} ms | {r['error']:+.1%} | {kinds} |")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"efficiencies": pred.rates.source, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    define_flags()
    sys.exit(app.run(main))
