"""The shard_map twin: each strategy's placement (twinshard/parallel/strategies.py) with every collective
written out. `manual_parallel/<name>.py` holds a strategy's hooks and collectives
(manual_parallel/collectives.py: the conjugate pairs, forward and backward)."""

from __future__ import annotations

import importlib

import jax

from manual_parallel.runner import ManualRunner
from twinshard.parallel import strategies
from twinshard.config import Config
from twinshard.parallel.resolve import check_options, resolve_mesh

MODULES = {name: importlib.import_module(f"manual_parallel.{name}") for name in strategies.NAMES}


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None) -> ManualRunner:
    """The shard_map runner of `strategy` on `mesh_spec` (None: the strategy's default mesh)."""
    n_devices = len(jax.devices() if devices is None else devices)  # None: jax.make_mesh orders them
    check_options(strategy, "manual", cfg)
    shape = resolve_mesh(strategy, mesh_spec, cfg, n_devices)
    module = MODULES[strategy]
    return getattr(module, "Runner", ManualRunner)(strategy, module, shape, cfg, devices)
