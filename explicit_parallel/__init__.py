"""The explicit twin: each strategy's placement (twinshard/parallel/strategies.py) as the
sharding in JAX's types (a mesh of `AxisType.Explicit` axes); a collective is a change of
type (`jax.sharding.reshard`) or an output sharding the program states.
`explicit_parallel/<name>.py` holds a strategy's hooks (`parallelism`; explicit_parallel/runner.py: the rest).

`MODULES` is the twin's registry (strategy -> module: the strategies support.py gives it; docs/explicit.md
says why not the others); `runner_of` builds a resolved run's runner."""

from __future__ import annotations

import optax

from explicit_parallel import dp, fsdp, fsdp_tp, tp, tp_sp, ulysses
from explicit_parallel.runner import ExplicitRunner
from twinshard.config import Config
from twinshard.parallel import resolve
from twinshard.parallel.resolve import Run

TWIN = "explicit"
RUNNER = ExplicitRunner  # a strategy module's `Runner` replaces it
MODULES = {module.__name__.rpartition(".")[2]: module  # its file's name is the strategy's
           for module in (dp, fsdp, tp, fsdp_tp, tp_sp, ulysses)}
STRATEGIES = tuple(MODULES)  # docs/explicit.md: the others


def runner_of(run: Run, tx: optax.GradientTransformation | None = None) -> ExplicitRunner:
    """The explicit runner of a resolved run; `tx` overrides the optimizer built from `cfg.train`."""
    module = MODULES[run.strategy]
    return getattr(module, "Runner", RUNNER)(run, module.parallelism, tx)


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None,
                tx: optax.GradientTransformation | None = None) -> ExplicitRunner:
    """The explicit runner of `strategy` on `mesh_spec` (None: the strategy's default mesh)."""
    return runner_of(resolve.resolve_run(strategy, TWIN, mesh_spec, cfg, devices), tx)
