"""FSDP (ZeRO-3), explicit twin: every weight's d_model dimension sharded over `data`, the
batch split over `data`; the gather is a change of type.

The collectives and why: docs/memory.md (explicit_parallel/fsdp.py)."""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from explicit_parallel.runner import NORM, Explicit
from twinshard.model.remat import RegathersWeights
from twinshard.parallel.placement import sharded_axes, spec

DATA = "data"

__all__ = ["FullyShardedDataParallel", "parallelism"]


class FullyShardedDataParallel(RegathersWeights, Explicit):
    """layer_policy, head: RegathersWeights (twinshard/model/remat.py), with this twin's `gathers`."""

    def weight(self, w, axes):
        """w: [D@data, F] (one layer's) -> [D, F]{R:data}: gathered whole, typed `reduced` so that
        its gradient comes back unreduced and the transpose of this reshard reduce-scatters it.
        RMSNorm gains (replicated) pass unchanged."""
        if DATA not in jax.typeof(w).sharding.spec.partitions:
            return w
        return jax.sharding.reshard(w, NamedSharding(self.mesh, P(*spec(axes, self.rules), reduced={DATA})))

    def gather_step(self, params, axes, specs, dtype):
        """grad_accum > 1: every matrix typed over `data` gathered once, in the compute dtype, by
        `weight`; the K micro-batches add up its unreduced gradients (norm gains pass unchanged)."""
        def gather(p, ax):
            if DATA in sharded_axes(jax.typeof(p).sharding.spec) and NORM not in ax:
                return self.weight(p.astype(dtype), ax)
            return p
        return jax.tree.map(gather, params, axes)

    @staticmethod
    def gathers(prim, **params) -> bool:
        """True for a reshard to a type `reduced` over `data`: FSDP's gather (Megatron's f under
        fsdp_tp reshards to `reduced` over `tensor`, and its g to replicated)."""
        return prim.name == "reshard" and DATA in params["dst_sharding"].spec.reduced


def parallelism(mesh, run) -> FullyShardedDataParallel:
    return FullyShardedDataParallel(mesh, run.placed.activations)
