"""Megatron tensor parallelism, shard_map twin: heads, d_ff and the vocabulary split over `tensor`.

Per layer: f (identity; backward psum) before the column-parallel Q,K,V / W1,W3, g (psum of
[B, T, D]; backward identity) after the row-parallel O / W2. The collectives and grouped-query
attention's replicated kv heads: docs/design.md (The strategies; manual_parallel/tp.py).
"""

import jax.numpy as jnp
from jax import lax

from manual_parallel.runner import ManualParallelism
from manual_parallel.collectives import copy_to_tp, reduce_from_tp
from twinshard.model import layers, loss
from twinshard.parallel.strategies import KV_HEADS

__all__ = ["TensorParallel", "parallelism"]

TENSOR = "tensor"


class TensorParallel(ManualParallelism):
    def __init__(self, param_rules, kv_heads: int):
        """param_rules: Strategy.placed's table; kv_heads: Hkv, replicated over `tensor` unless split."""
        super().__init__(param_rules)
        self.kv_heads = kv_heads

    def weight(self, w, axes):
        """A replicated kv weight [(L,) D, Hkv*dh] -> its columns [(L,) D, dh] of kv head i // (t/Hkv)
        at `tensor` index i (a local slice, before FSDP's gather). Other weights: as stored."""
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
