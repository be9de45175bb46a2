"""FSDP + all-to-all sequence parallelism, shard_map twin: FSDP (ZeRO-3) over `data`, the
sequence over `context` with ulysses's attention (manual_parallel/ulysses.py), the batch over
`data`. The hooks compose as fsdp_cp's (manual_parallel/fsdp_cp.py: hybrid sharding, params
replicated over `context`): FSDP's gathers and scatters over `data`, ulysses's 4 all-to-alls per
layer each way over `context` on B/data sequences, each matrix gradient shard averaged over
`context`, each norm gain over (data, context).
"""

from manual_parallel.fsdp import FullyShardedDataParallel
from manual_parallel.ulysses import UlyssesParallel, UlyssesRunner

__all__ = ["FSDPUlyssesParallel", "Runner", "parallelism"]


class FSDPUlyssesParallel(FullyShardedDataParallel, UlyssesParallel):
    """weight / head / gather_step from FSDP; positions / attention from ulysses; layer_policy both
    (FSDP never saves a gathered weight; ulysses saves the all-to-alls' outputs)."""


def parallelism(mesh, run) -> FSDPUlyssesParallel:
    return FSDPUlyssesParallel(run.placed.params)


Runner = UlyssesRunner
