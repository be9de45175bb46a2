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
"""

import functools

import jax.numpy as jnp
from jax import lax

from manual_parallel.base import ManualParallelism
from manual_parallel.collectives import copy_to_tp, reduce_from_tp
from twinshard.model import layers, loss
from twinshard.parallel.strategies import TP

__all__ = ["TensorParallel", "parallelism"]

TENSOR = "tensor"


class TensorParallel(ManualParallelism):
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
        """logits: [B/data, T, V/tensor] for global ids offset + [0, V/tensor); targets: [B/data, T]."""
        assert logits.shape[:-1] == targets.shape, (logits.shape, targets.shape)
        offset = lax.axis_index(TENSOR) * logits.shape[-1]
        return loss.token_cross_entropy(
            logits, targets, vocab_size, offset,
            reduce_max=functools.partial(lax.pmax, axis_name=TENSOR),
            reduce_sum=functools.partial(lax.psum, axis_name=TENSOR))


def parallelism(mesh, cfg) -> TensorParallel:
    return TensorParallel(TP.params)
