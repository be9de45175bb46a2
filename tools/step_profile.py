"""Where a compiled train step spends its time, per kind of HLO op, on a CPU or an accelerator.

    python tools/step_profile.py --preset=small                 # single device
    python tools/step_profile.py --preset=small --strategy=fsdp --impl=manual
    python tools/step_profile.py --preset=maxtext_llama_ref --top=25
    python tools/step_profile.py --preset=gpt2_125m --batch_size=16 --dtype=bfloat16   # one GPU
    python -m launch.bench --preset=tiny --strategies=single --profile=/tmp/prof   # the bench's own steps
    python tools/step_profile.py --trace_dir=/tmp/prof/single   # read back: no compile, no device

Runs `--steps` compiled steps under `jax.profiler.trace` (or, with `--trace_dir`, takes the trace,
compiled HLO and wall time that `launch.bench --profile` wrote beside its timed steps), reads the trace's
`.xplane.pb` back with `jax.profiler.ProfileData`, and sums the duration of every
event that names an instruction of the step's compiled HLO, per kind:

- matmul: a dot, or a fusion whose body has a dot (XLA:CPU's ynn/onednn fusions, cuBLAS
  custom-calls, Triton GEMM fusions);
- copy/transpose: `copy`, `transpose` and fusions whose root is one (layout changes);
- dynamic-update-slice: the scan writing a layer's saved activations into [L, ...];
- attention: the attention kernels' custom-calls (cuDNN's fmha on a GPU; splash's Pallas kernels on a
  TPU, `tpu_custom_call`s named splash_*);
- reduce, elementwise (loop fusions), broadcast/constant-fill, collectives, other (other custom-calls).

Measured facts (JAX 0.12 on XLA:CPU; jax 0.11.2's xplane has the same fields; the TPU's below,
TPU_SKIPPED_LINES):
- every event XLA records for an executed instruction carries the stat `hlo_op`
  (the instruction's name, `fusion.12`, `dot.3`) and `hlo_module`;
- on a CPU those events sit on the `/host:CPU` plane, one line per worker thread, so
  thread time is summed over threads and can exceed wall time;
- on a GPU the kernels sit on the `/device:GPU:N` plane (one line per stream), named by
  kernel, with `hlo_op` naming the instruction that launched them; the host plane then
  also has `hlo_op` events (the launches), which are not counted: when a device plane has
  any, only device events count. Device time per step against the wall time per step
  says how much of the step the accelerator sat idle (launch overhead, host work). Read it
  beside launch.bench's unprofiled step time: XLA:GPU does not replay CUDA graphs while a
  profiler session is active, so a profiled step may launch kernels one by one and idle
  more than the real one.
Like the launchers, the tool re-executes itself once with launch.MALLOC_TUNABLES.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags (defined when run as a script: tests import hlo_kinds / op_times)."""
    flags.DEFINE_string("preset", "small", "Preset (twinshard.config, or launch.bench's maxtext_llama_ref).")
    flags.DEFINE_string("strategy", "single", "single, or a strategy of launch.common.STRATEGIES.")
    flags.DEFINE_string("impl", "manual", "Twin for a strategy: auto or manual.")
    flags.DEFINE_string("mesh", None, "Mesh spec for a strategy (default: its default on 8 devices).")
    flags.DEFINE_integer("steps", 3, "Profiled steps (after 2 unprofiled warm-up steps).")
    flags.DEFINE_string("trace_dir", None, "Read the profile `launch.bench --profile` wrote here (its trace, "
                        "step.hlo.txt, profile.json) instead of compiling and running: the model flags are not read.")
    flags.DEFINE_integer("top", 15, "Also list this many most expensive instructions.")
    flags.DEFINE_integer("width", 150, "Characters of each listed instruction's HLO line.")
    flags.DEFINE_integer("batch_size", None, "Global batch size override (sequences).")
    flags.DEFINE_string("predict_json", None, "Also price the same compiled program op by op "
                        "(twinshard.hardware.step_time at the chip's measured efficiencies) and write, per "
                        "instruction, the predicted and the measured ms per step here (a single-device step), and the "
                        "compiled program beside it (.hlo).")
    flags.DEFINE_string("predict_chip", None, "The chip --predict_json prices at (default: the one the "
                        "step runs on; on a CPU name one, e.g. v5e, to check the tool's code).")
    from launch import common

    # launch.bench's model flags (--dtype, --remat, --loss_chunks, the shapes, ...) and launch.fit's
    # --skip_memory_check / --device_memory_gib: a step that cannot fit is refused
    common.define_precision_flags()

# name = type op(...): a tuple type "(f32[8]{0}, s8[64]{0})" has spaces (multi-output fusions, GEMMs)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\(", re.M)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
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
            elif op == "custom-call":  # cuBLAS / cuDNN on a GPU: __cublas$gemm, __cudnn$fmha...
                target = (t.group(1) if (t := _TARGET.search(line)) else "").lower()
                kinds[name] = ("matmul" if "gemm" in target or "matmul" in target else
                               "attention" if "fmha" in target or "attention" in target or _is_splash(name, target)
                               else "other")
            elif any(op.startswith(c) for c in COLLECTIVES):
                kinds[name] = "collective"
            elif op in ("while", "call", "conditional", "parameter", "tuple", "get-tuple-element",
                        "constant", "bitcast"):
                continue  # containers and no-ops: their bodies' ops are events of their own
            else:
                kinds[name] = "other"
    return kinds, lines


def _is_splash(name: str, target: str) -> bool:
    """A splash kernel on a TPU: a Pallas `tpu_custom_call` named for its kernel (splash_mha_fwd_residuals.1,
    splash_mha_dkv_no_residuals.1, splash_mqa_...; v5e AOT compile, JAX 0.12)."""
    return target == "tpu_custom_call" and name.startswith("splash_")


def op_times(data, kinds: dict[str, str], module: str | None = None
             ) -> tuple[collections.Counter, collections.Counter, bool, int]:
    """(ns per HLO instruction, ns per accelerator kernel name, whether the times are device
    times, ns of the busiest device plane) from a `jax.profiler.ProfileData`.

    An event counts when its `hlo_op` stat (or, lacking one, its name) is an instruction of the
    step and, where it names one, its `hlo_module` is `module` (another jitted program may
    reuse an instruction name). Device-plane events win over host events: on an accelerator
    the host's are launches."""
    on_device: collections.Counter = collections.Counter()
    on_host: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    busiest = 0
    for plane in data.planes:
        device = plane.name.startswith("/device:") and not plane.name.startswith("/device:CPU")
        plane_ns = 0
        for line in plane.lines:
            if line.name in TPU_SKIPPED_LINES:
                continue
            for ev in line.events:
                with warnings.catch_warnings():  # jaxlib: "builtin type event_stats has no __module__"
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(ev.stats)
                op = stats.get("hlo_op") or _instruction(ev.name)
                if op not in kinds or (module and stats.get("hlo_module", module) != module):
                    continue
                (on_device if device else on_host)[op] += ev.duration_ns
                if device:
                    kernels[ev.name if "hlo_op" in stats else op] += ev.duration_ns  # TPU: name = HLO text
                    plane_ns += ev.duration_ns
        busiest = max(busiest, plane_ns)
    return (on_device, kernels, True, busiest) if on_device else (on_host, kernels, False, 0)


# A TPU's device plane (/device:TPU:0; JAX 0.10.2 on a v5e, measured) has a line "XLA Ops" whose
# events are named by the instruction's HLO text ("%fusion.3 = bf16[...] fusion(...)") with no
# `hlo_op` stat, one "XLA Modules" event per executed program, and "Async XLA Ops" repeating the
# async copies' spans: only "XLA Ops" is counted, so nothing is counted twice.
TPU_SKIPPED_LINES = ("XLA Modules", "Async XLA Ops")
_EVENT_OP = re.compile(r"^%?([\w.\-]+)(?:\s*=|$)")


def _instruction(event_name: str) -> str:
    """The instruction an event names: `fusion.3` from "%fusion.3 = bf16[8]{0} fusion(...)" (TPU), or
    the name itself (CPU/GPU events named by instruction)."""
    m = _EVENT_OP.match(event_name)
    return m.group(1) if m else event_name


def read_trace(trace_dir: str):
    import jax

    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    return jax.profiler.ProfileData.from_file(path)


def build(cfg):
    """(runner, initial state, placed batch) for --strategy/--impl."""
    from launch import bench, common, fit

    run = common.resolve_run(FLAGS.strategy, "single" if FLAGS.strategy == "single" else FLAGS.impl, FLAGS.mesh, cfg)
    runner = common.runner_of(run)
    fit.check_model(run)  # before compiling or allocating
    fit.check_step(runner, run)
    x, y = bench.random_batch(cfg)
    return runner, runner.init_state(0), runner.place_batch(x, y)


def main(argv):
    del argv
    from launch import bench, common

    common.check_output_path(FLAGS.predict_json, "predict_json")
    if FLAGS.trace_dir:
        return from_trace_dir(FLAGS.trace_dir)

    common.default_platform()  # the CPU unless JAX_PLATFORMS is set or there is a GPU / TPU chip
    if FLAGS.strategy != "single":
        common.simulate_cpu_devices(8)  # on a CPU; an accelerator host uses its own devices
    import dataclasses

    import jax

    from twinshard.config import PRESETS, preset
    from twinshard.hardware import measure

    known = (*PRESETS, *bench.BENCH_PRESETS)
    if FLAGS.preset not in known:
        raise ValueError(f"--preset={FLAGS.preset}: unknown; choose one of {', '.join(known)}.")
    if FLAGS.strategy not in common.STRATEGIES or FLAGS.impl not in ("auto", "manual"):
        raise ValueError(f"--strategy={FLAGS.strategy} --impl={FLAGS.impl}: choose a strategy of "
                         f"{', '.join(common.STRATEGIES)} and an impl of auto, manual.")
    if FLAGS.steps < 1:
        raise ValueError(f"--steps={FLAGS.steps}: profile at least one step.")
    if FLAGS.predict_json:
        chip_to_predict(jax.devices()[0])  # a chip to price at, checked before anything compiles
    cfg = common.with_model_flags(bench.BENCH_PRESETS.get(FLAGS.preset) or preset(FLAGS.preset), FLAGS)
    if FLAGS.batch_size is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=FLAGS.batch_size))
    runner, state, batch = build(cfg)
    compiled = runner.train_step.lower(state, *batch).compile()
    for _ in range(2):
        state, metrics = compiled(state, *batch)
    jax.block_until_ready(metrics)
    with tempfile.TemporaryDirectory() as trace_dir:  # what launch.bench --profile writes, read back alike
        measure.trace_steps(compiled, state, batch, FLAGS.steps, trace_dir)
        from_trace_dir(trace_dir, f"{FLAGS.preset} {FLAGS.strategy}"
                                  f"{'' if FLAGS.strategy == 'single' else '/' + FLAGS.impl}")


def from_trace_dir(where: str, title: str | None = None) -> None:
    """The profile twinshard.hardware.measure.trace_steps wrote (trace, step.hlo.txt, profile.json; --trace_dir:
    launch.bench --profile's), analysed here on any machine (the device it ran on is profile.json's): the
    per-kind report, and with --predict_json the same program priced op by op beside it."""
    import types

    paths = {name: os.path.join(where, name) for name in ("step.hlo.txt", "profile.json")}
    if missing := [p for p in paths.values() if not os.path.isfile(p)]:
        raise ValueError(f"--trace_dir={where}: no {', '.join(missing)}; give a folder launch.bench --profile "
                         "wrote (PROFILE/<run>).")
    with open(paths["profile.json"]) as f:
        meta = json.load(f)
    device = types.SimpleNamespace(platform=meta["platform"], device_kind=meta["device_kind"])
    predict_chip = chip_to_predict(device) if FLAGS.predict_json else None
    with open(paths["step.hlo.txt"]) as f:
        text = f.read()
    title = title or os.path.basename(where.rstrip("/"))
    wall_ms, steps = meta["wall_ms"], meta["steps"]
    kinds, lines = hlo_kinds(text)
    module = m.group(1) if (m := re.match(r"HloModule ([\w.\-]+)", text)) else None
    per_op, kernels, on_device, busiest = op_times(read_trace(where), kinds, module)
    report(per_op, kernels, on_device, busiest, kinds, lines, wall_ms, device, steps, title)
    if FLAGS.predict_json:
        write_prediction(FLAGS.predict_json, text, per_op, kinds, wall_ms, predict_chip, steps, title)


def chip_to_predict(device):
    """--predict_chip's chip, else the device's; checked before anything compiles."""
    from twinshard.hardware import chips

    if FLAGS.predict_chip:
        try:
            return chips.chip(FLAGS.predict_chip)
        except ValueError as e:
            raise ValueError(f"--predict_chip={FLAGS.predict_chip}: {e}") from None
    found = chips.chip_for(device.device_kind)
    if found is None:
        raise ValueError(f"--predict_json: no chip in twinshard.hardware.chips runs as {device.device_kind!r}; "
                         "name one with --predict_chip (e.g. v5e)")
    return found


def write_prediction(path: str, text: str, per_op, kinds, wall_ms: float, chip, steps: int, preset: str) -> dict:
    """The compiled step (its HLO text) priced op by op beside the profile's time of each instruction (ms per step,
    every run of a loop body's op summed): the prediction checked against the very program that ran,
    kind by kind and op by op."""
    from twinshard.hardware.step_time import predict_step

    pred = predict_step(text, chip)
    ops = [{"name": o.name, "kind": o.kind, "profile_kind": kinds.get(o.name, ""), "opcode": o.opcode,
            "runs": o.runs, "flops": o.flops, "bytes": o.bytes,
            "predicted_ms": 1e3 * o.seconds * o.runs, "compute_ms": 1e3 * o.compute_s * o.runs,
            "memory_ms": 1e3 * o.memory_s * o.runs, "measured_ms": per_op.get(o.name, 0) / 1e6 / steps}
           for o in pred.ops if o.kind != "loop"]
    out = {"preset": preset, "chip": chip.name, "wall_ms": wall_ms,
           "predicted_ms": 1e3 * pred.step_s, "efficiencies": pred.rates.source,
           "measured_device_ms": sum(per_op.values()) / 1e6 / steps, "ops": ops}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    with open(path.removesuffix(".json") + ".hlo", "w") as f:  # to price again with another cost model
        f.write(text)
    print(f"predicted {out['predicted_ms']:.1f} ms against {wall_ms:.1f} ms wall (device ops "
          f"{out['measured_device_ms']:.1f} ms); per op in {path}")
    return out


def report(per_op, kernels, device: bool, busiest: int, kinds, lines, wall_ms: float, chip, steps: int,
           title: str) -> None:
    """The per-kind table, then the top instructions (and, on an accelerator, the top kernels)."""
    device_kind = chip.device_kind
    if not device and chip.platform != "cpu":
        print(f"WARNING: the trace has no {chip.platform} kernel events (is the profiler's CUPTI / device "
              "tracer available here?): the times below are the host's launches, not kernel time.")
    total = sum(per_op.values())
    by_kind: collections.Counter = collections.Counter()
    for name, ns in per_op.items():
        by_kind[kinds[name]] += ns
    where = (f"device time (the busiest device's kernels: {100 * busiest / 1e6 / steps / wall_ms:.0f}% of the "
             "wall time, streams summed)" if device else "op thread time, summed over threads")
    print(f"{title} on {device_kind}: {wall_ms:.1f} ms/step wall under the profiler; {total / 1e6 / steps:.1f} ms of "
          f"{where} per step, {len(per_op)} distinct ops")
    print("| kind | ms/step | share |\n|---|---|---|")
    for kind, ns in by_kind.most_common():
        print(f"| {kind} | {ns / 1e6 / steps:.1f} | {100 * ns / total:.1f}% |")
    print(f"\ntop {FLAGS.top} instructions:")
    for name, ns in per_op.most_common(FLAGS.top):
        print(f"  {ns / 1e6 / steps:8.2f} ms  {100 * ns / total:5.1f}%  {kinds[name]:<24} "
              f"{lines[name][:FLAGS.width]}")
    if device:
        print(f"\ntop {FLAGS.top} kernels:")
        for name, ns in kernels.most_common(FLAGS.top):
            print(f"  {ns / 1e6 / steps:8.2f} ms  {100 * ns / total:5.1f}%  {name[:FLAGS.width]}")


if __name__ == "__main__":
    from launch import common, reexec_with_malloc_tunables

    reexec_with_malloc_tunables()  # profile the launchers' allocator, not glibc's defaults
    define_flags()
    common.run(main, "step_profile")  # a bad flag value: one line on stderr, exit 1
