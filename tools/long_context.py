"""Long context, measured: per-device memory and step time against the sequence length.

    uv run python tools/long_context.py                                  # tp, tp_sp, cp, ulysses; T = 512 ... 8192
    uv run python tools/long_context.py --strategies=tp,cp --impls=manual,auto --budget_mib=512 \\
        --time_up_to=2048 --json=long_context.json --markdown=long_context.md

For each strategy (tp and tp_sp on tensor:N, cp and ulysses on context:N; N = --devices) and each context
length T (powers of two from --min_context to --max_context), a tiny-width model (--d_model,
--heads, --layers; byte vocabulary) is compiled ahead of time on --batch sequences and
`compiled.memory_analysis()` gives the per-device bytes: arguments (params, optimizer state,
batch) + outputs - aliased (the donated state) + temporaries (activations, gradients, the
attention scores). Up to --time_up_to tokens the step also runs: the median of --steps timed
steps after one warm-up. The last table gives, per strategy, the longest T whose per-device
peak fits in --budget_mib.

What to expect: under tp every device holds the whole sequence's residual stream, and its
H/N heads' [T, T] probabilities while one layer's attention runs (layers.recompute_attention
saves none of them for the backward pass, which recomputes them one layer at a time); tp_sp
splits the residual stream (and the norms) over T but still gathers it for attention; manual
cp splits the sequence everywhere and holds one [T/N, T/N] block at a time (ring attention
keeps every received K/V block for the backward pass); ulysses splits the sequence everywhere but
inside attention, where each device holds whole sequences of H/N heads (the [T, T] working set of
H/N heads, as tp's). The [T, T] working set dominates at
long T, so tp's memory grows ~T^2 H/N / H and manual cp's ~T until its per-block [T/N, T/N]
term (also ~T^2, N^2 times smaller) takes over.

A strategy not in auto_parallel.MODULES is skipped with a note.
Simulated CPU devices share the machine's memory and cores: memory per device is what XLA
plans for one device; step times show total work, not parallel speed-up.
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
from twinshard.config import ATTENTION_IMPLS, Config, ModelConfig, TrainConfig  # noqa: E402

MIB = 2 ** 20
AXIS = {"tp": "tensor", "tp_sp": "tensor", "cp": "context", "ulysses": "context"}  # the one axis each strategy splits here


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="tp,tp_sp,cp,ulysses")
    p.add_argument("--impls", default="manual", help="manual and/or auto")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--min_context", type=int, default=512)
    p.add_argument("--max_context", type=int, default=8192)
    p.add_argument("--budget_mib", type=float, default=256.0, help="the fixed per-device memory budget")
    p.add_argument("--time_up_to", type=int, default=2048, help="run and time steps up to this T (0: none)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--attention", default="auto", choices=ATTENTION_IMPLS, help="layers.causal_attention's kernel for tp, tp_sp and "
                   "contiguous cp (auto, recompute, xla, reference); ring attention and zig-zag cp have their own")
    p.add_argument("--json")
    p.add_argument("--markdown")
    a = p.parse_args(argv)
    a.strategies = [s for s in a.strategies.split(",") if s]
    a.impls = [s for s in a.impls.split(",") if s]
    bad = [s for s in a.strategies if s not in AXIS] + [i for i in a.impls if i not in ("manual", "auto")]
    if bad:
        p.error(f"unknown {bad}: strategies from {', '.join(AXIS)}, impls from manual, auto")
    if a.devices > jax.device_count():
        p.error(f"--devices={a.devices} > the {jax.device_count()} devices here (XLA_FLAGS sets the CPU count)")
    if a.heads % a.devices or a.d_model % a.heads or a.min_context % (2 * a.devices):
        p.error(f"--heads ({a.heads}) must split over --devices ({a.devices}), --d_model over --heads, and "
                f"--min_context ({a.min_context}) into 2 x devices chunks (cp's zig-zag layout)")
    return a


def config(a: argparse.Namespace, seq: int) -> Config:
    model = ModelConfig(vocab_size=257, context_length=seq, d_model=a.d_model, num_layers=a.layers, num_heads=a.heads,
                        attention=a.attention)
    return Config(model, TrainConfig(batch_size=a.batch, steps=10, warmup_steps=1, tokenizer="bytes"))


def measure(a: argparse.Namespace, strategy: str, impl: str, seq: int) -> dict:
    cfg = config(a, seq)
    make = {"manual": manual_parallel, "auto": auto_parallel}[impl].make_runner
    runner = make(strategy, None, cfg, devices=jax.devices()[:a.devices])  # default mesh: all on AXIS[strategy]
    tokens = jax.ShapeDtypeStruct((a.batch, seq), np.int32, sharding=runner.batch_sharding)
    t0 = time.perf_counter()
    compiled = runner.train_step.lower(runner.abstract_state(), tokens, tokens).compile()
    ma = compiled.memory_analysis()
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    rec = {"strategy": strategy, "impl": impl, "seq": seq, "peak_mib": peak / MIB,
           "temp_mib": ma.temp_size_in_bytes / MIB, "arguments_mib": ma.argument_size_in_bytes / MIB,
           "compile_s": time.perf_counter() - t0, "step_ms": None, "fits": peak <= a.budget_mib * MIB}
    if seq <= a.time_up_to:
        rng = np.random.default_rng(0)
        x, y = runner.place_batch(*(rng.integers(0, 257, (a.batch, seq)).astype(np.int32) for _ in range(2)))
        state = runner.init_state(0)
        state, _ = compiled(state, x, y)  # warm-up
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            state, metrics = compiled(state, x, y)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t)
        rec["step_ms"] = 1000 * statistics.median(times)
    return rec


def markdown(a: argparse.Namespace, records: list[dict], notes: list[str]) -> str:
    lines = [f"d_model={a.d_model}, heads={a.heads}, layers={a.layers}, batch={a.batch}, {a.devices} devices "
             f"({jax.devices()[0].platform}); per-device memory from memory_analysis(); budget {a.budget_mib:g} MiB",
             "", "| strategy | impl | T | peak MiB/device | temp MiB | step ms | fits |", "|---|---|---|---|---|---|---|"]
    for r in records:
        ms = f"{r['step_ms']:.1f}" if r["step_ms"] is not None else "-"
        lines.append(f"| {r['strategy']} | {r['impl']} | {r['seq']} | {r['peak_mib']:.1f} | {r['temp_mib']:.1f} | "
                     f"{ms} | {'yes' if r['fits'] else 'no'} |")
    lines += ["", f"| strategy | impl | longest T within {a.budget_mib:g} MiB per device |", "|---|---|---|"]
    for key in dict.fromkeys((r["strategy"], r["impl"]) for r in records):
        fit = [r["seq"] for r in records if (r["strategy"], r["impl"]) == key and r["fits"]]
        lines.append(f"| {key[0]} | {key[1]} | {max(fit) if fit else f'< {a.min_context}'} |")
    return "\n".join(lines + [""] + [f"note: {n}" for n in notes])


def main(argv=None) -> None:
    a = parse(argv)
    notes = [f"strategy {s} is not in this checkout (auto_parallel.MODULES): skipped"
             for s in a.strategies if s not in auto_parallel.MODULES]
    for n in notes:
        print(n, flush=True)
    records = []
    seqs = [t for t in (a.min_context * 2 ** k for k in range(32)) if t <= a.max_context]
    for strategy in (s for s in a.strategies if s in auto_parallel.MODULES):
        for impl in a.impls:
            for seq in seqs:
                rec = measure(a, strategy, impl, seq)
                records.append(rec)
                print(json.dumps(rec), flush=True)
    text = markdown(a, records, notes)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items()}, "records": records, "notes": notes}, f, indent=1)


if __name__ == "__main__":
    main()
