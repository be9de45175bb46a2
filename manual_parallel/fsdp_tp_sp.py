"""FSDP + Megatron sequence parallelism (fsdp_tp_sp), shard_map twin: tp_sp's layout over `tensor`
(manual_parallel/tp_sp.py), with every weight's d_model dimension further sliced over `data`
(manual_parallel/fsdp.py); the batch over `data`. MaxText's layout for its largest models.

Per layer, for W1 [D, F] stored as [D/data, F/tensor] and the residual stream x [B/data, T/tensor, D]:

    forward    fsdp_gather over data        W1 [D/data, F/tensor] -> [D, F/tensor]
               gather_sequence over tensor  x [B/data, T/tensor, D] -> [B/data, T, D]
               scatter_sequence over tensor W2's partial sums [B/data, T, D] -> [B/data, T/tensor, D]
    backward   fsdp_gather again (remat: gathered weights are not saved)
               fsdp_gather's psum_scatter   dW1 [D, F/tensor] -> [D/data, F/tensor] (the mean over data)
               gather_sequence's psum_scatter, scatter_sequence's all_gather over tensor (dx)
               copy_to_tp's psum over tensor of each RMSNorm gain's gradient [D] (its T shard's share)

The norm gains' gradients are then averaged over data (the runner's mean over tokens). The GSPMD twin,
auto_parallel/fsdp_tp_sp.py, keeps the gathered weights instead (launch.collectives' note)."""

from manual_parallel.fsdp import FullyShardedDataParallel
from manual_parallel.tp_sp import SequenceParallel

__all__ = ["FSDPSequenceParallel", "parallelism"]


class FSDPSequenceParallel(FullyShardedDataParallel, SequenceParallel):
    """weight / head / gather_step / layer_policy from FSDP (after tp_sp's f on a norm gain, TP's slice of a
    replicated kv weight); enter/exit_tensor_parallel, embed and token_loss from tp_sp.

    grad_accum > 1: the `resident` hooks return every leaf as it is, the norm gains without tp_sp's f; the
    program is the same (measured, JAX 0.12: under check_vma an invariant gain used on varying sequence
    shards gets an implicit pvary at each use, whose transpose is the same psum over `tensor`)."""


def parallelism(mesh, run) -> FSDPSequenceParallel:
    return FSDPSequenceParallel(run.placed.params, run.cfg.model.kv_heads)
