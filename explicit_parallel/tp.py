"""Megatron tensor parallelism, explicit twin: heads, d_ff and the vocabulary split over `tensor`.

The collectives and why: docs/explicit.md (explicit_parallel/tp.py)."""

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
        """Vocab-parallel lookup: ids [B, T], table [V@tensor, D] -> [B, T, D]{U:tensor}, reduced by g."""
        partial = table.at[ids].get(out_sharding=self.sharding(ACTIVATION, unreduced={TENSOR}))
        return self.exit_tensor_parallel(partial)

    def token_loss(self, logits, targets, vocab_size):
        """logits: [B, T, V@tensor], targets: [B, T] -> [B, T]: the manual twin's vocab-parallel
        cross-entropy in a shard_map manual over `tensor` only (jnp.take_along_axis has no out_sharding)."""
        local = jax.shard_map(lambda z, t: vocab_parallel_token_loss(z, t, vocab_size, TENSOR), mesh=self.mesh,
                              in_specs=(P(*spec(LOGITS, {"vocab": TENSOR})), P()), out_specs=P(),
                              axis_names={TENSOR})
        return local(logits, targets)


def parallelism(mesh, run) -> TensorParallel:
    return TensorParallel(mesh, run.placed.activations)
