"""FSDP + Megatron TP, explicit twin: the TP layout over `tensor`, with every weight's d_model
dimension further sliced over `data`; the batch over `data`.

The collectives and why: docs/design.md (explicit_parallel/fsdp_tp.py)."""

from explicit_parallel.fsdp import FullyShardedDataParallel
from explicit_parallel.tp import TensorParallel

__all__ = ["FSDPTensorParallel", "parallelism"]


class FSDPTensorParallel(FullyShardedDataParallel, TensorParallel):
    """weight and remat from FSDP; f, g and the vocab-parallel loss from TP."""


def parallelism(mesh, run) -> FSDPTensorParallel:
    return FSDPTensorParallel(mesh, run.placed.activations)
