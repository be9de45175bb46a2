"""FSDP + context parallelism, shard_map twin: FSDP (ZeRO-3) over `data`, the sequence split
over `context` (manual_parallel/cp.py), the batch over `data`.

Each hook composes the two strategies: `weight` is FSDP's (all_gather over `data` of each
matrix, reduce-scatter of its gradient over `data`), `positions` / `attention` are cp's
(true RoPE positions, ring attention over `context` on [B/data, h, T/C, dh] blocks).
Forward, per layer: FSDP's 7 all-gathers over `data`, cp's 2(C-1) collective-permutes.
Backward, per layer: FSDP's re-gathers and reduce-scatters over `data`, cp's reverse ring.
After the backward pass: a pmean over `context` of every matrix gradient shard (FSDP's scatter
averaged over `data` only) and ONE pmean over (data, context) of each replicated norm gain.
Optimizer: one psum over `data` of the shards' squared norms.

Params are sharded over `data` only and replicated over `context` (hybrid sharding: ZeRO
within a data group, the context shards like DP replicas), not over (data, context) as
MaxText's fsdp x context sharding does. Why: the placement tables map a logical axis to ONE
mesh axis (twinshard/parallel/mesh.py's divisibility checks and the cost model read them that way),
and ZeRO over both would gather every weight over all d C devices in every layer. What it
costs: params, gradients and optimizer state are 1/d per device, not 1/(dC), and each
gradient shard takes one more all-reduce over `context` (W/d per matrix, once per step).
"""

from manual_parallel.cp import ContextParallel, ContextRunner
from manual_parallel.fsdp import FullyShardedDataParallel

__all__ = ["FSDPContextParallel", "Runner", "parallelism"]


class FSDPContextParallel(FullyShardedDataParallel, ContextParallel):
    """weight / head / gather_step from FSDP; positions / attention from cp; layer_policy both
    (FSDP never saves a gathered weight; cp saves the received K/V blocks)."""


def parallelism(mesh, run) -> FSDPContextParallel:
    return FSDPContextParallel(run.placed.params, run.cfg.train.cp_layout)


Runner = ContextRunner  # the batch is permuted into the context layout on the host
