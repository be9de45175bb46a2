"""Compile a strategy's train step ahead of time; set its collectives beside the cost model.

    python -m launch.collectives --strategy=fsdp --impl=auto --mesh=data:8,tensor:1 --preset=tiny
    python -m launch.collectives --strategy=fsdp_tp --mesh=data:2,tensor:4 --json=out.json --hlo=step.hlo
    python -m launch.collectives --strategy=fsdp --mesh=data:16,tensor:1 --topology=v5e:4x4   # needs libtpu

Nothing runs: the train step is lowered on abstract inputs (ShapeDtypeStructs
carrying the strategy's shardings) and compiled. The collective ledger of the
compiled HLO (twinshard/hlo.py) is printed, then the analytic model
(twinshard/cost.py), then one line per (op, mesh axes) with measured/model
count, bytes and ring bytes, and totals per axis.

On CPU the step is compiled for `--devices` simulated devices (8). With
`--topology` it is compiled for a TPU pod that is not here (DESIGN.md:
`jax.experimental.topologies.get_topology_desc`), which needs libtpu
(`uv sync --extra tpu`).

The model describes the manual (shard_map) twin's collectives. GSPMD is free
to choose differently; in particular XLA:CPU never emits reduce-scatter for
GSPMD (it writes an all-reduce of the full gradient + dynamic-slice), so the
auto rows differ from the model there, and the output says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

from absl import app, flags, logging

from launch import common

flags.DEFINE_string("json", None, "Write ledger, model and comparison as JSON to this path.")
flags.DEFINE_string("hlo", None, "Write the compiled (optimized) HLO text to this path.")
flags.DEFINE_string("topology", None, "Compile for a TPU topology instead of CPU, e.g. v5e:4x4 "
                    "(needs libtpu: uv sync --extra tpu).")
flags.DEFINE_string("chips_per_host_bounds", "2,2,1", "With --topology: chips per host, x,y,z.")
flags.DEFINE_integer("devices", 8, "Simulated CPU devices (ignored with --topology).")
common.define_model_flags()
FLAGS = flags.FLAGS

CPU_REDUCE_SCATTER_NOTE = (
    "XLA:CPU never emits reduce-scatter for GSPMD: the auto twin's gradient reduce-scatter over "
    "data is an all-reduce of the FULL gradient followed by a dynamic-slice. So on CPU the auto "
    "ledger shows no reduce-scatter rows and extra all-reduce bytes over data (each model "
    "reduce-scatter of r bytes appears as an all-reduce of r x |data| bytes). The manual twin "
    "(psum_scatter) shows a real reduce-scatter on every backend.")


AUTO_NOTE = (
    "The model describes the manual (shard_map) twin. GSPMD chooses its own plan, so auto rows may "
    "differ: measured on XLA:CPU (JAX 0.12), it keeps FSDP-gathered weights for the backward pass "
    "instead of re-gathering them, all-reduces the TP input gradients of q, k, v (and w1, w3) "
    "separately instead of summing them first, and reduces the squared gradient norm leaf by leaf.")


def _check_output_path(path: str | None, flag: str) -> None:
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"--{flag}={path}: directory {os.path.dirname(os.path.abspath(path))} does not "
                         "exist; create it or pick another path.")


def _topology_devices(name: str):
    """Devices of a TPU pod that is not here (AOT only). Needs libtpu."""
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(f"--topology={name} needs libtpu, which is not installed: install the tpu "
                         "extra: uv sync --extra tpu (or drop --topology to compile for CPU).")
    from jax.experimental import topologies

    bounds = tuple(int(x) for x in FLAGS.chips_per_host_bounds.split(","))
    chip_config = "megacore" if name.startswith(("v4", "v5p")) else "default"
    topo = topologies.get_topology_desc(
        topology_name=name, platform="tpu", chip_config_name=chip_config,
        chips_per_host_bounds=bounds, num_slices=1, wrap=(False,) * 3)
    return list(topo.devices)


def _runner(strategy: str, impl: str, mesh_spec: str | None, cfg, devices):
    """The runner, for CPU (launch.common) or for topology devices (mesh ordered by mesh_utils)."""
    try:
        if devices is None:
            return common.make_runner(strategy, impl, mesh_spec, cfg)
        from jax.experimental import mesh_utils

        from twinshard import mesh as mesh_lib

        if mesh_spec is None:
            mesh_spec = ",".join(f"{a}:{n}" for a, n in
                                 mesh_lib.default_mesh(strategy, len(devices)).items())
        shape = mesh_lib.parse_mesh(mesh_spec)
        mesh_lib.check_mesh(strategy, shape, len(devices))
        ordered = mesh_utils.create_device_mesh(tuple(shape[a] for a in mesh_lib.AXES), devices).ravel()
        if impl == "auto":
            from auto_parallel import make_runner
        else:
            from manual_parallel import make_runner
        return make_runner(strategy, mesh_spec, cfg, devices=list(ordered))
    except ImportError as e:
        if impl != "manual":
            raise
        raise ValueError(f"--impl=manual: the shard_map twin could not be imported ({e}); it may not "
                         "exist yet in this checkout. Use --impl=auto.") from e


def collectives(strategy: str, impl: str, mesh_spec: str | None, cfg, devices=None) -> dict:
    """Compile the train step AOT; return ledger, model, comparison, notes, HLO text, timings."""
    import jax

    from twinshard import cost, hlo

    runner = _runner(strategy, impl, mesh_spec, cfg, devices)
    mesh = {a: int(n) for a, n in runner.mesh.shape.items()}
    model = cost.cost(cfg.model, strategy, mesh, cfg.train.batch_size, cfg.model.context_length)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), jax.numpy.int32,
                                  sharding=runner.batch_sharding)
    t0 = time.perf_counter()
    compiled = runner.train_step.lower(runner.abstract_state(), tokens, tokens).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    led = hlo.ledger(text, runner.mesh)
    platform = runner.mesh.devices.flat[0].platform
    notes = list(model.notes)
    has_rs = any(r.op == "reduce-scatter" for r in model.collectives)
    if impl == "auto":
        notes[:0] = [AUTO_NOTE] + ([CPU_REDUCE_SCATTER_NOTE] if platform == "cpu" and has_rs else [])
    return {"strategy": strategy, "impl": impl, "mesh": mesh, "platform": platform,
            "batch_size": cfg.train.batch_size, "seq_len": cfg.model.context_length,
            "compile_s": compile_s, "ledger": led, "model": model,
            "comparison": cost.compare(led.summary(), model.summary()), "notes": notes, "hlo": text}


def report(res: dict) -> str:
    from twinshard import cost

    mesh = ",".join(f"{a}:{n}" for a, n in res["mesh"].items())
    title = (f"{res['strategy']}/{res['impl']} on {res['platform']} mesh {mesh}, batch "
             f"{res['batch_size']}x{res['seq_len']} (compiled in {res['compile_s']:.1f}s)")
    out = [title,
           "", "== measured: collectives of the compiled train step (ledger) ==", res["ledger"].table(),
           "", "== model: twinshard.cost (what the manual twin does) ==", res["model"].table(),
           "", "== measured vs model, per (op, axes) ==", cost.compare_table(res["comparison"])]
    out += ["", *(f"NOTE: {n}" for n in res["notes"])] if res["notes"] else []
    return "\n".join(out)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # jax logs each backend it cannot open at INFO
    if FLAGS.strategy == "single":
        raise ValueError("--strategy=single has no collectives; choose one of dp, fsdp, tp, fsdp_tp.")
    cfg = common.config_from_flags(FLAGS)
    _check_output_path(FLAGS.json, "json")
    _check_output_path(FLAGS.hlo, "hlo")
    devices = None
    if FLAGS.topology:
        devices = _topology_devices(FLAGS.topology)
    else:
        common.simulate_cpu_devices(FLAGS.devices)  # before jax initialises its backend
    res = collectives(FLAGS.strategy, FLAGS.impl, FLAGS.mesh, cfg, devices)
    print(report(res))
    if FLAGS.hlo:
        with open(FLAGS.hlo, "w") as f:
            f.write(res["hlo"])
        print(f"wrote HLO to {FLAGS.hlo}")
    if FLAGS.json:
        doc = {k: v for k, v in res.items() if k not in ("ledger", "model", "hlo")}
        doc.update(preset=FLAGS.preset, ledger=res["ledger"].as_dict(), model=res["model"].as_dict())
        with open(FLAGS.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote JSON to {FLAGS.json}")
    return 0


if __name__ == "__main__":
    app.run(main)
