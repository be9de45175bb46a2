"""The GSPMD twin: each strategy is a placement table; XLA inserts the collectives."""

from __future__ import annotations

import jax
import optax

from auto_parallel import cp, dp, fsdp, fsdp_cp, fsdp_tp, pp, pp_fsdp, tp, tp_sp
from auto_parallel.runner import AutoRunner
from twinshard import context, mesh as mesh_lib, pipeline
from twinshard.placement import logical_dims
from twinshard.config import Config

STRATEGIES = {"dp": dp, "fsdp": fsdp, "tp": tp, "fsdp_tp": fsdp_tp, "tp_sp": tp_sp}
PIPELINES = {"pp": pp, "pp_fsdp": pp_fsdp}  # on a `stage` axis (twinshard/pipeline.py)
CONTEXT = {"cp": cp, "fsdp_cp": fsdp_cp}  # the sequence over a `context` axis (twinshard/context.py)
MODULES = {**STRATEGIES, **PIPELINES, **CONTEXT}  # every strategy's placement tables


def split_rules(module) -> dict[str, str]:
    """Every logical dim the strategy splits -> its mesh axis (for divisibility checks): the param
    and activation rules, and sequence parallelism's seq -> tensor (SEQUENCE_RULES)."""
    return {**module.PARAM_RULES, **getattr(module, "SEQUENCE_RULES", module.ACTIVATION_RULES)}


def resolve_mesh(strategy: str, mesh_spec: str | None, cfg: Config, n_devices: int) -> dict[str, int]:
    """Parse (or default) and validate the mesh for a strategy against the devices and the model
    (twinshard/mesh.py; a pipeline also against L, M and the batch); shared by both twins."""
    mesh_lib.check_strategy(strategy)
    shape = mesh_lib.parse_mesh(mesh_spec, strategy) if mesh_spec else mesh_lib.default_mesh(strategy, n_devices)
    mesh_lib.check_mesh(strategy, shape, n_devices)
    # the strategy's own checks first: their messages name the fix in its terms (stages, zig-zag chunks)
    if strategy in PIPELINES:
        pipeline.check(cfg.model.num_layers, cfg.train.batch_size, shape[pipeline.STAGE], cfg.train.microbatches,
                       cfg.train.grad_accum, shape.get("data", 1))
    if strategy in CONTEXT:
        context.check(cfg.model.context_length, shape[context.CONTEXT], cfg.train.cp_layout)
    mesh_lib.check_divisible(logical_dims(cfg), split_rules(MODULES[strategy]), shape)
    return shape


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None,
                tx: optax.GradientTransformation | None = None) -> AutoRunner:
    """The GSPMD runner of `strategy` on `mesh_spec` (None: the strategy's default mesh).

    `tx` overrides the optimizer built from `cfg.train` (see `AutoRunner`)."""
    n_devices = len(jax.devices() if devices is None else devices)  # None: jax.make_mesh orders them
    if strategy in PIPELINES and cfg.train.schedule != "gpipe":
        raise ValueError(f"--schedule={cfg.train.schedule} is written by hand in the manual twin only "
                         "(--impl=manual); the GSPMD twin's pipeline is GPipe (--schedule=gpipe).")
    tp_sp.check_collective_matmul(strategy, "auto", cfg.model.collective_matmul)
    shape = resolve_mesh(strategy, mesh_spec, cfg, n_devices)
    runner = CONTEXT[strategy].ContextRunner if strategy in CONTEXT else AutoRunner
    return runner(strategy, MODULES[strategy], shape, cfg, devices, tx=tx)
