"""FSDP (ZeRO-3), shard_map twin: each weight lives as a 1/data slice of its
d_model dimension; it is all-gathered right before its matmul and its gradient
is reduce-scattered straight back to the slice.

Forward: `fsdp_gather` = all_gather over `data` of each weight matrix (7L+2):
inside the layer scan, one layer's 7 matrices per iteration (W1: [D/data, F]
-> [D, F]), so at most one layer's gathered weights exist at a time.
Backward: all_gather again (gathered weights are not saved: `remat`) of every
matrix but the embedding table (its gradient is a scatter-add that reads no
table values), then psum_scatter over `data` of each weight gradient
(fsdp_gather's backward: 7L+2);
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

Alternatives (cost model numbers, gpt2_350m, N = 407M, fsdp data=8, B=64 = 8 per
device, T=1024, float32, K=4, per device per step; W = one pass over the weights,
1.33 GiB of ring bytes):
    ZeRO-3 per micro-batch (gather, re-gather, scatter K times; the K = 1 program
        in a loop, sharded accumulator): K x 3W = 15.2 GiB, +0.19 GiB.
    per-layer gathers per micro-batch, unreduced full-size accumulator, one
        scatter: ~(2K + 1) W = 11.3 GiB, +1.51 GiB (the accumulator) - and autodiff
        cannot return a full-size gradient for a shard-shaped param from inside the
        layer scan, so it needs a zero "gradient sink" input per leaf.
    chosen, gather once + scatter once: 2W = 2.65 GiB (K = 1 today: 3.81 GiB),
        +3.0 GiB: the gathered weights (1.51 GiB; bf16: 0.76) and the float32
        accumulator (1.51 GiB), against activations that drop 27.2 -> 6.8 GiB.
Once a full-size accumulator is held (the price of a single scatter), keeping the
gathered weights adds at most as much again and removes 2K - 1 weight gathers.
When even one full copy does not fit, K = 1 (ZeRO-3) with a smaller batch, or remat,
is the answer. The TP all-reduces of fsdp_tp stay per micro-batch (K times).
"""

import copy

import jax
from jax import lax

from auto_parallel.fsdp import ACTIVATION_RULES, PARAM_RULES  # same placement as the GSPMD twin
from manual_parallel.base import ManualParallelism
from manual_parallel.collectives import fsdp_gather

__all__ = ["ACTIVATION_RULES", "PARAM_RULES", "FullyShardedDataParallel", "PARALLELISM"]


class FullyShardedDataParallel(ManualParallelism):
    is_resident = False  # True in the copy `resident()` returns: the weights are already whole

    def gather_step(self, params, axes, dtype: str):
        """Gradient accumulation (grad_accum = K > 1): every matrix gathered ONCE per step.

        params: the local shards (W1 stacked: [L, D/data, F]); axes: their logical axes
        (('layers', 'embed', 'mlp')). Returns the whole matrices in the compute dtype
        ([L, D, F]; the norm gains, replicated, unchanged in float32), for the K
        micro-batches to run on with the `resident` hooks.
        Forward: the 7L+2 all-gathers of `fsdp_gather`, before the micro-batch loop.
        Backward (the caller's `jax.vjp` pullback, applied once to the accumulated
        full-size gradient): `fsdp_gather`'s psum_scatter / data of each matrix.
        """
        sharded = lambda ax: any(self.param_rules.get(a) == "data" for a in ax)  # noqa: E731
        return jax.tree.map(lambda w, ax: self.weight(w.astype(dtype), ax) if sharded(ax) else w, params, axes)

    def resident(self) -> "FullyShardedDataParallel":
        """These hooks with `weight` the identity: for weights `gather_step` made whole (no
        remat is needed either: nothing is re-gathered in the backward pass)."""
        par = copy.copy(self)
        par.is_resident = True
        return par

    def weight(self, w, axes):
        """w: the local slice, e.g. W1 [D/data, F] -> gathered [D, F]."""
        if self.is_resident:
            return w  # gathered once for the whole step (grad_accum > 1: gather_step)
        for dim, logical in enumerate(axes):
            if self.param_rules.get(logical) == "data":
                full = fsdp_gather(w, "data", dim)
                assert full.shape[dim] == w.shape[dim] * lax.axis_size("data"), (w.shape, full.shape)
                return full
        return w  # RMSNorm gains are replicated

    def remat(self, loss_fn):
        """Save only matmul outputs for the backward pass; everything else - the
        gathered weights included - is recomputed, so the backward pass
        all-gathers each weight again and no full weight outlives its layer.

        The policy reaches into the layer scan: the forward loop saves per layer
        only the allowed residuals (stacked [L, ...]), and the backward loop
        re-gathers each layer's 7 matrices in its body (measured at L=8: 7
        all-gathers in each loop, multiplicity 8; tests/test_scan.py).

        Measured (JAX 0.12): `save_anything_except_these_names` on a
        checkpoint_name'd gathered weight does NOT re-gather - autodiff saves a
        derived copy (a transpose / reduce_precision of W) instead; and
        `jax.checkpoint` around the gather alone saves its output. Saving only
        matmul outputs works, and collective outputs must be saved too, or the
        backward pass would repeat the TP all-reduces of fsdp_tp.
        """
        return jax.checkpoint(loss_fn, policy=_save_matmuls_and_reductions, static_argnums=(3, 4))


_SAVED = {"dot_general", "gather", "psum", "psum_invariant", "pmax"}


def _save_matmuls_and_reductions(prim, *_, **params) -> bool:
    """Remat policy: keep matmul, lookup (`gather`) and all-reduce outputs (incl.
    the TP f/g custom_vjps); recompute the rest, FSDP's gathered weights among
    them. Saving the embedding lookup's output means the embedding table is not
    re-gathered: its gradient (a scatter-add) needs no table values."""
    if prim.name == "custom_vjp_call":
        return not any(e.primitive.name == "all_gather" for e in params["call_jaxpr"].eqns)
    return prim.name in _SAVED


PARALLELISM = FullyShardedDataParallel
