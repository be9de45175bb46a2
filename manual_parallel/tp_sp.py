"""Megatron sequence parallelism (tp_sp), shard_map twin: Megatron TP, with the residual
stream between the tensor-parallel regions split along the sequence over `tensor`
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2). Mesh `tensor:M` or `data:D,tensor:M` (the batch over `data`).

The collectives and why: docs/design.md (manual_parallel/tp_sp.py)."""

from jax import lax

from manual_parallel.collectives import all_gather_matmul, copy_to_tp, gather_sequence, scatter_sequence
from manual_parallel.tp import TENSOR, TensorParallel
from twinshard.model.remat import REMAT_POLICIES

__all__ = ["SequenceParallel", "CollectiveMatmul",
           "parallelism"]


class SequenceParallel(TensorParallel):
    """TP's vocab-parallel embedding and cross-entropy; the regions entered and left along T."""

    def enter_tensor_parallel(self, x):
        """x [b, T/t, D] -> [b, T, D] (the column-parallel matmuls, and the lm_head, see all T)."""
        full = gather_sequence(x, TENSOR)
        assert full.shape[1] == x.shape[1] * lax.axis_size(TENSOR), (x.shape, full.shape)
        return full

    def exit_tensor_parallel(self, x):
        """Partial sums [b, T, D] (after O, W2, or the embedding lookup) -> this shard's [b, T/t, D]."""
        return scatter_sequence(x, TENSOR)

    def layer_policy(self, policy):
        """remat full: nothing_saveable as it is, the layer input [b, T/t, D] alone, as MaxText's full remat
        (and the GSPMD twin): the backward loop re-runs the attention block's scatter_sequence (L more
        reduce-scatters of [b, T/t, D] a step; the sequence gathers re-run under any policy) where saving
        its output held one more [b, T/t, D] a layer (the 128B on fsdp 16 x tensor 16: 2.7 GB a chip, past
        a v5e's HBM). Other policies also save the reductions (ManualParallelism.layer_policy)."""
        return policy if policy is REMAT_POLICIES["full"] else super().layer_policy(policy)

    def weight(self, w, axes):
        """RMSNorm gains run on sequence shards: f makes their gradient the sum over all tokens.
        (A replicated kv weight: TP's slice.)"""
        return copy_to_tp(w, TENSOR) if axes == ("norm",) else super().weight(w, axes)


class CollectiveMatmul(SequenceParallel):
    """--collective_matmul: the gather before the column-parallel matmuls is decomposed into
    ppermutes, each beside the matmul of the chunk already here (collectives.all_gather_matmul).
    The lm_head keeps gather_sequence (enter_tensor_parallel)."""

    def column_parallel(self, x, ws, axes=None):
        """x [b, T/t, D] -> x_all @ w [b, T, out/t] for each w, without the all-gather."""
        return all_gather_matmul(x, ws, TENSOR)


def parallelism(mesh, run) -> SequenceParallel:
    """CollectiveMatmul under cfg.model.collective_matmul."""
    cls = CollectiveMatmul if run.cfg.model.collective_matmul else SequenceParallel
    return cls(run.placed.params, run.cfg.model.kv_heads)

