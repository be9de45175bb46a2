"""FSDP + Megatron TP, GSPMD twin: the TP layout over `tensor`, with every weight's d_model
dimension further sliced over `data`; the batch over `data`.

The collectives and why: docs/design.md (auto_parallel/fsdp_tp.py)."""

from auto_parallel.fsdp import FullyShardedDataParallel
from auto_parallel.tp import TensorParallel

__all__ = ["FSDPTensorParallel", "parallelism"]


class FSDPTensorParallel(FullyShardedDataParallel, TensorParallel):
    """weight from FSDP; TP's layout from the placement."""


def parallelism(mesh, run) -> FSDPTensorParallel:
    return FSDPTensorParallel(mesh, run.placed.activations)
