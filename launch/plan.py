"""Plan a run on a TPU slice or a GPU cluster before you have it: every strategy x mesh, ranked.

    python -m launch.plan --preset=llm_1b --topology=v5p:4x4x4
    python -m launch.plan --preset=gpt2_350m --topology=h100:8x8 --dtype=bfloat16 --json=plan.json
    python -m launch.plan --preset=mixtral_8x7b --topology=v5p:4x4x4 --dtype=bfloat16
    python -m launch.plan --preset=llm_1b --topology=v5p:8x8x8 --slices=2 --batch_size=1024
    uv run --extra tpu python -m launch.plan --preset=gpt2_125m --topology=v5e:4x4 --compile

--topology is a TPU slice as gcloud names it, `GEN:AxB` (v5e, v6e: a 2D torus) or `GEN:AxBxC`
(v4, v5p: 3D), e.g. v5p:4x4x4 = 64 chips, up to the whole pod (v5p:16x20x28); or a GPU cluster
`GPU:NODESxGPUS`, e.g. h100:8x8 = 8 HGX nodes of 8 GPUs. --slices=N plans N such TPU slices over the
data-center network (DCN), in the layouts of the strategy column: a strategy inside each slice, data
parallel across (`hsdp` where it is fsdp, `dp` for dp), each slice running B/N sequences and each
chip's gradients all-reduced with its counterparts, 2 (N-1)/N x its float32 gradient bytes at its
DCN rate (v5p 50 Gb/s per chip, v5e 25); or `fsdp` over every slice's chips ("over N slices"), whose
weight gathers cross DCN too (twinshard/hardware/plan.py says how). With --compile the best dp, hsdp
and fsdp plans are compiled for the N slices (the auto twin, launch/slices.py) and ranked again by
their compiled step, its DCN all-reduce priced at the DCN rate. The chips' numbers, with their
sources, are twinshard/hardware/chips.py.

For each strategy the model runs under (every declared strategy, twinshard/parallel/strategies.py:
a dense model dp, fsdp, tp, fsdp_tp, tp_sp, fsdp_tp_sp, cp, fsdp_cp, pp, pp_fsdp; a mixture of experts dp,
fsdp, ep, fsdp_ep, as resolve.check_experts says) and each factoring of the chips over the
strategy's mesh axes that launch.train accepts for the model (resolve.resolve_mesh; a pipeline once
per schedule and interleaved V, each with the micro-batch count that ranks best), the cost model of
the manual twin (twinshard.cost) gives, per chip (twinshard/hardware/plan.py):

- memory: params + grads + optimizer state (--optimizer; AdamW's 2 moments by default), in
  --param_dtype and --optimizer_dtype (float32 both by default, as launch.train trains: 16 bytes
  per parameter; --master_weights adds a float32 copy of narrower params) + activations (under
  --remat) + the backward loop's one-layer working set (with the attention kernel's [T, T]
  arrays: none for cuDNN flash attention, the default on a GPU in bf16) + FSDP's gathered layer;
  the plan fits when that is at most (1 - --hbm_headroom) of the HBM. XLA's buffers are a peak
  (arguments + outputs - aliased + temporaries) and the model a sum; compiled for the slice,
  XLA's peak can sit above the model's (--hbm_headroom's help says by how much), hence the
  default headroom of 25%;
- compute time = FLOPs per chip / (peak x --mfu), --mfu by default the matmul efficiency measured
  on the chip (`chips.efficiency(chip)`: a large matmul on one chip, docs/schedule.md; 1.0 where
  none is measured, and the output says which), the FLOPs in MFU's convention (causal attention
  counted half, as flash and splash compute it): the bf16 peak for --dtype=bfloat16, and for
  float32 the peak of JAX's default matmul precision (TF32 tensor cores on NVIDIA; on TPU one
  bf16 MXU pass, so the bf16 peak); a pipeline's times its schedule's factor (GPipe (M+S-1)/M;
  1f1b, interleaved (each V <= 4 that splits a stage) and zb_h1 from their tables: docs/planning.md),
  ring attention's without the blocks it skips;
- communication time per mesh axis = the ring bytes one chip sends over it / the bandwidth of
  the links the axis uses (below); an all-to-all's ring bytes (ep's dispatch and combine)
  times the links' hop factor; a shift (a pipeline hop, ring attention's K/V blocks) at the
  rate of the one link it crosses. A collective over several axes (the gradient-norm scalar over
  (data, tensor)) is charged to the slowest of them;
- the step time two ways, both lower bounds (matmuls at --mfu, full link rate, latency
  ignored): `overlap` = max(compute, comm of each axis), as if every collective hid behind
  compute (XLA's async collectives come close for FSDP's weight gathers), and `serial` = their
  sum, nothing hidden (Megatron's activation all-reduces sit on the critical path). The bound
  is the largest term. Plans are ranked by --rank_by (serial by default).

Which links a mesh axis uses (twinshard/hardware/links.py has the formulas and their sources):

- TPU (ICI): the inner split axis (the last of size > 1 in mesh order: tensor, expert, context,
  or pp_fsdp's data) gets the physical axes jax.make_mesh gives it (`tensor_sides`: whole axes if
  some multiply to its size, else part of one), the outer one the rest. A mesh axis that spans a
  whole side with wraparound links (Topology.wraps: v4/v5p whole cubes wrap every side, v5e/v6e
  each side of 16) runs a bidirectional ring: 2 x the one-way link bandwidth per physical axis.
  On a side without wraparound, or on part of a side, the ring folds back on itself and each
  link carries it both ways: 1 x. An axis over k physical axes adds them (the scaling book's
  multi-axis collectives). v5p:4x4x4 (a torus), data:16,tensor:4: tensor on x, 2 x 90 GB/s =
  180 GB/s; data on y and z, 4 x 90 GB/s = 360 GB/s. An all-to-all's messages cross several
  links: n^2 / (4 (n-1)) times its ring bytes on a ring of n chips (links._ici).
- GPU: an axis inside a node on NVLink (450 GB/s one way per H100/H200); an axis across nodes as
  a hierarchical ring, NVLink inside each node and the network across them through the NICs of
  the group's GPUs (one 400 Gb/s NIC per GPU, 8 per HGX node), the two levels overlapped (the
  scaling book's GPU chapter; links._gpu_axis): data:64 on h100:8x8 moves 7/8 of each byte
  through a node's 400 GB/s egress (450 GB/s per GPU in ring bytes), data:8 beside tensor:8 inside
  the nodes through each GPU's own 50 GB/s NIC. An all-to-all is not hierarchical: the share
  bound for other nodes leaves through each GPU's NIC (its `all-to-all x` factor).

--compile (TPU only; needs libtpu, the `tpu` extra) then compiles the --compile_top (3) best runnable
plans' train steps (the manual twin) ahead of time for that slice on this machine
(twinshard/hardware/topology.py), prints each compiled step's collectives and memory_analysis() per
chip beside the model's, and ranks them again by the step `twinshard.hlo.predict` reads from the
compiled program (docs/schedule.md): each op priced at the chip's measured efficiencies, each
collective exposed only where the compiler's schedule leaves nothing to hide it behind, shown per
mesh axis (about a minute per plan on a 2-core CPU). GPU topologies cannot be compiled without the
GPUs.
"""

from __future__ import annotations

import dataclasses
import json

from absl import app, flags, logging

from launch import common
from twinshard import cost
from twinshard.config import COMPUTE_DTYPES, OPTIMIZERS, PRESETS, Config, ModelConfig, preset
from twinshard.cost import human
from twinshard.hardware import chips
from twinshard.hardware.chips import matmul_peak_flops
from twinshard.hardware.links import GB, Topology, parse_topology, with_slices
from twinshard.hardware.plan import (RANK_BY, Plan, Precision, Skipped, pipeline_factor, pipeline_schedules, plan_all,
                                     rank, runnable)
from twinshard.parallel import mesh as mesh_lib, support

# Flags shared by name with the other launchers keep their defaults (absl flags are process-global).
common.define(flags.DEFINE_string, "preset", "small", "Named preset from twinshard.config (tiny, small, gpt2_125m, ...).")
common.define(flags.DEFINE_string, "topology", None, "Chips to plan for: a TPU slice v5p:4x4x4, v5e:16x16, v4:2x2x4 "
              "or GPU nodes x GPUs per node h100:8x8, h200:1x8.")
common.define(flags.DEFINE_integer, "batch_size", None, "Global batch size in sequences (default: the preset's).")
common.define(flags.DEFINE_integer, "context_length", None, "Sequence length (default: the preset's context_length).")
common.define(flags.DEFINE_string, "json", None, "Write the plans as JSON to this path.")
common.define(flags.DEFINE_enum, "optimizer", "adamw", OPTIMIZERS, "The optimizer whose state the memory counts "
              "(adamw: 2 moments, lion and sgd with momentum: 1, adafactor: factored second moments).")
common.define_precision_flags()  # --dtype (the peak and the activation bytes), --remat, ...
flags.DEFINE_integer("slices", 1, "TPU slices of --topology, data parallel over the data-center network "
                     "(each chip's gradients all-reduced with its counterparts; the batch split over the slices).")
flags.DEFINE_enum("param_dtype", "float32", COMPUTE_DTYPES, "Params and gradients in memory (float32: what "
                  "launch.train keeps; bfloat16: a mixed-precision trainer's weights).")
flags.DEFINE_enum("optimizer_dtype", "float32", COMPUTE_DTYPES, "The optimizer state in memory.")
flags.DEFINE_bool("master_weights", False, "Count a float32 master copy of the params besides (mixed precision "
                  "with --param_dtype=bfloat16: 2 + 2 + 4 + 8 bytes per parameter under AdamW).")
flags.DEFINE_integer("top", 10, "Ranked plans to print.")
flags.DEFINE_float("mfu", None, "Fraction of the peak FLOP/s the matmuls reach (default: the chip's measured "
                   "matmul efficiency, twinshard/hardware/chips.py EFFICIENCIES; 1, the peak, for a chip with none).")
flags.DEFINE_float("hbm_headroom", 0.25, "Fraction of each chip's HBM the model's estimate leaves free: "
                   "XLA's own peak was 21-34% above it (measured with --compile).")
flags.DEFINE_enum("rank_by", RANK_BY[0], RANK_BY, "Rank by the step time without overlap "
                  "(compute + communication) or with perfect overlap (the largest of them).")
flags.DEFINE_bool("compile", False, "Compile the best TPU plans ahead of time for --topology (needs libtpu) "
                  "and print their collectives, memory_analysis and predicted step beside the model.")
flags.DEFINE_integer("compile_top", 3, "With --compile: how many of the best plans launch.train runs are compiled "
                     "and ranked again by their compiled step's prediction.")
FLAGS = flags.FLAGS

# ----------------------------------------------------------------------------- text


def _ms(s: float) -> str:
    return "-" if not s else f"{1e3 * s:.1f} ms" if s >= 1e-4 else f"{1e6 * s:.2f} us"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def plan_table(plans: list[Plan], topo: Topology, cfg: ModelConfig, batch: int) -> str:
    """One row per plan; a communication column per mesh axis some listed plan splits (> 1), and DCN's."""
    axes = [a for a in mesh_lib.ORDER if any(p.mesh.get(a, 1) > 1 for p in plans)] + ["dcn"] * (topo.slices > 1)
    head = ("rank", "strategy", "mesh", "memory/chip", "of HBM", "compute", *(f"comm {a}" for a in axes),
            "step overlap", "step serial", "bound", "tokens/s (serial)")
    rows = [(str(i), p.layout, p.label(), human(p.memory), f"{p.memory / topo.chip.hbm_bytes:.0%}",
             _ms(p.compute_s), *(_ms(p.comm_s.get(a, 0.0)) for a in axes), _ms(p.overlap_s),
             _ms(p.serial_s), p.bound, f"{batch * cfg.context_length / p.serial_s:,.0f}")
            for i, p in enumerate(plans, 1)]
    return "\n".join(cost.format_table(head, rows))


def _breakdown(p: Plan) -> str:
    m = p.cost.memory
    master = f" + master copy {human(m.master)}" if m.master else ""
    gathered = f" + gathered layer {human(m.gathered_weights)}" if m.gathered_weights else ""
    return (f"params {human(m.params)} + grads {human(m.grads)}{master} + optimizer {human(m.optimizer)} + "
            f"activations {human(m.activations)} + backward layer {human(m.backward_layer)}{gathered}")


def schedule_section(plans: list[Plan], rank_by: str) -> list[str]:
    """One pipeline mesh's schedules side by side (hardware.plan.pipeline_schedules): each one's bubble (its
    table's idle share), compute factor (pipeline_factor), activations in flight, memory and step; and the
    schedule named for the shape: the fastest that fits."""
    head = ("schedule", "M", "bubble", "compute x", "activations", "memory/chip", "fits", f"step {rank_by}")
    rows = [(p.schedule + (f" V={p.virtual}" if p.virtual > 1 else ""), str(p.microbatches), f"{float(p.bubble):.1%}",
             f"{pipeline_factor(p.microbatches, p.mesh['stage'], p.schedule, p.virtual):.3f}",
             human(p.cost.memory.activations), human(p.memory), "yes" if p.fits else "no", _ms(p.step_s(rank_by)))
            for p in plans]
    best = next((p for p in plans if p.fits), None)
    return [f"== pipeline schedules on {plans[0].layout} {plans[0].mesh_text()}, the best pipeline mesh (each with "
            "its best M) ==", *cost.format_table(head, rows),
            f"best schedule for this shape: {best.schedule}" + (f" V={best.virtual}" if best.virtual > 1 else "") +
            f" M={best.microbatches}" if best else "no schedule fits in memory"]


def report(fit: list[Plan], over: list[Plan], skipped: list[Skipped], topo: Topology, name: str, cfg: Config,
           top: int, mfu: float, headroom: float, rank_by: str, precision: Precision = Precision(),
           mfu_why: str = "given") -> str:
    m, chip, batch = cfg.model, topo.chip, cfg.train.batch_size
    peak, which = matmul_peak_flops(chip, m.dtype)
    out = [f"{_count(m.num_params())}-parameter model, batch {batch} x {m.context_length} tokens, "
           f"{m.dtype} compute, on {topo.describe()}",
           f"chip {chip.name}: {chip.hbm_bytes / chips.GIB:g} GiB HBM ({human(chip.hbm_bytes * (1 - headroom))} usable at "
           f"--hbm_headroom={headroom:g}); peak {peak / 1e12:g} TFLOP/s {which}, at --mfu={mfu:g} ({mfu_why})",
           f"sources: {chip.source}; {chip.network_source}", ""]
    if fit:
        out += [f"== plans that fit, ranked by the {rank_by} step time (lower bounds: peak FLOP/s x mfu, "
                "full link rate, latency ignored) ==", plan_table(fit[:top], topo, m, batch)]
        if len(fit) > top:
            out.append(f"... {len(fit) - top} more (--top)")
        best = fit[0]
        out += ["", f"links of the best plan ({best.layout} {best.label()}):"]
        out += [f"  {axis}={best.mesh.get(axis, best.slices)}: {link.what} = {link.bytes_per_s / GB:.4g} GB/s per chip"
                + (f"; all-to-all x {link.all_to_all:.3g} (its messages cross several links)"
                   if link.all_to_all != 1 and _has_all_to_all(best, axis) else "")
                for axis, link in best.links.items()]
        out += [f"  memory: {_breakdown(best)}"]
    else:
        out.append("== no plan fits in memory: more chips, --dtype=bfloat16, a smaller --batch_size or "
                   "--context_length would help ==")
    schedules = pipeline_schedules(fit, over)  # shown whether or not a plan fits: which schedule comes closest
    if schedules:
        out += ["", *schedule_section(schedules, rank_by)]
    if over:
        out += ["", "== too big for HBM =="]
        out += [f"{p.strategy} {p.label()}: needs {human(p.memory)} > {human(p.hbm_usable)} usable "
                f"({_breakdown(p)})" for p in over]
    if skipped:
        out += ["", "== meshes the model does not split on =="]
        out += [f"{s.strategy} {s.mesh_text()}: {s.why}" for s in skipped]
    if m.num_experts:  # why Megatron, context and pipelines are missing (a dense model's refusals: --json only)
        out += ["", "== strategies a mixture of experts does not run under =="]
        out += [f"{name}: {why}" for name, why in runnable(m)[1].items()]
    if chip.max_slice_chips and topo.chips > chip.max_slice_chips:
        out += ["", f"NOTE: {topo.chips} chips is more than the largest single-slice job Google schedules on "
                    f"{chip.name} ({chip.max_slice_chips} chips); planned as the whole ICI-connected grid."]
    if any(p.flat for p in fit + over):
        out += ["", "NOTE: 'flat' plans split FSDP's weights flat, padded to a multiple of data (data does not "
                    "divide d_model: twinshard/hardware/plan.py); launch.train splits d_model and refuses their "
                    "meshes."]
    if not precision.is_default:
        out += ["", f"NOTE: params in {precision.params}, optimizer state in {precision.optimizer}"
                    f"{', a float32 master copy' if precision.master else ''}: launch.train keeps float32 params "
                    "and state, so its run of the launch line below needs the default's memory."]
    if fit:
        out += ["", *launch_section(fit, topo, name, cfg)]
    return "\n".join(out)


def launch_section(fit: list[Plan], topo: Topology, name: str, cfg: Config) -> list[str]:
    """The launch line of the best plan launch.train runs as planned (Plan.runnable)."""
    if topo.slices > 1:
        return ["== launch.train builds one slice's mesh; a multi-slice run needs its data axis over the slices "
                "(jax.experimental.mesh_utils.create_hybrid_device_mesh; --compile compiles the best dp, hsdp and "
                "fsdp plans so, launch/slices.py) =="]
    best = next((p for p in fit if p.runnable), None)
    if best is None:
        return ["== no plan that fits is one launch.train runs (all are flat) =="]
    which = "the best plan" if best is fit[0] else f"the best plan launch.train runs ({best.strategy} {best.label()})"
    return [f"== run {which}: the same command on every host (jax.distributed finds the others) ==",
            *launch_commands(best, topo, name, cfg)]


def _has_all_to_all(p: Plan, axis: str) -> bool:
    return any(op == "all-to-all" and axis in axes for op, axes in p.cost.summary())


def train_flags(plan: Plan, name: str, cfg: Config) -> str:
    """launch.train's flags for this plan on preset `name` (and what the flags changed in it: every
    model field of common.MODEL_FLAGS that differs from the preset's, so launch.train trains the
    model that was planned)."""
    base = preset(name)
    model = [(k, getattr(cfg.model, k), getattr(base.model, k)) for k in common.MODEL_FLAGS
             if k not in ("collective_matmul", "tp_overlap_chunks")]  # their strategies' alone, below
    extra = [f"--{k}={v}" for k, v, d in (
        ("batch_size", cfg.train.batch_size, base.train.batch_size), *model,
        ("optimizer", cfg.train.optimizer, base.train.optimizer),
        ("microbatches", plan.microbatches, base.train.microbatches),
        ("schedule", plan.schedule, base.train.schedule),
        ("virtual_stages", plan.virtual, base.train.virtual_stages)) if v != d]
    extra += ["--collective_matmul"] * (plan.strategy == "tp_sp" and cfg.model.collective_matmul)
    if plan.strategy in support.with_option("tp_overlap") and cfg.model.tp_overlap_chunks > 1:
        extra.append(f"--tp_overlap_chunks={cfg.model.tp_overlap_chunks}")
    return " ".join([f"--preset={name}", f"--strategy={plan.strategy}", "--impl=manual",
                     f"--mesh={plan.mesh_text()}", *extra, "--distributed", "--workdir=WORKDIR"])


def launch_commands(plan: Plan, topo: Topology, name: str, cfg: Config) -> list[str]:
    """The launch line for this topology (README, "Multi-host": the setup that precedes it)."""
    train = f"python -m launch.train {train_flags(plan, name, cfg)}"
    if topo.chip.is_tpu:
        return [f'gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command="cd twinshard && '
                f'uv run --locked --extra tpu {train}"']
    nodes, per_node = topo.grid
    return [f"srun --nodes={nodes} --ntasks-per-node={per_node} --gpus-per-node={per_node} .venv/bin/{train}"]


def as_dict(fit: list[Plan], over: list[Plan], skipped: list[Skipped], topo: Topology, name: str, cfg: Config,
            mfu: float, headroom: float, rank_by: str, precision: Precision = Precision()) -> dict:
    def one(p: Plan, rank_: int | None) -> dict:
        return {"rank": rank_, "strategy": p.strategy, "layout": p.layout, "across": p.across, "mesh": p.mesh,
                "microbatches": p.microbatches, "schedule": p.schedule, "virtual_stages": p.virtual,
                "bubble": float(p.bubble), "flat": p.flat, "slices": p.slices, "fits": p.fits,
                "memory": {**dataclasses.asdict(p.cost.memory), "total": p.memory}, "hbm_usable": p.hbm_usable,
                "compute_s": p.compute_s, "comm_s": p.comm_s, "overlap_s": p.overlap_s, "serial_s": p.serial_s,
                "bound": p.bound, "flops_per_chip": p.cost.flops.per_device,
                "ring_bytes": {",".join(a): s["ring_bytes"] for a, s in p.cost.by_axes().items()},
                "links": {a: {"bytes_per_s": link.bytes_per_s, "what": link.what, "all_to_all": link.all_to_all,
                              "hop_bytes_per_s": link.hop_bytes_per_s} for a, link in p.links.items()}}

    peak, which = matmul_peak_flops(topo.chip, cfg.model.dtype)
    return {"preset": name, "topology": topo.name, "chips": topo.chips, "slices": topo.slices, "grid": list(topo.grid),
            "torus": topo.torus, "chip": dataclasses.asdict(topo.chip), "batch_size": cfg.train.batch_size,
            "seq_len": cfg.model.context_length, "dtype": cfg.model.dtype,
            "assumptions": {"peak_flops": peak, "peak": which, "mfu": mfu, "hbm_headroom": headroom,
                            "rank_by": rank_by, "optimizer": f"{cfg.train.optimizer} ({precision.optimizer} state)",
                            "precision": dataclasses.asdict(precision), "latency": "ignored"},
            "plans": [one(p, i) for i, p in enumerate(fit, 1)] + [one(p, None) for p in over],
            "skipped": [{"strategy": s.strategy, "mesh": s.mesh, "why": s.why} for s in skipped],
            "refused": runnable(cfg.model)[1],
            "launch": launch_section(fit, topo, name, cfg)[1:] if fit else []}


# ----------------------------------------------------------------------------- --compile


def compile_plan(plan: Plan, topo: Topology, cfg: Config) -> tuple[str, dict]:
    """Compile the plan's manual train step for the TPU slice and predict its step from the compiled
    program (twinshard.hlo.predict); text and JSON-ready numbers."""
    from launch import collectives
    from twinshard.hardware import topology

    topology.default_to_cpu()  # libtpu installed, no TPU here: do not probe it (it prints errors)
    devices = topology.devices(topo.name)
    train = dataclasses.replace(cfg.train, microbatches=plan.microbatches, schedule=plan.schedule,
                                virtual_stages=plan.virtual)
    res = collectives.collectives(plan.strategy, "manual", plan.mesh_text(), dataclasses.replace(cfg, train=train),
                                  devices)
    pred = collectives.predict_step(res, topo)
    ma = res["memory"]["analysis"]
    peak = (ma["argument_size_in_bytes"] + ma["output_size_in_bytes"] - ma["alias_size_in_bytes"]
            + ma["temp_size_in_bytes"])
    verdict = "fits" if peak <= topo.chip.hbm_bytes else "does NOT fit"
    table = cost.compare_table(res["tpu_comparison"] or res["comparison"])
    text = "\n".join([
        f"== compiled ahead of time: {plan.strategy}/manual {plan.label()} on {res['device_kind']} "
        f"({res['hosts']} hosts) in {res['compile_s']:.1f} s ==",
        "collectives of the compiled step vs the model (as the TPU compiler prints the manual twin):", table,
        "", "memory per chip: compiled.memory_analysis() beside the model", collectives.memory_table(res),
        f"XLA's peak per chip: arguments + outputs - aliased + temporaries = {human(peak)} of "
        f"{topo.chip.hbm_bytes / chips.GIB:g} GiB HBM: {verdict} (the model said {human(plan.memory)})",
        "", "the compiled step's schedule priced on the chip (twinshard.hlo.predict):", pred.table()])
    axes = {a: dataclasses.asdict(t) for a, t in pred.axes.items()}
    return text, {"strategy": plan.strategy, "mesh": plan.mesh, "compile_s": res["compile_s"],
                  "compiler_options": res["compiler_options"], "memory_analysis": ma, "peak_bytes": peak,
                  "fits": peak <= topo.chip.hbm_bytes, "comparison": res["tpu_comparison"] or res["comparison"],
                  "predicted": {"step_s": pred.step_s, "compute_s": pred.compute_s, "exposed_s": pred.exposed_s,
                                "axes": axes, "rates": {"matmul_efficiency": pred.rates.matmul_efficiency,
                                                "hbm_efficiency": pred.rates.hbm_efficiency,
                                                "source": pred.rates.source}}}


def refined_table(compiled: list[tuple[int, Plan, dict]], rank_by: str) -> str:
    """The compiled plans ranked by their predicted step: the model's step beside the compiled
    program's, its compute and each mesh axis's exposed communication."""
    axes = [a for a in (*mesh_lib.ORDER, "dcn") if any(a in doc["predicted"]["axes"] for _, _, doc in compiled)]
    head = ("rank", "plan", "strategy", "mesh", f"model ({rank_by})", "predicted step", "compute+memory",
            *(f"exposed {a}" for a in axes), "exposed", "XLA peak")
    rows = []
    for i, (rank_, p, doc) in enumerate(compiled, 1):
        pr = doc["predicted"]
        rows.append((str(i), str(rank_), p.layout, p.label(), _ms(p.step_s(rank_by)), _ms(pr["step_s"]),
                     _ms(pr["compute_s"]),
                     *(_ms(pr["axes"][a]["exposed_s"]) if a in pr["axes"] else "-" for a in axes),
                     f"{pr['exposed_s'] / pr['step_s']:.0%}",
                     human(doc["peak_bytes"]) + ("" if doc["fits"] else " (too big)")))
    return "\n".join(cost.format_table(head, rows))


def _compilable(p: Plan, topo: Topology) -> bool:
    """launch.train runs it (one slice), or launch/slices.py compiles it (dp, hsdp, fsdp across slices)."""
    if topo.slices == 1:
        return p.runnable
    return p.strategy in ("dp", "fsdp") and not p.flat


def compile_top(fit: list[Plan], topo: Topology, cfg: Config, n: int, rank_by: str) -> tuple[str, list[dict]]:
    """Compile the n best plans launch.train runs (across slices: the best dp, hsdp and fsdp plans, the auto
    twin's, launch/slices.py); re-rank them by the compiled program's predicted step."""
    from launch import slices

    chosen = [(i, p) for i, p in enumerate(fit, 1) if _compilable(p, topo)][:n]
    if not chosen:
        raise ValueError("--compile: no plan launch.train runs fits in memory, so there is nothing to compile.")
    texts, compiled = [], []
    for rank_, p in chosen:
        print(f"\ncompiling plan {rank_} ({p.layout} {p.label()}) for {topo.name} ahead of time (a minute or "
              "so) ...", flush=True)
        text, doc = (compile_plan(p, topo, cfg) if topo.slices == 1 else
                     slices.compiled_report(p, topo, slices.compile_step(p, topo, cfg)))
        print(text, flush=True)
        compiled.append((rank_, p, {"plan_rank": rank_, **doc}))
    compiled.sort(key=lambda c: (not c[2]["fits"], c[2]["predicted"]["step_s"]))
    eff = compiled[0][2]["predicted"]["rates"]
    text = "\n".join([
        "", f"== the {len(compiled)} best plans compiled, ranked by the compiled step's prediction (twinshard.hlo.predict: "
        f"matmul {eff['matmul_efficiency']:g}, hbm {eff['hbm_efficiency']:g} of the peaks, {eff['source']}; "
        "communication that compute hides costs nothing) ==", refined_table(compiled, rank_by)])
    return text, [doc for _, _, doc in compiled]


# ----------------------------------------------------------------------------- main


def config_from_flags() -> Config:
    if FLAGS.preset not in PRESETS:
        raise ValueError(f"--preset={FLAGS.preset}: unknown preset; choose one of {', '.join(PRESETS)}.")
    if FLAGS.batch_size is not None and FLAGS.batch_size < 1:
        raise ValueError(f"--batch_size={FLAGS.batch_size} must be >= 1; drop it for the preset's value.")
    cfg = preset(FLAGS.preset)
    if FLAGS.batch_size is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=FLAGS.batch_size))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer=FLAGS.optimizer))
    return common.with_model_flags(cfg, FLAGS)  # the model flags, --context_length among them


def matmul_fraction(chip: chips.Chip, asked: float | None) -> tuple[float, str]:
    """(the fraction of the peak the matmuls reach, where it comes from): --mfu when given, else the
    matmul efficiency measured on `chip` (chips.EFFICIENCIES), else 1.0, the datasheet peak."""
    if asked is not None:
        return asked, "given"
    if chip.name not in chips.EFFICIENCIES:
        return 1.0, f"no matmul efficiency measured on {chip.name}: the datasheet peak; --mfu sets one"
    measured = chips.efficiency(chip)
    return measured.matmul_efficiency, f"the matmul efficiency measured on {chip.name}: {measured.source}"


def check_flags(topo: Topology) -> None:
    if FLAGS.top < 1:
        raise ValueError(f"--top={FLAGS.top} must be >= 1.")
    if FLAGS.compile_top < 1:
        raise ValueError(f"--compile_top={FLAGS.compile_top} must be >= 1: the number of best plans to compile.")
    if FLAGS.mfu is not None and not 0 < FLAGS.mfu <= 1:
        raise ValueError(f"--mfu={FLAGS.mfu} must be in (0, 1]: the fraction of the peak FLOP/s reached.")
    if not 0 <= FLAGS.hbm_headroom < 1:
        raise ValueError(f"--hbm_headroom={FLAGS.hbm_headroom} must be in [0, 1): the fraction of HBM kept free.")
    if FLAGS.master_weights and FLAGS.param_dtype == "float32":
        raise ValueError("--master_weights counts a float32 copy of narrower params: pass --param_dtype=bfloat16 "
                         "too, or drop it (float32 params are their own master).")
    if FLAGS.compile and not topo.chip.is_tpu:
        raise ValueError(f"--compile is not available for GPU topologies ({topo.name}): compiling for a GPU "
                         "needs the GPU itself; drop --compile, or plan a TPU slice.")
    common.check_output_path(FLAGS.json, "json")


def check_batch_slices(batch: int, slices: int) -> None:
    """Each slice runs batch / slices sequences: one line naming both and the fix where it does not divide."""
    if batch % slices:
        near = [b for b in (batch - batch % slices, batch - batch % slices + slices) if b > 0]
        raise ValueError(f"--batch_size={batch} does not split over --slices={slices}: pass a multiple of {slices} "
                         f"(e.g. {' or '.join(map(str, near))}).")


def no_plan(skipped: list[Skipped], topo: Topology, batch: int) -> str:
    reasons = "; ".join(f"{s.strategy} {s.mesh_text()}: {s.why}" for s in skipped)
    fix = (f"pass a --batch_size divisible by the data axis (e.g. {topo.chips * topo.slices}) or plan fewer chips"
           if any(s.why.startswith("batch=") for s in skipped) else "plan fewer chips or a wider model")
    return f"no strategy splits this model with batch {batch} over {topo.chips} chips ({reasons}); {fix}."


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    if not FLAGS.topology:
        raise ValueError("--topology is required, e.g. --topology=v5p:4x4x4 (TPU) or --topology=h100:8x8 (GPU).")
    topo = with_slices(parse_topology(FLAGS.topology), FLAGS.slices)
    cfg = config_from_flags()
    check_flags(topo)
    check_batch_slices(cfg.train.batch_size, topo.slices)
    precision = Precision(FLAGS.param_dtype, FLAGS.optimizer_dtype, FLAGS.master_weights)
    mfu, mfu_why = matmul_fraction(topo.chip, FLAGS.mfu)
    plans, skipped = plan_all(cfg.model, topo, cfg.train.batch_size, mfu, FLAGS.hbm_headroom,
                              cfg.train.optimizer, precision, FLAGS.rank_by)
    if not plans:
        raise ValueError(no_plan(skipped, topo, cfg.train.batch_size))
    fit, over = rank(plans, FLAGS.rank_by)
    args = (fit, over, skipped, topo, FLAGS.preset, cfg)
    print(report(*args, FLAGS.top, mfu, FLAGS.hbm_headroom, FLAGS.rank_by, precision, mfu_why), flush=True)
    doc = as_dict(*args, mfu, FLAGS.hbm_headroom, FLAGS.rank_by, precision)
    doc["assumptions"]["mfu_from"] = mfu_why
    if FLAGS.compile:
        text, doc["compiled"] = compile_top(fit, topo, cfg, FLAGS.compile_top, FLAGS.rank_by)
        print(text)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {FLAGS.json}")
    return 0


if __name__ == "__main__":
    common.run(main, "launch.plan")
