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
"""

import jax
from jax import lax

from auto_parallel.fsdp import ACTIVATION_RULES, PARAM_RULES  # same placement as the GSPMD twin
from manual_parallel.base import ManualParallelism
from manual_parallel.collectives import fsdp_gather
from twinshard.parallelism import Policy

everything_saveable = jax.checkpoint_policies.everything_saveable

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

    def layer_policy(self, policy):
        """Each layer is checkpointed under every ModelConfig.remat: the layer's policy
        (with the psum outputs of fsdp_tp's Megatron g, base.py; remat=none: everything
        autodiff saves), minus the gathered weights. The backward loop then re-gathers each layer's 7
        matrices in its own iteration, and no gathered weight outlives its layer
        (measured: 7 all-gathers in the forward loop, 7 in the backward loop, each of
        multiplicity L, for every policy; tests/test_remat.py).

        Measured (JAX 0.12): a checkpoint around the WHOLE loss (this twin's earlier
        design) does not nest: its policy overrides the layer's, and its recomputation
        runs as a third loop between the forward and the backward loop, which re-gathers
        the weights of every layer and hands all L of them, stacked [L, D, F], to the
        backward loop."""
        inner = super().layer_policy(policy)  # + saves_reductions (fsdp_tp's Megatron g)
        return never_gathered(everything_saveable if inner is None else inner)

    def head(self, lm_head, x):
        """lm_head(x) checkpointed: the backward pass re-gathers the lm_head weight
        ([D, V], or [D, V/tensor] under fsdp_tp) instead of keeping it. The embedding
        needs nothing of the kind: its backward is a scatter-add that reads no table."""
        return jax.checkpoint(lm_head, policy=never_gathered(everything_saveable))(x)


def gathers(prim, **params) -> bool:
    """True for the output of `fsdp_gather` (a custom_vjp around an all_gather): a full weight."""
    return prim.name == "custom_vjp_call" and any(
        e.primitive.name == "all_gather" for e in params["call_jaxpr"].eqns)


def never_gathered(policy: Policy) -> Policy:
    """`policy`, except that a gathered weight is never saved: it is gathered again.

    Measured (JAX 0.12): this one exclusion is enough. The matmuls read the gathered
    weight itself (no transposed or cast copy to hide in), so under
    `never_gathered(everything_saveable)` the backward pass re-gathers every matrix; under
    `everything_saveable` alone it re-gathers none."""
    return lambda prim, *args, **params: not gathers(prim, **params) and policy(prim, *args, **params)


PARALLELISM = FullyShardedDataParallel
