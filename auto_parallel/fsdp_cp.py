"""FSDP + context parallelism, GSPMD twin: every weight's d_model dimension sharded over `data`
(FSDP), the batch over `data` and the sequence over `context` (auto_parallel/cp.py).

The collectives and why: docs/long-context.md (auto_parallel/fsdp_cp.py)."""

from auto_parallel.cp import ContextParallel, ContextRunner
from auto_parallel.fsdp import FullyShardedDataParallel

__all__ = ["FSDPContextParallel", "Runner", "parallelism"]


class FSDPContextParallel(FullyShardedDataParallel, ContextParallel):
    """weight from FSDP (the pin: the all-gather over `data`); positions / attention from cp."""


def parallelism(mesh, run) -> FSDPContextParallel:
    return FSDPContextParallel(mesh, run.placed.activations, run.cfg.train.cp_layout)


Runner = ContextRunner
