"""The shard_map twin: each strategy's placement (twinshard/parallel/strategies.py) with every collective
written out. `manual_parallel/<name>.py` holds a strategy's hooks and collectives (`parallelism`;
manual_parallel/collectives.py: the conjugate pairs, forward and backward) and its `Runner` where it
differs from manual_parallel/runner.py's.

`MODULES` is the twin's registry (strategy -> module); `runner_of` builds a resolved run's runner."""

from __future__ import annotations

from manual_parallel import (cp, dp, ep, fsdp, fsdp_cp, fsdp_ep, fsdp_tp, fsdp_ulysses, hsdp, pp, pp_fsdp, tp,
                             tp_sp, ulysses)
from manual_parallel.runner import ManualRunner
from twinshard.config import Config
from twinshard.parallel import resolve
from twinshard.parallel.resolve import Run

TWIN = "manual"
RUNNER = ManualRunner  # a strategy module's `Runner` replaces it
MODULES = {module.__name__.rpartition(".")[2]: module  # its file's name is the strategy's
           for module in (dp, fsdp, tp, fsdp_tp, tp_sp, cp, fsdp_cp, ulysses, fsdp_ulysses, pp, pp_fsdp, ep,
                          fsdp_ep, hsdp)}


def runner_of(run: Run) -> ManualRunner:
    """The shard_map runner of a resolved run (its optimizer from `cfg.train`: the global norm and
    Adafactor's means run collectives over the mesh)."""
    module = MODULES[run.strategy]
    return getattr(module, "Runner", RUNNER)(run, module.parallelism)


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None) -> ManualRunner:
    """The shard_map runner of `strategy` on `mesh_spec` (None: the strategy's default mesh)."""
    return runner_of(resolve.resolve_run(strategy, TWIN, mesh_spec, cfg, devices))
