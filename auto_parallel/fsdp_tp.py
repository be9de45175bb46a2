"""FSDP + Megatron TP, GSPMD twin: the TP layout over `tensor`, with every weight's d_model
dimension further sliced over `data`; the batch over `data`.

Each hook composes the two strategies: `weight` is FSDP's pin (the all-gather over `data` of
the local TP shard, the reduce-scatter of its gradient); the Megatron all-reduces over `tensor`
on [B/data, T, D] activations come from TP's placement.
Backward: the TP all-reduces; each gradient reduce-scattered over `data`
(XLA:CPU: all-reduce + dynamic-slice).
Optimizer: small all-reduces for the global norm.
"""

from auto_parallel.fsdp import FullyShardedDataParallel
from auto_parallel.tp import TensorParallel

__all__ = ["FSDPTensorParallel", "parallelism"]


class FSDPTensorParallel(FullyShardedDataParallel, TensorParallel):
    """weight from FSDP; TP's layout from the placement."""


def parallelism(mesh, run) -> FSDPTensorParallel:
    return FSDPTensorParallel(mesh, run.placed.activations)
