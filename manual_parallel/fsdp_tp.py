"""FSDP + Megatron TP, shard_map twin: the TP layout over `tensor`, with every
weight's d_model dimension further sliced over `data`.

The collectives and why: docs/design.md (manual_parallel/fsdp_tp.py)."""

from manual_parallel.fsdp import FullyShardedDataParallel
from manual_parallel.tp import TensorParallel

__all__ = ["FSDPTensorParallel", "parallelism"]


class FSDPTensorParallel(FullyShardedDataParallel, TensorParallel):
    """weight/remat from FSDP (after TP's slice of a replicated kv weight); enter/exit_tensor_parallel,
    embed, token_loss from TP."""


def parallelism(mesh, run) -> FSDPTensorParallel:
    return FSDPTensorParallel(run.placed.params, run.cfg.model.kv_heads)
