"""Megatron tensor parallelism, explicit twin: heads, d_ff and the vocabulary split over
`tensor`; every device holds the whole batch and the whole residual stream.

Forward, per layer: f = a reshard of the block's input to `reduced` over `tensor` (no data
moves) -> column-parallel Q, K, V / W1, W3 ([B, T, D]{R:tensor} @ [D, F@tensor]) ->
row-parallel O / W2, whose contraction over the split heads / d_ff leaves [B, T, D] typed
`unreduced` over `tensor` (twinshard/model/layers.py `partial_sums`) -> g = the reshard of
that partial sum to replicated: the all-reduce, where the manual twin's g stands (2 per
layer). Vocab-parallel embedding: a lookup in the [V@tensor, D] table whose output is typed
`unreduced` over `tensor` (each device's rows, zeros for the others' ids), reduced by g.
Vocab-parallel cross-entropy: Explicit mode cannot type the target-logit pick over a split
vocabulary (jnp.take_along_axis has no out_sharding in JAX 0.12), so `token_loss` runs the
manual twin's loss (loss.vocab_parallel_token_loss: pmax and psums of per-token statistics) in a
shard_map over `tensor` alone, inside the explicit program; the full [B, T, V] logits never
exist.
Backward, per layer: g's transpose is free (replicated -> reduced); the input gradients of
the column-parallel matmuls leave them `unreduced`, add up unreduced (q + k + v, w1 + w3),
and f's transpose reduces each sum once: 2 all-reduces of [B, T, D], one more before the
lm_head. Weight gradients need no communication.
Optimizer: the global norm's partial sums over `tensor`, reduced by JAX's rules.
"""

import jax
from jax.sharding import PartitionSpec as P

from explicit_parallel.runner import Explicit
from twinshard.model.loss import vocab_parallel_token_loss
from twinshard.model.transformer import ACTIVATION, LOGITS
from twinshard.parallel.placement import spec

__all__ = ["TensorParallel", "parallelism"]

TENSOR = "tensor"


class TensorParallel(Explicit):
    def enter_tensor_parallel(self, x):
        """f: [B, T, D] -> [B, T, D]{R:tensor}; backward: the all-reduce of the summed input gradients."""
        return jax.sharding.reshard(x, self.sharding(ACTIVATION, reduced={TENSOR}))

    def exit_tensor_parallel(self, x):
        """g: the row-parallel partial sums [B, T, D]{U:tensor} -> [B, T, D]: the all-reduce."""
        return jax.sharding.reshard(x, self.sharding(ACTIVATION))

    def embed(self, ids, table):
        """Megatron's vocab-parallel lookup: ids [B, T], table [V@tensor, D] -> each device's rows of
        its vocabulary shard (zeros for the others), typed [B, T, D]{U:tensor}; then g reduces
        them: the all-reduce where the manual twin's psum stands."""
        partial = table.at[ids].get(out_sharding=self.sharding(ACTIVATION, unreduced={TENSOR}))
        return self.exit_tensor_parallel(partial)

    def token_loss(self, logits, targets, vocab_size):
        """logits: [B, T, V@tensor], targets: [B, T] -> [B, T]: the manual twin's vocab-parallel
        cross-entropy (each device's V/tensor columns, pmax and psum over `tensor`), in a
        shard_map manual over `tensor` only (`data` stays Explicit inside)."""
        local = jax.shard_map(lambda z, t: vocab_parallel_token_loss(z, t, vocab_size, TENSOR), mesh=self.mesh,
                              in_specs=(P(*spec(LOGITS, {"vocab": TENSOR})), P()), out_specs=P(),
                              axis_names={TENSOR})
        return local(logits, targets)


def parallelism(mesh, run) -> TensorParallel:
    return TensorParallel(mesh, run.placed.activations)
