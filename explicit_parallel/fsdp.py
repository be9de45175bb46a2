"""FSDP (ZeRO-3), explicit twin: every weight's d_model dimension sharded over `data`, the
batch split over `data`; the gather is a change of type.

Forward: `weight` reshards each weight matrix from its stored type ([D@data, F]) to its use
type, whole and `reduced` over `data` ([D, F]{R:data}): the all-gather, one layer at a time
inside the layer loop.
Backward: each layer is checkpointed without its gathered weights (`layer_policy`), so the
backward loop re-gathers them; the weight gradient leaves the matmul `unreduced` over `data`
(the cotangent type of a `reduced` weight), and the gather's transpose, a reshard from
`{U:data}` to [D@data, F], is its reduce-scatter (XLA:CPU writes it as an all-reduce +
dynamic-slice, as for GSPMD; measured, JAX 0.12). The replicated RMSNorm gains get the
runner's one all-reduce each.
Optimizer: the global norm's partial sums, reduced by JAX's rules.
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from explicit_parallel.runner import Explicit
from twinshard.model.hooks import Policy
from twinshard.parallel.placement import spec
from twinshard.parallel.strategies import FSDP

everything_saveable = jax.checkpoint_policies.everything_saveable
DATA = "data"

__all__ = ["FullyShardedDataParallel", "parallelism"]


class FullyShardedDataParallel(Explicit):
    gathers_weights = True  # grad_accum > 1: the runner gathers every matrix once per step (`weight`)

    def weight(self, w, axes):
        """w: [D@data, F] (one layer's) -> [D, F]{R:data}: gathered whole, typed `reduced` so that
        its gradient comes back unreduced and the transpose of this reshard reduce-scatters it.
        RMSNorm gains (replicated) pass unchanged."""
        if DATA not in jax.typeof(w).sharding.spec.partitions:
            return w
        return jax.sharding.reshard(w, NamedSharding(self.mesh, P(*spec(axes, self.rules), reduced={DATA})))

    def layer_policy(self, policy):
        """Each layer checkpointed under every remat policy, minus the gathered weights (the
        manual twin's structure: the backward loop re-gathers each layer's matrices)."""
        inner = super().layer_policy(policy)  # + saves_reductions (fsdp_tp's Megatron g)
        return never_gathered(everything_saveable if inner is None else inner)

    def head(self, lm_head, x):
        """lm_head(x) checkpointed: the backward pass re-gathers the lm_head weight."""
        return jax.checkpoint(lm_head, policy=never_gathered(everything_saveable))(x)


def gathers(prim, **params) -> bool:
    """True for a reshard to a `reduced` type: FSDP's gather (Megatron's g reshards to replicated)."""
    return prim.name == "reshard" and bool(params["dst_sharding"].spec.reduced)


def never_gathered(policy: Policy) -> Policy:
    """`policy`, except that a gathered weight is never saved: it is gathered again."""
    return lambda prim, *args, **params: not gathers(prim, **params) and policy(prim, *args, **params)


def parallelism(mesh, cfg) -> FullyShardedDataParallel:
    return FullyShardedDataParallel(mesh, FSDP.activations)
