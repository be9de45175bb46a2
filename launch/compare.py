"""Run single-device, auto (GSPMD), manual (shard_map) and explicit (sharding in types) training
side by side (each twin that writes the strategy: twinshard/parallel/support.py).

    python -m launch.compare --strategy=fsdp_tp --mesh=data:2,tensor:4 --preset=tiny --steps=10 \
        --plot=compare.png --json=compare.json

All three start from the same init (same seed) and see the same batches of the
preset's corpus. Prints per-step losses, the largest gradient difference at
step 1 and parameter difference at the end, and each twin's collective ledger
beside the analytic cost model.
"""

from __future__ import annotations

import json
from typing import Any

from absl import flags, logging

from launch import common, fit

common.define(flags.DEFINE_string, "json", None, "Write the comparison as JSON here.")
common.define(flags.DEFINE_string, "plot", None, "Write a PNG of the loss curves and their differences here.")
common.define_model_flags()
common.define_data_flags()
FLAGS = flags.FLAGS


def _batches(cfg, steps: int):
    from twinshard.train import data

    train, _ = common.load_splits(cfg, FLAGS.data, FLAGS.cache_dir)
    t = cfg.train
    return [data.get_batch(train, t.batch_size, cfg.model.context_length, t.seed, s) for s in range(steps)]


def _max_abs_diff(a, b) -> float:
    import jax
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def twins(strategy: str) -> tuple[str, ...]:
    """The twins that write `strategy` (twinshard/parallel/support.py)."""
    from twinshard.parallel import support

    return support.get(strategy).twins


def run_twins(strategy: str, mesh_spec: str | None, cfg, batches, devices=None,
              dcn_spec: str | None = None) -> tuple[dict, Any]:
    """Train single and every twin of `strategy` on `batches` (the twins on `devices`, None: all);
    return (losses, diffs and ledgers; the twins' resolved run, for the cost model)."""
    import jax
    import numpy as np

    from twinshard import hlo

    impls = ("single", *twins(strategy))
    runs = {"single": common.resolve_run("single", "single", None, cfg)}  # the reference, on one device
    runs.update({impl: common.resolve_run(strategy, impl, mesh_spec, cfg, devices, dcn_spec=dcn_spec)
                 for impl in impls[1:]})
    for impl, run in runs.items():  # every step checked against the device's memory before any runs
        fit.check_model(run)
    runners = {impl: common.runner_of(run) for impl, run in runs.items()}
    for impl, r in runners.items():
        fit.check_step(r, runs[impl])
    out: dict = {"strategy": strategy, "mesh": dict(runners["manual"].sizes), "losses": {}, "ledgers": {}}
    params, grads = {}, {}
    for impl, r in runners.items():
        state = r.init_state(cfg.train.seed)
        grads[impl] = jax.device_get(r.to_model(r.loss_and_grads(state.params, *r.place_batch(*batches[0]))[1]))
        losses = []
        for x, y in batches:
            state, m = r.train_step(state, *r.place_batch(x, y))
            losses.append(float(m["loss"]))
        out["losses"][impl], params[impl] = losses, jax.device_get(r.to_model(state.params))
        if impl != "single":
            xs = jax.ShapeDtypeStruct(np.shape(batches[0][0]), np.int32, sharding=r.batch_sharding)
            compiled = r.train_step.lower(r.abstract_state(), xs, xs).compile()
            out["ledgers"][impl] = hlo.ledger(compiled, r.mesh)
    for impl in impls[1:]:
        out[f"max_param_diff_{impl}_vs_single"] = _max_abs_diff(params[impl], params["single"])
        out[f"max_grad_diff_{impl}_vs_single"] = _max_abs_diff(grads[impl], grads["single"])
    out["max_param_diff_manual_vs_auto"] = _max_abs_diff(params["manual"], params["auto"])
    if "explicit" in params:
        out["max_param_diff_explicit_vs_manual"] = _max_abs_diff(params["explicit"], params["manual"])
    return out, runs["manual"]


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    losses = {k: np.asarray(v) for k, v in result["losses"].items()}
    steps = np.arange(1, len(losses["single"]) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    styles = {"single": ("k", "-", 3.0), "auto": ("tab:blue", "--", 1.8), "manual": ("tab:orange", ":", 1.8),
              "explicit": ("tab:green", "-.", 1.8)}
    for impl, curve in losses.items():
        color, ls, lw = styles[impl]
        top.plot(steps, curve, color=color, ls=ls, lw=lw, label=impl)
    top.set_ylabel("training loss")
    top.set_title(f"{result['strategy']} on mesh {result['mesh']}: single vs {' vs '.join(list(losses)[1:])}")
    top.legend()
    for impl in list(losses)[1:]:
        bottom.semilogy(steps, np.abs(losses[impl] - losses["single"]) + 1e-12,
                        color=styles[impl][0], marker="o", ms=3, label=f"|{impl} - single|")
    bottom.set_xlabel("step (points at the 1e-12 floor: bitwise equal)")
    bottom.set_ylabel("|loss difference|")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def model_comparison(result: dict, run) -> str:
    """The analytic cost model of `run` (the twins' resolved run) beside each twin's ledger, per (op, mesh axes)."""
    from twinshard import cost

    model = cost.of_run(run)
    parts = [model.table()]
    for impl, led in result["ledgers"].items():
        parts += ["", f"{impl} ledger vs cost model:", cost.compare_table(cost.compare(led.summary(), model.summary()))]
    return "\n".join(parts)


def report(result: dict, cost_table: str | None) -> str:
    impls = list(result["losses"])  # single, then the twins
    lines = [f"{'step':>5} " + " ".join(f"{impl:>10}" for impl in impls)]
    for i, row in enumerate(zip(*(result["losses"][k] for k in impls)), 1):
        lines.append(f"{i:5d} " + " ".join(f"{v:10.6f}" for v in row))
    for key in sorted(k for k in result if k.startswith("max_")):
        lines.append(f"{key}: {result[key]:.3e}")
    for impl, led in result["ledgers"].items():
        lines += ["", f"{impl} ledger:", led.table()]
    if cost_table:
        lines += ["", "cost model:", cost_table]
    return "\n".join(lines)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    common.default_platform()
    if FLAGS.strategy not in common.PARALLEL:  # single (strategies.SINGLE) is the reference itself
        raise ValueError(f"--strategy={FLAGS.strategy} has nothing to compare; pick one of {', '.join(common.PARALLEL)}.")
    cfg = common.config_from_flags(FLAGS)
    common.check_output_path(FLAGS.plot, "plot")  # before the run, not after it
    common.check_output_path(FLAGS.json, "json")
    common.check_writable_dir(FLAGS.cache_dir, "cache_dir")
    batches = _batches(cfg, FLAGS.steps or 10)  # the corpus is checked before jax starts
    common.simulate_cpu_devices(FLAGS.devices)
    devices = common.run_devices(FLAGS.devices, FLAGS["devices"].present)
    result, run = run_twins(FLAGS.strategy, FLAGS.mesh, cfg, batches, devices, FLAGS.dcn_mesh)
    print(report(result, model_comparison(result, run)))
    if FLAGS.plot:
        plot(result, FLAGS.plot)
        print(f"plot: {FLAGS.plot}")
    if FLAGS.json:
        serial = {k: v for k, v in result.items() if k != "ledgers"}
        serial["ledgers"] = {k: v.as_dict() for k, v in result["ledgers"].items()}
        with open(FLAGS.json, "w") as f:
            json.dump(serial, f, indent=1)
        print(f"json: {FLAGS.json}")


if __name__ == "__main__":
    common.run(main, "launch.compare")
