"""FSDP (ZeRO-3), shard_map twin: each weight lives as a 1/data slice of its
d_model dimension; it is all-gathered right before its matmul and its gradient
is reduce-scattered straight back to the slice.

Forward: `fsdp_gather` = all_gather over `data` of each weight matrix (7L+2):
inside the layer scan, one layer's 7 matrices per iteration (W1: [D/data, F]
-> [D, F]), so at most one layer's gathered weights exist at a time.
Backward: all_gather again (gathered weights are not saved: `layer_policy` and
`head` checkpoint every use), inside the backward layer loop, of every matrix but
the embedding table (its gradient is a scatter-add that reads no table values),
then psum_scatter over `data` of each weight gradient (fsdp_gather's backward: 7L+2);
the replicated RMSNorm gains get the DP mean (manual_parallel/runner.py).
Optimizer: one psum over `data` of the shards' squared norms.

Gradient accumulation (grad_accum = K > 1; manual_parallel/runner.py
`_gathered_loss_and_grads`): the gradient reduce-scatter must run ONCE per step,
but here it lives in fsdp_gather's backward, per layer, inside every micro-batch's
backward scan. So the step changes shape (ZeRO-2-like within the step):
`gather_step` all-gathers every matrix leaf whole ONCE (7 stacked [L, ...] leaves +
embedding + lm_head: 9 all-gathers), the K micro-batches run on the resident
weights (`resident()`: `weight` is the identity, no remat re-gather), a full-size
float32 accumulator sums their gradients, and the `jax.vjp` pullback of
`gather_step` - fsdp_gather's backward - reduce-scatters each accumulated leaf once
(9 reduce-scatters). The same bytes as one ZeRO-3 forward gather, whatever K.

Why this shape: ZeRO-3 per micro-batch moves 3W of ring bytes
K times (W: one pass over the weights); per-layer gathers into an unreduced full-size
accumulator still move ~(2K + 1) W, and autodiff cannot return a full-size gradient for a
shard-shaped param from inside the layer scan. Gather once + scatter once moves 2W whatever
K, for the gathered weights and the float32 accumulator held through the step.
Once a full-size accumulator is held (the price of a single scatter), keeping the
gathered weights adds at most as much again and removes 2K - 1 weight gathers.
When even one full copy does not fit, K = 1 (ZeRO-3) with a smaller batch, or remat,
is the answer. The TP all-reduces of fsdp_tp stay per micro-batch (K times).
"""

import copy

import jax
from jax import lax

from manual_parallel.base import ManualParallelism
from manual_parallel.collectives import fsdp_gather
from twinshard.model.remat import RegathersWeights
from twinshard.parallel.placement import sharded_axes

__all__ = ["FullyShardedDataParallel", "parallelism"]


class FullyShardedDataParallel(RegathersWeights, ManualParallelism):
    """layer_policy, head: RegathersWeights (twinshard/model/remat.py), with this twin's `gathers`."""

    gathers_weights = True
    is_resident = False  # True in the copy `resident()` returns: the weights are already whole

    def weight(self, w, axes):
        """w: the local slice, e.g. W1 [D/data, F] -> gathered [D, F]."""
        if self.is_resident:
            return w  # gathered once for the whole step (grad_accum > 1: gather_step)
        w = super().weight(w, axes)  # fsdp_tp: TP's columns of a replicated kv weight, gathered alone
        for dim, logical in enumerate(axes):
            if self.param_rules.get(logical) == "data":
                full = fsdp_gather(w, "data", dim)
                assert full.shape[dim] == w.shape[dim] * lax.axis_size("data"), (w.shape, full.shape)
                return full
        return w  # RMSNorm gains are replicated

    # Gradient accumulation: the step gathers once, the micro-batches run on resident weights.

    def gather_step(self, params, axes, specs, dtype):
        """Every matrix whole ONCE per step, in the compute dtype ([L, D/data, F] -> [L, D, F]; norm
        gains unchanged), for the K micro-batches' `resident` hooks: 9 all-gathers (7 stacked leaves,
        embedding, lm_head); the caller's `jax.vjp` pullback is their reduce-scatters."""
        return jax.tree.map(lambda w, ax, s: self.weight(w.astype(dtype), ax) if "data" in sharded_axes(s) else w,
                            params, axes, specs)

    @staticmethod
    def gathers(prim, **params) -> bool:
        """True for the output of `fsdp_gather` (a custom_vjp around an all_gather): a full weight.

        Measured (JAX 0.12): this one exclusion is enough. The matmuls read the gathered weight
        itself (no transposed or cast copy to hide in), so under RegathersWeights' layer policy
        the backward pass re-gathers every matrix; under `everything_saveable` alone it
        re-gathers none."""
        return prim.name == "custom_vjp_call" and any(
            e.primitive.name == "all_gather" for e in params["call_jaxpr"].eqns)

    def resident(self) -> "FullyShardedDataParallel":
        """These hooks with `weight` the identity: for weights `gather_step` made whole (no
        remat is needed either: nothing is re-gathered in the backward pass)."""
        par = copy.copy(self)
        par.is_resident = True
        return par


def parallelism(mesh, run) -> FullyShardedDataParallel:
    return FullyShardedDataParallel(run.placed.params)
