"""FSDP (ZeRO-3), explicit twin: every weight's d_model dimension sharded over `data`, the
batch split over `data`; the gather is a change of type.

Forward: `weight` reshards each weight matrix from its stored type ([D@data, F]) to its use
type, whole and `reduced` over `data` ([D, F]{R:data}): the all-gather, one layer at a time
inside the layer loop.
Backward: each layer is checkpointed without its gathered weights (RegathersWeights, as in the
manual twin), so the backward loop re-gathers them; the weight gradient leaves the matmul `unreduced` over `data`
(the cotangent type of a `reduced` weight), and the gather's transpose, a reshard from
`{U:data}` to [D@data, F], is its reduce-scatter (XLA:CPU writes it as an all-reduce +
dynamic-slice, as for GSPMD; measured, JAX 0.12). The replicated RMSNorm gains' gradients are
reduced by JAX's rules inside the backward layer loop (one [D] all-reduce per layer and gain).
Optimizer: one reduction of the squared norms per group of shardings (runner.global_norm).
"""

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
