"""Train steps across TPU slices, compiled ahead of time: the devices of N slices as a [slices, chips]
grid, and the auto twin's (GSPMD) step on it with a `dcn` axis outermost, for launch.plan --compile
and tools/maxtext_slices.py.

Two layouts of an FSDP-family strategy over N slices of M chips (`step_lowered`):
- across=False (HSDP; dp inside a slice: plain data parallelism): the strategy's mesh inside each slice,
  the batch over (dcn, data), the weights replicated over `dcn`. XLA derives one collective across
  slices: each chip's gradient shards all-reduced with its counterparts.
- across=True (fsdp over every chip): the weights' d_model over (dcn, data) too. XLA:TPU compiles its
  collectives hierarchically (measured, libtpu 0.0.50.1, v5e:2x2 x 2): a weight's gather is an
  all-gather of the shards across slices, then inside the slice; a gradient's reduction a
  reduce-scatter inside the slice, then an all-reduce of that shard across slices.

A program compiled for several slices is one slice's program; what crosses slices is a megascale
transfer (twinshard/hlo/megascale.py), which the ledger charges to the `dcn` axis.
"""

from __future__ import annotations

import dataclasses
import functools

DCN_AXIS = "dcn"  # the mesh axis across slices, outermost


def hybrid_devices(topology_name: str, slices: int):
    """The topology's devices on `slices` slices as a [slices, chips] grid: slice i in row i
    (create_hybrid_device_mesh, the DCN axis outermost)."""
    from jax.experimental import mesh_utils

    from twinshard.hardware import topology

    devices = topology.devices(topology_name, num_slices=slices)
    per_slice = len(devices) // slices
    grid = mesh_utils.create_hybrid_device_mesh((1, per_slice), (slices, 1), devices)
    return grid.reshape(slices, per_slice)


def step_lowered(cfg, strategy: str, mesh: dict[str, int], grid, across: bool = False):
    """The auto twin's train step on `grid` [slices, chips]: `strategy` on `mesh` inside each slice,
    data parallel over the `dcn` axis (across: the weights' `data` split over (dcn, data) too; module
    docstring). Batch [slices x B, T] over (dcn, data), B = cfg's batch a slice; the state placed as one
    slice's run places it. Returns (lowered, the whole mesh {dcn, data, tensor})."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import auto_parallel
    from twinshard import placed
    from twinshard.model import layers
    from twinshard.parallel import mesh as mesh_lib, resolve
    from twinshard.train import optim, trainer

    slices = grid.shape[0]
    run = resolve.resolve_run(strategy, "auto", mesh_lib.mesh_str(mesh, strategy), cfg, list(grid[0]))  # one slice
    names = (DCN_AXIS, *run.mesh)
    whole = Mesh(grid.reshape(slices, *run.mesh.values()), names)
    batch_axes = (DCN_AXIS, run.placed.activations["batch"])
    rules = {**run.placed.activations, "batch": batch_axes}
    params = {k: (DCN_AXIS, a) if across and a == "data" else a for k, a in run.placed.params.items()}
    if across and params == run.placed.params:
        raise ValueError(f"--strategy={strategy} splits no weight over data: across slices it is data parallel "
                         "(across=False)")
    par = auto_parallel.MODULES[strategy].parallelism(whole, dataclasses.replace(
        run, placed=dataclasses.replace(run.placed, activations=rules)))
    tx = optim.make_optimizer(cfg.train)
    named = functools.partial(NamedSharding, whole)
    state_sh = jax.tree.map(named, placed.state_specs(cfg, tx, params), is_leaf=lambda x: isinstance(x, P))
    batch_sh = named(P(batch_axes, None))
    step = functools.partial(trainer.train_step, cfg=cfg.model, train_cfg=cfg.train, tx=tx, par=par)
    jitted = jax.jit(step, in_shardings=(state_sh, batch_sh, batch_sh), out_shardings=(state_sh, named(P())),
                     donate_argnums=0, compiler_options=trainer.compiler_options(cfg.model, "tpu", whole.devices.size))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         trainer.abstract_state(cfg.model, tx), state_sh)
    tokens = jax.ShapeDtypeStruct((slices * cfg.train.batch_size, cfg.model.context_length), jax.numpy.int32,
                                  sharding=batch_sh)
    with layers.compiling_for("tpu"):
        return jitted.lower(state, tokens, tokens), dict(zip(names, whole.devices.shape))




# ----------------------------------------------------------------------------- launch.plan --compile


def links_of(topo, mesh: dict[str, int]) -> dict:
    """mesh axis -> Link of a multi-slice mesh: one slice's axes on its ICI, `dcn` on the DCN (chips.py)."""
    from twinshard.hardware import links

    inside = {a: n for a, n in mesh.items() if a != DCN_AXIS}
    return {**links.axis_links(topo, inside), DCN_AXIS: links.dcn_link(topo)}


def compile_step(plan, topo, cfg) -> dict:
    """Compile a multi-slice plan of launch.plan (dp, hsdp, or fsdp across: `Plan.layout`) ahead of time
    for its slices of `topo`: the auto twin's step (`step_lowered`) on the global batch of `cfg`.
    Returns {hlo, mesh, compile_s, memory_analysis}."""
    import time

    from twinshard.hardware import measure, topology

    if topo.slices < 2 or plan.strategy not in ("dp", "fsdp") or plan.flat:
        raise ValueError(f"{plan.layout} {plan.label()}: across slices launch.plan compiles dp, hsdp and fsdp "
                         "plans whose data axis divides d_model")
    topology.default_to_cpu()
    inside = {"data": topo.chips, "tensor": 1} if plan.across else dict(plan.mesh)
    per_slice = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                   batch_size=cfg.train.batch_size // topo.slices))
    grid = hybrid_devices(topo.name, topo.slices)
    t0 = time.perf_counter()
    lowered, mesh = step_lowered(per_slice, plan.strategy, inside, grid, plan.across)
    compiled = topology.compile_for_pod(lowered)
    return {"hlo": compiled.as_text(), "mesh": mesh, "compile_s": time.perf_counter() - t0,
            "memory_analysis": measure.memory_analysis(compiled)}


def compiled_report(plan, topo, step: dict) -> tuple[str, dict]:
    """launch.plan --compile's text and JSON-ready numbers of a `compile_step`: the ledger per mesh axis
    (what crosses slices on `dcn`), XLA's peak memory and the predicted step (twinshard.hlo.predict)."""
    from twinshard import hlo
    from twinshard.cost import human
    from twinshard.hardware import step_time

    led = hlo.ledger(step["hlo"], step["mesh"])
    pred = step_time.predict_step(step["hlo"], topo.chip, step["mesh"], links_of(topo, step["mesh"]))
    ma = step["memory_analysis"]
    peak = (ma["argument_size_in_bytes"] + ma["output_size_in_bytes"] - ma["alias_size_in_bytes"]
            + ma["temp_size_in_bytes"])
    fits = peak <= topo.chip.hbm_bytes
    text = "\n".join([
        f"== compiled ahead of time: {plan.layout} {plan.label()} (the auto twin, dcn outermost) for {topo.describe()} "
        f"in {step['compile_s']:.1f} s ==",
        "collectives of the compiled step (one slice's program; dcn: the megascale transfers across slices):",
        led.table(), f"XLA's peak per chip: {human(peak)} of {topo.chip.hbm_bytes / 2**30:g} GiB HBM: "
        f"{'fits' if fits else 'does NOT fit'} (the model said {human(plan.memory)})",
        "", "the compiled step's schedule priced on the chip (twinshard.hlo.predict):", pred.table()])
    axes = {a: dataclasses.asdict(t) for a, t in pred.axes.items()}
    return text, {"strategy": plan.strategy, "layout": plan.layout, "mesh": step["mesh"],
                  "compile_s": step["compile_s"], "compiler_options": {}, "memory_analysis": ma, "peak_bytes": peak,
                  "fits": fits, "dcn_bytes": sum(r.bytes * r.multiplicity for r in led.filter(axes=DCN_AXIS)),
                  "predicted": {"step_s": pred.step_s, "compute_s": pred.compute_s, "exposed_s": pred.exposed_s,
                                "axes": axes, "rates": {"matmul_efficiency": pred.rates.matmul_efficiency,
                                                        "hbm_efficiency": pred.rates.hbm_efficiency,
                                                        "source": pred.rates.source}}}
