"""Megatron sequence parallelism (tp_sp), shard_map twin: Megatron TP, with the residual
stream between the tensor-parallel regions split along the sequence over `tensor`
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2). Mesh `tensor:M` or `data:D,tensor:M` (the batch over `data`).

    x [b, T/t, D] -> RMSNorm on the shard -> gather_sequence -> [b, T, D]
      -> Q,K,V / W1,W3 column-parallel [b, T, out/t] -> attention / SwiGLU on local heads
      -> O / W2 row-parallel, partial sums [b, T, D] -> scatter_sequence -> [b, T/t, D]

Forward, per layer: 2 all-gathers along T (before attention and before the MLP, result
[b, T, D]) and 2 reduce-scatters along T (after O and after W2, result [b, T/t, D]),
where TP all-reduces twice. Vocab-parallel embedding: masked lookup in the local
[V/t, D] rows, then a reduce-scatter along T (TP: a psum). Before the lm_head: an
all-gather of the [b, T, D] stream (Megatron's choice; the vocab-parallel lm_head and
cross-entropy then run as in TP on the whole sequence: pmax/psum of [b, T] statistics).
Backward, per layer: the conjugates - reduce-scatter of each column-parallel block's
input gradient (TP: an all-reduce), all-gather of each row-parallel output gradient (TP:
nothing); reduce-scatter before the lm_head, all-gather for the embedding gradient.
The RMSNorm gains see only this device's tokens: each gain goes through Megatron's f
(`copy_to_tp`: identity forward, psum of its gradient over `tensor`; 2L + 1 small
all-reduces, [D] f32). Weight matrices' gradients need no communication (each device
holds its columns / rows and every token's activations in the regions that use them), but
for k/v weights replicated over `tensor` (grouped-query attention with tensor > Hkv), whose
gradients are summed over `tensor` (manual_parallel/runner.py `summed_over`).
Under a remat policy (not `none`) each layer's backward pass re-gathers its 2 sequence
shards: only the reduce-scatter outputs [b, T/t, D] are saved (base.saves_reductions),
as Megatron stores the sharded input and re-gathers it in the backward pass.
Optimizer: one psum over `tensor` of the shards' squared norms (+ the DP mean over `data`).

Bytes per layer (A = b*T*D*s): TP's 4 all-reduces move 4 x 2(t-1)/t A per device on a
ring; tp_sp's 4 all-gathers ((t-1)/t A each) and 4 reduce-scatters ((t-1)/t A each) the
same 8(t-1)/t A: an all-reduce IS a reduce-scatter followed by an all-gather, and
sequence parallelism only moves the all-gather half to where the next region begins.
What it saves is memory: every activation outside the column/row-parallel regions (the
residual stream, the norms, the layer input) is 1/t of TP's (twinshard/cost/memory.py).

--collective_matmul (`CollectiveMatmul`): each layer's 2 gathers before the column-parallel
matmuls become t-1 ppermutes of [b, T/t, D], each beside the matmuls of the chunk already
here (collectives.all_gather_matmul); their backward, t-1 reverse ppermutes, replaces the
gathers' reduce-scatters. The same ring bytes; on a TPU the sends overlap the matmuls.
"""

from jax import lax

from manual_parallel.collectives import all_gather_matmul, copy_to_tp, gather_sequence, scatter_sequence
from manual_parallel.tp import TENSOR, TensorParallel

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

