"""Did a refactor move anything? Per-step losses, compiled temporaries and ledgers of every
strategy x twin (every twin twinshard/parallel/support.py lists) on the tiny preset (tiny_moe for the
expert strategies), written as JSON; `--compare A.json B.json` diffs two runs.

    uv run python tools/same_programs.py --out before.json      # on the old commit (a worktree)
    uv run python tools/same_programs.py --out after.json       # on the new one
    uv run python tools/same_programs.py --compare before.json after.json

Losses are recorded as float.hex, so "equal" means bitwise. Each run trains 3 steps from seed 0
on the same random tokens; temporaries are `memory_analysis().temp_size_in_bytes` of the
compiled train step, the ledger one (op, mesh axes) -> [count, bytes] summary per program.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MESHES = {"dp": "data:8,tensor:1", "fsdp": "data:8,tensor:1", "tp": "data:1,tensor:4", "fsdp_tp": "data:2,tensor:2",
          "tp_sp": "tensor:4", "cp": "context:4", "fsdp_cp": "data:2,context:2", "ulysses": "context:4",
          "fsdp_ulysses": "data:2,context:2", "pp": "stage:2", "pp_fsdp": "stage:2,data:2",
          "ep": "data:2,expert:4", "fsdp_ep": "data:2,expert:2"}
STEPS = 3


def record(strategies: list[str]) -> dict:
    import dataclasses

    import jax
    import numpy as np

    from launch import common
    from twinshard import hlo
    from twinshard.config import preset
    from twinshard.parallel import strategies as strategies_lib, support

    out = {}
    for strategy in strategies:
        experts = strategy in strategies_lib.of_family("experts")
        cfg = preset("tiny_moe" if experts else "tiny")
        rng = np.random.default_rng(0)
        b, t = cfg.train.batch_size, cfg.model.context_length
        batches = [rng.integers(0, cfg.model.vocab_size, (b, t + 1)).astype(np.int32) for _ in range(STEPS)]
        for impl in ["single"] if strategy == "single" else support.get(strategy).twins:
            spec = MESHES.get(strategy)
            n = 1 if spec is None else int(np.prod([int(p.split(":")[1]) for p in spec.split(",")]))
            run_cfg = cfg
            if strategy.startswith("pp"):  # a pipeline needs at least as many micro-batches as stages
                run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=2))
            runner = common.make_runner(strategy, impl, spec, run_cfg, None if spec is None else jax.devices()[:n])
            state = runner.init_state(0)
            rec: dict = {}
            if spec is not None:
                x, y = runner.place_batch(batches[0][:, :-1], batches[0][:, 1:])
                compiled = runner.train_step.lower(state, x, y).compile()
                rec["temp"] = int(compiled.memory_analysis().temp_size_in_bytes)
                rec["ledger"] = {f"{op} {','.join(axes)}": [s["count"], s["bytes"]]
                                 for (op, axes), s in hlo.ledger(compiled, runner.mesh).summary().items()}
            losses = []
            for batch in batches:
                x, y = runner.place_batch(batch[:, :-1], batch[:, 1:])
                state, metrics = runner.train_step(state, x, y)
                losses.append(float(metrics["loss"]).hex())
            out[f"{strategy}/{impl}"] = {"losses": losses, **rec}
            print(f"{strategy}/{impl}: losses {losses} temp {rec.get('temp')}", flush=True)
    return out


def compare(before: dict, after: dict) -> int:
    """A table, one row per run; exit status 1 if anything differs."""
    print(f"| run | losses ({STEPS} steps) | temp bytes before | after | ledger |\n|---|---|---|---|---|")
    differ = 0
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        if b is None or a is None:
            print(f"| {key} | only in {'after' if b is None else 'before'} | | | |")
            differ += 1
            continue
        same_losses, same_ledger = b["losses"] == a["losses"], b.get("ledger") == a.get("ledger")
        differ += (not same_losses) + (not same_ledger) + (b.get("temp") != a.get("temp"))
        print(f"| {key} | {'bitwise equal' if same_losses else 'DIFFER'} | {b.get('temp', '-')} | "
              f"{a.get('temp', '-')} | {'equal' if same_ledger else 'DIFFER'} |")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="record every run into this JSON file")
    ap.add_argument("--strategies", default=",".join(["single", *MESHES]), help="comma-separated (default: all)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="diff two recorded files")
    args = ap.parse_args(argv)
    if bool(args.out) == bool(args.compare):
        ap.error("give --out FILE (record) or --compare BEFORE AFTER (diff)")
    if args.compare:
        before, after = (json.load(open(p)) for p in args.compare)
        return compare(before, after)
    unknown = [s for s in args.strategies.split(",") if s not in ("single", *MESHES)]
    if unknown:
        ap.error(f"unknown strategies {unknown}; choose from single, {', '.join(MESHES)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                               " --xla_backend_optimization_level=0").strip()
    with open(args.out, "w") as f:
        json.dump(record(args.strategies.split(",")), f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
