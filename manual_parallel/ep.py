"""Expert parallelism, shard_map twin: the experts split over `expert`, the batch over
(data, expert); the dense weights and the router replicated.

Each device routes its own tokens (B/(data expert) rows, capacity groups of S tokens) and fills
the capacity buffers of every expert, [E, G, C, D] (twinshard/model/moe.py). `dispatch`
sends each expert's buffers to the device holding it and `combine` brings the outputs back:
Forward, per MoE layer: `dispatch_to_experts`, an all_to_all over `expert`
[E, G, C, D] -> [E/ep, ep G, C, D]; the local experts [E/ep, D, F] run on it;
`combine_from_experts`, the inverse all_to_all [E/ep, ep G, C, D] -> [E, G, C, D].
Backward, per MoE layer: the two transposes, each the other's all_to_all (2 more).
Then the dense weights' and the router's gradients are averaged over (data, expert) and the
experts' over `data` (ExpertRunner.mean_over_tokens); the loss over (data, expert).
Optimizer: one psum over `expert` of the expert shards' squared norms.
"""

import jax
from jax import lax

from manual_parallel.base import ManualParallelism, either
from manual_parallel.collectives import combine_from_experts, dispatch_to_experts
from manual_parallel.runner import DATA, ManualRunner
from twinshard.parallel import placement
from twinshard.parallel.strategies import EP

__all__ = ["ExpertParallel", "ExpertRunner", "Runner", "parallelism"]

EXPERT = "expert"


class ExpertParallel(ManualParallelism):
    def dispatch(self, x):
        """x [E, G, C, D]: this device's groups' buffers -> [E/ep, ep G, C, D] for its experts."""
        out = dispatch_to_experts(x, EXPERT)
        assert out.shape[0] * lax.axis_size(EXPERT) == x.shape[0], (x.shape, out.shape)
        return out

    def combine(self, x):
        """x [E/ep, ep G, C, D]: the local experts' outputs -> [E, G, C, D] of this device's groups."""
        return combine_from_experts(x, EXPERT)

    def layer_policy(self, policy):
        """A checkpointed layer also saves the exchanged buffers: its backward recomputes the
        experts' matmuls, never an all_to_all (remat trades FLOPs, not communication)."""
        inner = super().layer_policy(policy)
        return None if inner is None else either(inner, saves_exchanges)


def saves_exchanges(prim, *_, **params) -> bool:
    """Remat policy: save the output of `dispatch_to_experts` and `combine_from_experts`.

    The policy sees their forward's `all_to_all` itself, not a `custom_vjp_call` around it
    (measured, JAX 0.12: under jax.checkpoint the custom_vjp's forward is inlined here)."""
    if prim.name == "custom_vjp_call":
        return any(e.primitive.name == "all_to_all" for e in params["call_jaxpr"].eqns)
    return prim.name == "all_to_all"


class ExpertRunner(ManualRunner):
    """ManualRunner whose tokens are split over `expert` too.

    An expert's gradient arrives summed over the `expert` axis: the backward all_to_all brings
    it the gradients of every device whose tokens it served, each the gradient of that device's
    mean loss. The step's loss is the mean over all data x expert devices, so after the mean
    over `data` the expert gradients are divided by the `expert` size (a scale, no collective)."""

    TOKEN_AXES = (DATA, EXPERT)

    def mean_over_tokens(self, grads, replicated):
        grads = super().mean_over_tokens(grads, replicated)
        n = self.sizes[EXPERT]
        return jax.tree.map(lambda g, s: g / n if EXPERT in placement.sharded_axes(s) else g, grads,
                            self.param_specs)


def parallelism(mesh, cfg) -> ExpertParallel:
    return ExpertParallel(EP.params)


Runner = ExpertRunner
