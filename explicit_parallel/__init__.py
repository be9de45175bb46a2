"""The explicit twin: each strategy's placement (twinshard/parallel/strategies.py) as the
sharding in JAX's types (a mesh of `AxisType.Explicit` axes); a collective is a change of
type (`jax.sharding.reshard`) or an output sharding the program states.
`explicit_parallel/<name>.py` holds a strategy's hooks (explicit_parallel/runner.py: the rest)."""

from __future__ import annotations

import importlib

import optax

from explicit_parallel.runner import ExplicitRunner
from twinshard.config import Config
from twinshard.parallel import resolve, support

STRATEGIES = support.written_by("explicit")  # docs/explicit.md: the others
RUNNER = ExplicitRunner
MODULES = {name: importlib.import_module(f"explicit_parallel.{name}") for name in STRATEGIES}


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None,
                tx: optax.GradientTransformation | None = None) -> ExplicitRunner:
    """The explicit runner of `strategy` on `mesh_spec` (None: the strategy's default mesh)."""
    return resolve.make_runner(resolve.resolve_run(strategy, "explicit", mesh_spec, cfg, devices), tx)
