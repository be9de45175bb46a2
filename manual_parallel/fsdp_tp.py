"""FSDP + Megatron TP, shard_map twin: the TP layout over `tensor`, with every
weight's d_model dimension further sliced over `data`.

Each hook composes the two strategies: `weight` is FSDP's (all_gather over
`data` of the local TP shard, reduce-scatter of its gradient), the Megatron
f/g, vocab-parallel embedding and cross-entropy are TP's over `tensor`.
Backward adds the DP mean over `data` of the replicated RMSNorm gains.
Optimizer: one psum over (data, tensor) of the shards' squared norms.
"""

from manual_parallel.fsdp import FullyShardedDataParallel
from manual_parallel.tp import TensorParallel

__all__ = ["FSDPTensorParallel", "parallelism"]


class FSDPTensorParallel(FullyShardedDataParallel, TensorParallel):
    """weight/remat from FSDP (after TP's slice of a replicated kv weight); enter/exit_tensor_parallel,
    embed, token_loss from TP."""


def parallelism(mesh, run) -> FSDPTensorParallel:
    return FSDPTensorParallel(run.placed.params, run.cfg.model.kv_heads)
