"""FSDP + all-to-all sequence parallelism, shard_map twin: FSDP over `data`, ulysses over `context`,
composed as fsdp_cp's (hybrid sharding: params replicated over `context`).
"""

from manual_parallel.fsdp import FullyShardedDataParallel
from manual_parallel.ulysses import UlyssesParallel, UlyssesRunner

__all__ = ["FSDPUlyssesParallel", "Runner", "parallelism"]


class FSDPUlyssesParallel(FullyShardedDataParallel, UlyssesParallel):
    """weight / head / gather_step from FSDP; positions / attention from ulysses; layer_policy both."""


def parallelism(mesh, run) -> FSDPUlyssesParallel:
    return FSDPUlyssesParallel(run.placed.params)


Runner = UlyssesRunner
