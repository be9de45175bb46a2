"""FSDP (ZeRO-3), shard_map twin: each weight lives as a 1/data slice of its
d_model dimension; it is all-gathered right before its matmul and its gradient
is reduce-scattered straight back to the slice.

The collectives and why: docs/memory.md (manual_parallel/fsdp.py)."""

import copy

import jax
from jax import lax

from manual_parallel.runner import ManualParallelism
from manual_parallel.collectives import fsdp_gather
from twinshard.model.remat import RegathersWeights
from twinshard.parallel.placement import sharded_axes

__all__ = ["FullyShardedDataParallel", "parallelism"]


class FullyShardedDataParallel(RegathersWeights, ManualParallelism):
    """layer_policy, head: RegathersWeights (twinshard/model/remat.py), with this twin's `gathers`."""

    gathers_weights = True
    AXIS = "data"  # the mesh axis the weights are sharded over (hsdp: fsdp, inside a slice)
    is_resident = False  # True in the copy `resident()` returns: the weights are already whole

    def weight(self, w, axes):
        """w: the local slice, e.g. W1 [D/data, F] -> gathered [D, F]."""
        if self.is_resident:
            return w  # gathered once for the whole step (grad_accum > 1: gather_step)
        w = super().weight(w, axes)  # fsdp_tp: TP's columns of a replicated kv weight, gathered alone
        for dim, logical in enumerate(axes):
            if self.param_rules.get(logical) == self.AXIS:
                full = self.gather_weight(w, dim)
                assert full.shape[dim] == w.shape[dim] * lax.axis_size(self.AXIS), (w.shape, full.shape)
                return full
        return w  # RMSNorm gains are replicated

    def gather_weight(self, w, dim: int):
        """W [D/data, F] -> [D, F] (dim 0); its gradient reduce-scattered back in the backward."""
        return fsdp_gather(w, self.AXIS, dim)

    # Gradient accumulation: the step gathers once, the micro-batches run on resident weights.

    def gather_step(self, params, axes, specs, dtype):
        """Every matrix whole ONCE per step, in the compute dtype ([L, D/data, F] -> [L, D, F]; norm
        gains unchanged), for the K micro-batches' `resident` hooks: 9 all-gathers (7 stacked leaves,
        embedding, lm_head); the caller's `jax.vjp` pullback is their reduce-scatters."""
        return jax.tree.map(lambda w, ax, s: self.weight(w.astype(dtype), ax) if self.AXIS in sharded_axes(s) else w,
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
