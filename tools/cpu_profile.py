"""Where a compiled train step spends its time on XLA:CPU, per kind of HLO op.

    python tools/cpu_profile.py --preset=small                 # single device
    python tools/cpu_profile.py --preset=small --strategy=fsdp --impl=manual
    python tools/cpu_profile.py --preset=maxtext_llama_ref --top=25

Runs `--steps` compiled steps under `jax.profiler.trace`, reads the trace's
`.xplane.pb` back with `jax.profiler.ProfileData`, and sums the duration of every
event that names an instruction of the step's compiled HLO (XLA:CPU records one
event per executed thunk: a fusion, a dot, a copy, a collective ...), per kind:

- matmul: a dot, or a fusion whose body has a dot (XLA:CPU's ynn/onednn fusions);
- copy/transpose: `copy`, `transpose` and fusions whose root is one (layout changes);
- dynamic-update-slice: the scan writing a layer's saved activations into [L, ...];
- reduce, elementwise (loop fusions), broadcast/constant-fill, collectives, other.

Thread time is summed over XLA's worker threads, so it can exceed wall time; the
table gives each kind's share of the step's summed op time (BENCHMARKS.md, "Round 6",
has the small preset's table).
Measured fact: on XLA:CPU (JAX 0.12) the trace's host plane holds one line per
thread, and each op event's name is the HLO instruction name (`fusion.12`,
`dot.3`, `copy.7`), so the compiled HLO text maps it to its kind. Like the
launchers, the tool re-executes itself once with launch.MALLOC_TUNABLES.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import flags  # noqa: E402

from launch import reexec_with_malloc_tunables  # noqa: E402

reexec_with_malloc_tunables()  # profile the launchers' allocator, not glibc's defaults

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "small", "Preset (twinshard.config, or launch.bench's maxtext_llama_ref).")
flags.DEFINE_string("strategy", "single", "single, or a strategy of launch.common.STRATEGIES.")
flags.DEFINE_string("impl", "manual", "Twin for a strategy: auto or manual.")
flags.DEFINE_string("mesh", None, "Mesh spec for a strategy (default: its default on 8 devices).")
flags.DEFINE_integer("steps", 3, "Profiled steps (after 2 unprofiled warm-up steps).")
flags.DEFINE_integer("top", 15, "Also list this many most expensive instructions.")
flags.DEFINE_integer("width", 150, "Characters of each listed instruction's HLO line.")
flags.DEFINE_string("dtype", None, "Compute dtype override (float32, bfloat16).")
flags.DEFINE_string("remat", None, "Remat policy override.")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(", re.M)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", re.M)
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def hlo_kinds(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Instruction name -> kind, and -> its HLO line, for every instruction of the compiled module."""
    bodies: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            bodies[current] = []
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            bodies[current].append((m.group(1), m.group(3), line))

    def fused_kind(comp: str, seen=()) -> str:
        ops = [op for _, op, _ in bodies.get(comp, [])]
        if "dot" in ops or "convolution" in ops:
            return "matmul"
        for _, op, line in bodies.get(comp, []):
            if op == "fusion" and (c := _CALLS.search(line)) and c.group(1) not in seen:
                if fused_kind(c.group(1), (*seen, comp)) == "matmul":
                    return "matmul"
        root = bodies.get(comp, [("", "", "")])[-1][1] if bodies.get(comp) else ""
        if root in ("copy", "transpose"):
            return "copy/transpose"
        if root == "dynamic-update-slice":
            return "dynamic-update-slice"
        if "reduce" in ops:
            return "reduce"
        if root == "broadcast" and len(ops) <= 2:
            return "broadcast/constant-fill"
        return "elementwise"

    kinds, lines = {}, {}
    for comp, instrs in bodies.items():
        for name, op, line in instrs:
            lines[name] = line.strip()
            if op == "fusion" and (c := _CALLS.search(line)):
                kinds[name] = fused_kind(c.group(1))
            elif op in ("dot", "convolution"):
                kinds[name] = "matmul"
            elif op in ("copy", "transpose"):
                kinds[name] = "copy/transpose"
            elif op in ("dynamic-update-slice", "reduce", "broadcast"):
                kinds[name] = {"broadcast": "broadcast/constant-fill"}.get(op, op)
            elif any(op.startswith(c) for c in COLLECTIVES):
                kinds[name] = "collective"
            elif op in ("while", "call", "conditional", "parameter", "tuple", "get-tuple-element",
                        "constant", "bitcast"):
                continue  # containers and no-ops: their bodies' ops are events of their own
            else:
                kinds[name] = "other"
    return kinds, lines


def op_times(trace_dir: str, kinds: dict[str, str]) -> collections.Counter:
    import jax

    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
    per_op: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                if ev.name in kinds:
                    per_op[ev.name] += ev.duration_ns
    return per_op


def build(cfg):
    """(runner, initial state, placed batch) for --strategy/--impl."""
    from launch import bench, common
    from twinshard import trainer

    if FLAGS.strategy == "single":
        runner = trainer.SingleDevice(cfg.model, cfg.train)
    else:
        runner = common.make_runner(FLAGS.strategy, FLAGS.impl, FLAGS.mesh, cfg)
    x, y = bench.random_batch(cfg)
    return runner, runner.init_state(0), runner.place_batch(x, y)


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if FLAGS.strategy != "single":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    import dataclasses

    import jax

    from launch import bench
    from twinshard.config import preset

    cfg = bench.BENCH_PRESETS.get(FLAGS.preset) or preset(FLAGS.preset)
    overrides = {k: getattr(FLAGS, k) for k in ("dtype", "remat") if getattr(FLAGS, k)}
    if overrides:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **overrides))
    runner, state, batch = build(cfg)
    compiled = runner.train_step.lower(state, *batch).compile()
    kinds, lines = hlo_kinds(compiled.as_text())
    for _ in range(2):
        state, metrics = compiled(state, *batch)
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(FLAGS.steps):
                state, metrics = compiled(state, *batch)
            jax.block_until_ready(metrics)
        per_op = op_times(trace_dir, kinds)
    total = sum(per_op.values())
    by_kind: collections.Counter = collections.Counter()
    for name, ns in per_op.items():
        by_kind[kinds[name]] += ns
    print(f"{FLAGS.preset} {FLAGS.strategy}{'' if FLAGS.strategy == 'single' else '/' + FLAGS.impl}: "
          f"{total / 1e6 / FLAGS.steps:.1f} ms of op thread time per step, {len(per_op)} distinct ops")
    print("| kind | ms/step | share |\n|---|---|---|")
    for kind, ns in by_kind.most_common():
        print(f"| {kind} | {ns / 1e6 / FLAGS.steps:.1f} | {100 * ns / total:.1f}% |")
    print(f"\ntop {FLAGS.top} instructions:")
    for name, ns in per_op.most_common(FLAGS.top):
        print(f"  {ns / 1e6 / FLAGS.steps:8.2f} ms  {100 * ns / total:5.1f}%  {kinds[name]:<24} "
              f"{lines[name][:FLAGS.width]}")


if __name__ == "__main__":
    from launch import common

    common.run(main, "cpu_profile")  # a bad flag value: one line on stderr, exit 1
