"""What every manual strategy shares: the placement rules it was built with, and
the remat rule that keeps communication out of recomputation (`layer_policy`)."""

from __future__ import annotations

from typing import Mapping

from twinshard.model.hooks import Parallelism
from twinshard.model.remat import also_saving

# Primitives whose output is a forward reduction: an all-reduce (Megatron g, the vocab-parallel
# statistics; `psum_invariant` is the psum of a value invariant over the axis under check_vma)
# or a reduce-scatter (`reduce_scatter`, lax.psum_scatter: sequence parallelism's g).
_REDUCTIONS = frozenset({"psum", "psum_invariant", "pmax", "reduce_scatter"})


def saves_reductions(prim, *_, **params) -> bool:
    """Remat policy: save the output of every forward all-reduce or reduce-scatter, direct or inside
    a custom_vjp of manual_parallel/collectives.py (Megatron's g, `scatter_sequence`), so a
    checkpointed layer never repeats one in its backward pass (docs/memory.md: remat trades FLOPs,
    not communication)."""
    if prim.name == "custom_vjp_call":
        return any(e.primitive.name in _REDUCTIONS for e in params["call_jaxpr"].eqns)
    return prim.name in _REDUCTIONS


class ManualParallelism(Parallelism):
    """Single-device hooks plus the strategy's parameter table (logical -> mesh axis)."""

    # The hooks gather sharded weights before use (FSDP): a step of several micro-batches then
    # gathers each matrix once (`gather_step`) instead of once per micro-batch and layer.
    gathers_weights = False

    def __init__(self, param_rules: Mapping[str, str]):
        self.param_rules = dict(param_rules)

    def layer_policy(self, policy):
        """The layer's policy, plus `saves_reductions`: a checkpointed layer's backward pass
        recomputes matmuls, never a reduction (tp, fsdp_tp: Megatron g; tp_sp: its reduce-scatter,
        but it re-gathers the sequence shards, see tp_sp.py; dp and fsdp run no
        all-reduce in a layer's forward, so for them this adds nothing)."""
        return also_saving(policy, saves_reductions)
