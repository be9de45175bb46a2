"""The explicit twin: each strategy's placement (twinshard/parallel/strategies.py) as the
sharding in JAX's types (a mesh of `AxisType.Explicit` axes); a collective is a change of
type (`jax.sharding.reshard`) or an output sharding the program states.
`explicit_parallel/<name>.py` holds a strategy's hooks (explicit_parallel/runner.py: the rest)."""

from __future__ import annotations

import importlib

import jax
import optax

from explicit_parallel.runner import ExplicitRunner
from twinshard.config import Config
from twinshard.parallel.resolve import check_options, resolve_mesh

STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp", "tp_sp")  # written in this twin (docs/explicit.md: the others)
MODULES = {name: importlib.import_module(f"explicit_parallel.{name}") for name in STRATEGIES}


def check(strategy: str, cfg: Config) -> None:
    """A ValueError naming the fix for what this twin does not run."""
    if strategy not in STRATEGIES:
        raise ValueError(f"--impl=explicit runs {', '.join(STRATEGIES)}, not --strategy={strategy} "
                         "(docs/explicit.md says why): use --impl=auto or --impl=manual.")
    if cfg.model.num_experts:
        raise ValueError(f"--impl=explicit runs dense models (--num_experts={cfg.model.num_experts}): "
                         "use --impl=auto or --impl=manual, or --num_experts=0.")


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None,
                tx: optax.GradientTransformation | None = None) -> ExplicitRunner:
    """The explicit runner of `strategy` on `mesh_spec` (None: the strategy's default mesh)."""
    n_devices = len(jax.devices() if devices is None else devices)
    check(strategy, cfg)
    check_options(strategy, "explicit", cfg)
    shape = resolve_mesh(strategy, mesh_spec, cfg, n_devices)
    return ExplicitRunner(strategy, MODULES[strategy], shape, cfg, devices, tx=tx)
