"""The GSPMD twin: each strategy's placement (twinshard/parallel/strategies.py) as sharding annotations;
XLA inserts the collectives. `auto_parallel/<name>.py` holds a strategy's hooks, if it needs any
beyond the generic ones (auto_parallel/runner.py)."""

from __future__ import annotations

import importlib

import optax

from auto_parallel.runner import AutoRunner
from twinshard.config import Config
from twinshard.parallel import resolve, support

RUNNER = AutoRunner  # a strategy module's `Runner` replaces it
MODULES = {name: importlib.import_module(f"auto_parallel.{name}") for name in support.written_by("auto")}


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None,
                tx: optax.GradientTransformation | None = None) -> AutoRunner:
    """The GSPMD runner of `strategy` on `mesh_spec` (None: the strategy's default mesh); `tx`
    overrides the optimizer built from `cfg.train` (see `AutoRunner`)."""
    return resolve.make_runner(resolve.resolve_run(strategy, "auto", mesh_spec, cfg, devices), tx)
