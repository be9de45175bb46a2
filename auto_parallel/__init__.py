"""The GSPMD twin: each strategy's placement (twinshard/parallel/strategies.py) as sharding annotations;
XLA inserts the collectives. `auto_parallel/<name>.py` holds a strategy's hooks (`parallelism`), if
it needs any beyond the generic ones (auto_parallel/runner.py), and its `Runner` where it differs.

`MODULES` is the twin's registry (strategy -> module); `runner_of` builds a resolved run's runner."""

from __future__ import annotations

import optax

from auto_parallel import (cp, dp, ep, fsdp, fsdp_cp, fsdp_ep, fsdp_tp, fsdp_ulysses, hsdp, pp, pp_fsdp, tp,
                           tp_sp, ulysses)
from auto_parallel.runner import AutoRunner
from twinshard.config import Config
from twinshard.parallel import resolve
from twinshard.parallel.resolve import Run

TWIN = "auto"
RUNNER = AutoRunner  # a strategy module's `Runner` replaces it
MODULES = {module.__name__.rpartition(".")[2]: module  # its file's name is the strategy's
           for module in (dp, fsdp, tp, fsdp_tp, tp_sp, cp, fsdp_cp, ulysses, fsdp_ulysses, pp, pp_fsdp, ep,
                          fsdp_ep, hsdp)}


def runner_of(run: Run, tx: optax.GradientTransformation | None = None) -> AutoRunner:
    """The GSPMD runner of a resolved run; `tx` overrides the optimizer built from `cfg.train`."""
    module = MODULES[run.strategy]
    return getattr(module, "Runner", RUNNER)(run, module.parallelism, tx)


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None,
                tx: optax.GradientTransformation | None = None) -> AutoRunner:
    """The GSPMD runner of `strategy` on `mesh_spec` (None: the strategy's default mesh); `tx`
    overrides the optimizer built from `cfg.train` (see `AutoRunner`)."""
    return runner_of(resolve.resolve_run(strategy, TWIN, mesh_spec, cfg, devices), tx)
