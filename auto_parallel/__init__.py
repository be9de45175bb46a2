"""The GSPMD twin: each strategy's placement (twinshard/parallel/strategies.py) as sharding annotations;
XLA inserts the collectives. `auto_parallel/<name>.py` holds a strategy's hooks, if it needs any
beyond the generic ones (auto_parallel/runner.py)."""

from __future__ import annotations

import importlib

import jax
import optax

from auto_parallel.runner import AutoRunner
from twinshard.parallel import strategies
from twinshard.config import Config
from twinshard.parallel.resolve import check_options, resolve_mesh

MODULES = {name: importlib.import_module(f"auto_parallel.{name}") for name in strategies.NAMES}


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None,
                tx: optax.GradientTransformation | None = None) -> AutoRunner:
    """The GSPMD runner of `strategy` on `mesh_spec` (None: the strategy's default mesh).

    `tx` overrides the optimizer built from `cfg.train` (see `AutoRunner`)."""
    n_devices = len(jax.devices() if devices is None else devices)  # None: jax.make_mesh orders them
    check_options(strategy, "auto", cfg)
    shape = resolve_mesh(strategy, mesh_spec, cfg, n_devices)
    module = MODULES[strategy]
    return getattr(module, "Runner", AutoRunner)(strategy, module, shape, cfg, devices, tx=tx)
