"""FSDP + context parallelism, GSPMD twin: every weight's d_model dimension sharded over `data`
(FSDP), the batch over `data` and the sequence over `context` (auto_parallel/cp.py).

The placement (twinshard/parallel/strategies.py FSDP_CP) and cp's layout hooks; XLA derives
the communication:
Forward: an all-gather over `data` of each weight matrix (FSDP's `weight` pins the use
layout); cp's all-gathers of K and V over `context`, per layer.
Backward: each weight gradient reduce-scattered over `data` and all-reduced over `context`
(the manual twin's hybrid sharding: params replicated over `context`, manual_parallel/fsdp_cp.py
says why); the transposes of the K/V gathers. GSPMD reduces each weight gradient over
`context` at full size, then over `data`; the manual twin reduce-scatters over `data` first
and all-reduces the 1/data shard over `context`.
Optimizer: small all-reduces for the global norm.
grad_accum K > 1: the runner's per-data-shard vmap runs cp's hooks (`GSPMD.without_batch`),
so the data collectives run once per step and the context ones per micro-batch (the vmap
covers the data shards, not the sequence shards); tests/test_context.py
(test_auto_fsdp_cp_accumulates_in_the_context_layout) asserts it.
"""

from auto_parallel.cp import ContextParallel, ContextRunner
from auto_parallel.fsdp import FullyShardedDataParallel

__all__ = ["FSDPContextParallel", "Runner", "parallelism"]


class FSDPContextParallel(FullyShardedDataParallel, ContextParallel):
    """weight from FSDP (the pin: the all-gather over `data`); positions / attention from cp."""


def parallelism(mesh, run) -> FSDPContextParallel:
    return FSDPContextParallel(mesh, run.placed.activations, run.cfg.train.cp_layout)


Runner = ContextRunner
