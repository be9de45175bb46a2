"""FSDP + Megatron TP, explicit twin: the TP layout over `tensor`, with every weight's d_model
dimension further sliced over `data`; the batch over `data`.

Each hook composes the two strategies: `weight` is FSDP's reshard (the gather over `data` of
the local TP shard, to a type `reduced` over `data`; its transpose the reduce-scatter of the
gradient), f, g, the vocab-parallel lookup and loss are TP's over `tensor`, on
[B@data, T, D] activations.
"""

from explicit_parallel.fsdp import FullyShardedDataParallel
from explicit_parallel.tp import TensorParallel

__all__ = ["FSDPTensorParallel", "parallelism"]


class FSDPTensorParallel(FullyShardedDataParallel, TensorParallel):
    """weight and remat from FSDP; f, g and the vocab-parallel loss from TP."""


def parallelism(mesh, run) -> FSDPTensorParallel:
    return FSDPTensorParallel(mesh, run.placed.activations)
