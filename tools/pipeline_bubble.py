"""The pipeline bubble, measured: step time against the number of micro-batches M.

    uv run python tools/pipeline_bubble.py                       # tiny width, 4 layers, CPU
    uv run python tools/pipeline_bubble.py --d_model=256 --heads=8 --context=128 --json=bubble.json
    uv run python tools/pipeline_bubble.py --stages=2 --runs=manual:1f1b,manual:interleaved --virtual=2
    uv run python tools/pipeline_bubble.py --stages=4 --batch=16 --steps=21 --warmup=3 --paired=8,16

For S = 2 and 4 stages and M = S ... batch micro-batches (powers of two), each schedule
(manual GPipe, manual 1F1B, manual zb_h1, auto GPipe; `--runs` picks, manual interleaved with `--virtual`
chunks a stage among them, where V divides a stage's layers) runs `--steps` timed train steps after a warm-up
at a FIXED global batch, so the useful work per step is the same for every M. GPipe's
bubble: (S-1)/(M+S-1) of the stage-ticks do no useful work, so the ideal step time is
t(M) = t_useful / (1 - bubble) = t_useful * (M+S-1)/M. The table prints the measured time,
the time predicted from the largest-M run by that formula, and the bubble fraction.

What simulated CPU devices show: all S "devices" share the machine's cores, so a stage
that idles frees nothing for the others; what is measured is the total work. GPipe here
computes every tick on every stage (bubble ticks run on zeros: the loop is uniform), so
its bubble costs real compute and shows up as (M+S-1)/M. 1F1B skips idle ticks
(`lax.switch`) but recomputes each stage's forward in its backward (its vjp runs on the
saved input), about 1/3 more work, and every tick sends 2 messages; zb_h1 does 1F1B's work
split in two (B: the forward again and the input gradient; W: the weight gradient alone from B's
stash, docs/pipelines.md) in more ticks, and its shorter bubble frees nothing here. On real accelerators
the bubble is idle time instead, with the same fraction.
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
import manual_parallel  # noqa: E402
from twinshard.parallel import pipeline  # noqa: E402
from twinshard.config import Config, preset  # noqa: E402

RUNS = "manual:gpipe,manual:1f1b,manual:zb_h1,auto:gpipe"


def step_time(impl: str, schedule: str, stages: int, m: int, args) -> float:
    """The median of `args.steps` timed steps after `args.warmup`."""
    step, state, batch = warm_step(impl, schedule, stages, m, args)
    times = []
    for _ in range(args.steps):
        state, seconds = timed(step, state, batch)
        times.append(seconds)
    return statistics.median(times)


def timed(step, state, batch) -> tuple[object, float]:
    start = time.perf_counter()
    state, metrics = step(state, *batch)
    jax.block_until_ready(metrics)
    return state, time.perf_counter() - start


def paired(stages: int, m: int, args) -> dict[str, float]:
    """--paired: the manual schedules' steps timed in turn, so each sees the same load of a shared
    machine (their ratios hold where the absolute times do not); the median of each."""
    runs = {s: list(warm_step("manual", s, stages, m, args)) for s in ("gpipe", "1f1b", "zb_h1")}
    times: dict[str, list[float]] = {s: [] for s in runs}
    for _ in range(args.steps):
        for s, run in runs.items():
            run[1], seconds = timed(*run)
            times[s].append(seconds)
    return {s: statistics.median(t) for s, t in times.items()}


def warm_step(impl: str, schedule: str, stages: int, m: int, args):
    """(the runner's train step, its state after `args.warmup` steps, the placed batch)."""
    base = preset("tiny")
    model = dataclasses.replace(base.model, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
                                d_ff=0, context_length=args.context)
    virtual = args.virtual if schedule in pipeline.INTERLEAVED else 1
    cfg = Config(model, dataclasses.replace(base.train, batch_size=args.batch, microbatches=m, schedule=schedule,
                                            virtual_stages=virtual))
    make = {"auto": auto_parallel, "manual": manual_parallel}[impl].make_runner
    runner = make("pp", f"stage:{stages}", cfg, devices=jax.devices()[:stages])
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.model.vocab_size, (args.batch, cfg.model.context_length)).astype(np.int32)
    state = runner.init_state(0)
    batch = runner.place_batch(x, x)
    for _ in range(args.warmup):
        state, metrics = runner.train_step(state, *batch)
    jax.block_until_ready(metrics)
    return runner.train_step, state, batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d_model", type=int, default=64, help="tiny's 64 by default; wider makes ticks compute-bound")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stages", type=str, default="2,4")
    p.add_argument("--runs", type=str, default=RUNS, help="impl:schedule pairs, comma-separated")
    p.add_argument("--virtual", type=int, default=2, help="--schedule=interleaved's chunks per stage")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--paired", type=str, default=None, help="M values (e.g. 8,16): the manual schedules timed in turn")
    args = p.parse_args()
    if args.paired:
        for stages in (int(s) for s in args.stages.split(",")):
            for m in (int(v) for v in args.paired.split(",")):
                t = paired(stages, m, args)
                print(f"S={stages} M={m}: " + ", ".join(f"{s} {v * 1e3:.1f} ms" for s, v in t.items())
                      + f"; zb_h1 / 1f1b {t['zb_h1'] / t['1f1b']:.2f}", flush=True)
        return
    runs = [tuple(r.split(":")) for r in args.runs.split(",")]
    rows = []
    for stages in (int(s) for s in args.stages.split(",")):
        ms = [m for m in (stages * 2 ** k for k in range(8)) if m <= args.batch and args.batch % m == 0]
        for impl, schedule in runs:
            if schedule in pipeline.INTERLEAVED and args.layers % (stages * args.virtual):
                print(f"S={stages}: --virtual={args.virtual} does not divide {args.layers // stages} layers; "
                      f"no {schedule} row", flush=True)
                continue
            times = {m: step_time(impl, schedule, stages, m, args) for m in ms}
            useful = times[ms[-1]] * ms[-1] / pipeline.ticks(ms[-1], stages)  # from the largest M
            for m in ms:
                rows.append({"stages": stages, "microbatches": m, "impl": impl, "schedule": schedule,
                             "step_s": times[m], "bubble": pipeline.bubble_fraction(m, stages),
                             "gpipe_model_s": useful * pipeline.ticks(m, stages) / m})
                print(f"S={stages} M={m:3d} {impl:6} {schedule:5}: {times[m] * 1e3:8.1f} ms/step "
                      f"(GPipe model from M={ms[-1]}: {rows[-1]['gpipe_model_s'] * 1e3:7.1f} ms; "
                      f"bubble {rows[-1]['bubble']:.3f})", flush=True)
    print("\n| S | M | bubble (S-1)/(M+S-1) | " + " | ".join(f"{i} {s} ms" for i, s in runs)
          + (" | GPipe model ms |" if ("manual", "gpipe") in runs else " |"))
    print("|---|---|---|" + "---|" * (len(runs) + (("manual", "gpipe") in runs)))
    for stages in sorted({r["stages"] for r in rows}):
        for m in sorted({r["microbatches"] for r in rows if r["stages"] == stages}):
            get = {(r["impl"], r["schedule"]): r for r in rows if (r["stages"], r["microbatches"]) == (stages, m)}
            cells = [f"{get[r]['step_s'] * 1e3:.1f}" if r in get else "-" for r in runs]
            if ("manual", "gpipe") in get:
                cells.append(f"{get['manual', 'gpipe']['gpipe_model_s'] * 1e3:.1f}")
            print(f"| {stages} | {m} | {pipeline.bubble_fraction(m, stages):.3f} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "loadavg": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
