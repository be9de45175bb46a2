"""FSDP + context parallelism, shard_map twin: FSDP (ZeRO-3) over `data`, the sequence split
over `context` (manual_parallel/cp.py), the batch over `data`.

The collectives and why: docs/long-context.md (manual_parallel/fsdp_cp.py)."""

from manual_parallel.cp import ContextParallel, ContextRunner
from manual_parallel.fsdp import FullyShardedDataParallel

__all__ = ["FSDPContextParallel", "Runner", "parallelism"]


class FSDPContextParallel(FullyShardedDataParallel, ContextParallel):
    """weight / head / gather_step from FSDP; positions / attention from cp; layer_policy both
    (FSDP never saves a gathered weight; cp saves the received K/V blocks)."""


def parallelism(mesh, run) -> FSDPContextParallel:
    return FSDPContextParallel(run.placed.params, run.cfg.train.cp_layout)


Runner = ContextRunner  # the batch is permuted into the context layout on the host
