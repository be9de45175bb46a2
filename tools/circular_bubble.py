"""The GSPMD twin's circular pipeline, measured: GPipe (V = 1) against interleaved V chunks a stage.

    uv run python tools/circular_bubble.py                         # tiny width, 8 layers, S = 4, CPU
    uv run python tools/circular_bubble.py --virtual=1,2,4 --layers=16 --json=circular.json

For each M and V, auto pp on `--stages` simulated devices runs `--steps` timed train steps after a
warm-up at a FIXED global batch. From the compiled program: the ticks its loop runs (the forward
roll's collective-permutes, one per tick) beside the useful ticks a stage has (V M, each 1/V of a
stage's layers), so the bubble share read from the program is (ticks - V M) / ticks, which MaxText
gives as (S-1)/(V M+S-1). On simulated CPU devices every stage computes on every tick (bubble
ticks run on zeros) and the stages share the cores, so the step is the total work: ticks x a
chunk's work, predicted (V M + S - 1)/V against GPipe's M + S - 1 stage-ticks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import auto_parallel  # noqa: E402
from twinshard import hlo  # noqa: E402
from twinshard.config import Config, preset  # noqa: E402


def measure(stages: int, m: int, virtual: int, args) -> dict:
    """One (M, V): the compiled step's ticks and the median step time."""
    base = preset("tiny")
    model = dataclasses.replace(base.model, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
                                d_ff=0, context_length=args.context)
    train = dataclasses.replace(base.train, batch_size=args.batch, microbatches=m, virtual_stages=virtual,
                                schedule="interleaved" if virtual > 1 else "gpipe")
    runner = auto_parallel.make_runner("pp", f"stage:{stages}", Config(model, train), devices=jax.devices()[:stages])
    rng = np.random.default_rng(0)
    x = rng.integers(0, model.vocab_size, (args.batch, model.context_length)).astype(np.int32)
    state, batch = runner.init_state(0), runner.place_batch(x, x)
    compiled = runner.train_step.lower(state, *batch).compile()
    ticks = hlo.ledger(compiled.as_text(), runner.mesh).patterns("stage")["stage ring +1"]  # the forward roll
    for _ in range(args.warmup):
        state, metrics = compiled(state, *batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = compiled(state, *batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return {"stages": stages, "microbatches": m, "virtual": virtual, "ticks": ticks, "useful": virtual * m,
            "bubble": (ticks - virtual * m) / ticks, "formula": (stages - 1) / (virtual * m + stages - 1),
            "step_s": statistics.median(times), "stage_ticks": ticks / virtual}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=str, default="4,8")
    p.add_argument("--virtual", type=str, default="1,2")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    rows = [measure(args.stages, m, v, args) for m in map(int, args.microbatches.split(","))
            for v in map(int, args.virtual.split(","))]
    print(f"S={args.stages} L={args.layers} batch={args.batch} d_model={args.d_model} T={args.context}, "
          f"median of {args.steps} steps")
    print("| M | V | ticks (compiled) | useful ticks V M | bubble read | (S-1)/(VM+S-1) | stage-ticks of work "
          "(ticks/V) | step ms | vs V=1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gpipe = next(g for g in rows if g["microbatches"] == r["microbatches"] and g["virtual"] == 1)["step_s"] \
            if any(g["virtual"] == 1 for g in rows) else r["step_s"]
        print(f"| {r['microbatches']} | {r['virtual']} | {r['ticks']} | {r['useful']} | {r['bubble']:.3f} | "
              f"{r['formula']:.3f} | {r['stage_ticks']:.1f} | {r['step_s'] * 1e3:.1f} | {r['step_s'] / gpipe:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "loadavg": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
