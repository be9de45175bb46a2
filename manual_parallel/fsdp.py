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
"""

import jax
from jax import lax

from auto_parallel.fsdp import ACTIVATION_RULES, PARAM_RULES  # same placement as the GSPMD twin
from manual_parallel.base import ManualParallelism
from manual_parallel.collectives import fsdp_gather

__all__ = ["ACTIVATION_RULES", "PARAM_RULES", "FullyShardedDataParallel", "PARALLELISM"]


class FullyShardedDataParallel(ManualParallelism):
    def weight(self, w, axes):
        """w: the local slice, e.g. W1 [D/data, F] -> gathered [D, F]."""
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
