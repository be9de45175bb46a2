"""Megatron tensor parallelism, shard_map twin: heads, d_ff and the vocabulary
are split over `tensor`; every device holds the whole batch and the whole
residual stream.

Forward, per layer: f (identity) -> column-parallel Q,K,V / W1,W3 on H/tensor
heads or F/tensor columns -> row-parallel O / W2 -> g = psum over `tensor`
(2 all-reduces of [B, T, D]). Vocab-parallel embedding: masked lookup in the
local [V/tensor, D] rows + psum. Vocab-parallel cross-entropy: pmax and psum
of per-token statistics; the full [B, T, V] logits never exist.
Backward, per layer: g is the identity; f psums the input gradient of each
column-parallel block (2 all-reduces of [B, T, D]); one more f before lm_head.
Weight gradients need no communication.
Optimizer: one psum over `tensor` of the shards' squared norms.

Grouped-query attention (Hkv < H kv heads): the k/v projections split with the query heads
while `tensor` divides Hkv (Hkv/tensor kv heads per device). A larger tensor axis (a multiple of
Hkv) leaves each device's H/tensor query heads inside ONE kv head's group: the k/v weights
[D, Hkv*dh] are then stored replicated over `tensor` (Strategy.placed: the parameter tree, its
init and its checkpoints stay the model's, whatever the mesh), and each device multiplies by its
kv head's columns [D, dh] alone (`weight`: a local slice, no data moves; under remat=none the
layer keeps the two slices for its backward pass). Each device
thus computes the gradient of its slice from its own query heads; ManualRunner pcasts these
weights to varying over `tensor` before `grad` and sums their gradients over it once per step
(one psum per leaf: the kv head's query-head groups each contribute a share).
"""

import jax.numpy as jnp
from jax import lax

from manual_parallel.base import ManualParallelism
from manual_parallel.collectives import copy_to_tp, reduce_from_tp
from twinshard.model import layers, loss
from twinshard.parallel.strategies import KV_HEADS

__all__ = ["TensorParallel", "parallelism"]

TENSOR = "tensor"


class TensorParallel(ManualParallelism):
    def __init__(self, param_rules, kv_heads: int):
        """param_rules: the strategy's table placed for the model (Strategy.placed); kv_heads:
        the model's Hkv, whose heads are replicated over `tensor` when param_rules does not
        split `kv_heads`."""
        super().__init__(param_rules)
        self.kv_heads = kv_heads

    def weight(self, w, axes):
        """A replicated kv weight [(L,) D, Hkv*dh] (on every device) -> the columns [(L,) D, dh] of the
        kv head this device's query heads [i H/t, (i+1) H/t) attend with: head i // (t/Hkv) at
        `tensor` index i (a local slice, no data moves). Before FSDP's gather (fsdp_tp calls it
        first), so FSDP gathers that one head's columns. Other weights: as stored."""
        if axes[-1] == KV_HEADS and KV_HEADS not in self.param_rules:
            t = lax.axis_size(TENSOR)
            assert t % self.kv_heads == 0, (t, self.kv_heads)  # mesh.check_divisible
            width = w.shape[-1] // self.kv_heads
            w = lax.dynamic_slice_in_dim(w, lax.axis_index(TENSOR) // (t // self.kv_heads) * width, width, axis=-1)
        return super().weight(w, axes)

    def enter_tensor_parallel(self, x):
        return copy_to_tp(x, TENSOR)  # f

    def exit_tensor_parallel(self, x):
        return reduce_from_tp(x, TENSOR)  # g

    def embed(self, ids, table):
        """ids: [B/data, T] (global ids); table: this device's rows [V/tensor, D]."""
        assert ids.ndim == 2 and table.ndim == 2, (ids.shape, table.shape)
        v_local = table.shape[0]
        local = ids - lax.axis_index(TENSOR) * v_local
        mine = (local >= 0) & (local < v_local)
        rows = layers.embedding(jnp.clip(local, 0, v_local - 1), table)  # [B, T, D]
        return self.exit_tensor_parallel(jnp.where(mine[..., None], rows, 0.0))  # the partial sums: g

    def token_loss(self, logits, targets, vocab_size):
        return loss.vocab_parallel_token_loss(logits, targets, vocab_size, TENSOR)

    def chunked_token_loss(self, x, w, targets, vocab_size, chunks):
        return loss.vocab_parallel_token_loss(x, targets, vocab_size, TENSOR, w, chunks)


def parallelism(mesh, run) -> TensorParallel:
    return TensorParallel(run.placed.params, run.cfg.model.kv_heads)
