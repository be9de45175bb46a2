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
    """Remat policy: save the output of every forward all-reduce or reduce-scatter, direct or
    inside one of manual_parallel/collectives.py's custom_vjps (Megatron's g = `reduce_from_tp`;
    sequence parallelism's `scatter_sequence`, whose [b, T/t, D] output is 1/t of g's).
    Megatron's f (`copy_to_tp`: identity forward, a `pcast`) and FSDP's gather (an
    all_gather) are not reductions and are not saved.

    With it, a checkpointed layer never repeats a forward collective in its backward
    pass: remat trades FLOPs for memory, not communication. Without it, `full` re-runs
    both Megatron g psums of every layer in the backward loop (2L more all-reduces of
    [b, T, D]; Korthikanti et al. 2022 count the same cost for Megatron's full
    recomputation); with it, each layer saves those 2 [b, T, D] (twinshard/cost/memory.py)."""
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
