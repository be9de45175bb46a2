"""Expert parallelism, shard_map twin: the experts split over `expert`, the batch over
(data, expert); the dense weights and the router replicated.

The collectives and why: docs/experts.md (manual_parallel/ep.py)."""

import jax
import jax.numpy as jnp
from jax import lax

from manual_parallel.collectives import (combine_from_experts, dispatch_to_experts, expert_route, ragged_combine,
                                         ragged_dispatch)
from manual_parallel.runner import DATA, ManualParallelism, ManualRunner
from twinshard.model.moe import inverse_permutation
from twinshard.model.remat import also_saving
from twinshard.parallel import placement

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

    def dispatch_rows(self, rows, group_sizes):
        """rows [A, D] sorted by expert, group_sizes [E] -> ([ep A, D] grouped by local expert, their
        sizes [E/ep], the plan of combine_rows). Rows past the sizes' sum are zeros."""
        a = rows.shape[0]
        route, received = expert_route(group_sizes, a, EXPERT)  # received [ep, E/ep]
        order = regroup_order(received, a)
        there = ragged_dispatch(rows, route, lax.axis_size(EXPERT) * a, EXPERT)  # [ep A, D]: by peer
        return there[order], jnp.sum(received, axis=0), (route, order)

    def combine_rows(self, rows, plan):
        """rows [ep A, D] in dispatch_rows' order -> [A, D], the order of its input."""
        route, order = plan
        a = rows.shape[0] // lax.axis_size(EXPERT)
        return ragged_combine(rows[inverse_permutation(order)], route, a, EXPERT)

    def layer_policy(self, policy):
        """A checkpointed layer also saves the exchanged buffers: its backward recomputes the
        experts' matmuls, never an all_to_all (remat trades FLOPs, not communication)."""
        return also_saving(super().layer_policy(policy), saves_exchanges)


_EXCHANGES = frozenset({"all_to_all", "ragged_all_to_all"})


def saves_exchanges(prim, *_, **params) -> bool:
    """Remat policy: save the output of `dispatch_to_experts` and `combine_from_experts` (ragged:
    `ragged_dispatch`, `ragged_combine` and expert_route's all_to_all of the counts).

    The policy sees their forward's `all_to_all` itself, not a `custom_vjp_call` around it
    (measured, JAX 0.12: under jax.checkpoint the custom_vjp's forward is inlined here)."""
    if prim.name == "custom_vjp_call":
        return any(e.primitive.name in _EXCHANGES for e in params["call_jaxpr"].eqns)
    return prim.name in _EXCHANGES


def regroup_order(received, rows: int):
    """received [ep, E/ep]: peer j's rows per local expert, which `ragged_dispatch` wrote to region
    j (rows j A .. j A + A - 1, A = `rows`) sorted by expert -> order [ep A]: the gather that
    groups them by local expert (peers in device order within one), then the unused rows."""
    ends = jnp.cumsum(received, axis=1)  # [ep, E/ep]: where each local expert's rows end in a region
    at = jnp.arange(rows, dtype=received.dtype)  # a row's place in its region
    expert = jnp.sum(at[None, :, None] >= ends[:, None, :], axis=-1)  # [ep, A]; E/ep: an unused row
    return jnp.argsort(expert.reshape(-1), stable=True)


class ExpertRunner(ManualRunner):
    """ManualRunner whose tokens are split over `expert` too.

    An expert's gradient arrives summed over the `expert` axis: the backward all_to_all brings
    it the gradients of every device whose tokens it served, each the gradient of that device's
    mean loss. The step's loss is the mean over all data x expert devices, so after the mean
    over `data` the expert gradients are divided by the `expert` size (a scale, no collective).
    Under moe_dispatch='ragged' resolve.check_dispatch refuses CPU devices."""

    TOKEN_AXES = (DATA, EXPERT)

    def mean_over_tokens(self, grads, replicated):
        grads = super().mean_over_tokens(grads, replicated)
        n = self.sizes[EXPERT]
        return jax.tree.map(lambda g, s: g / n if EXPERT in placement.sharded_axes(s) else g, grads,
                            self.param_specs)


def parallelism(mesh, run) -> ExpertParallel:
    return ExpertParallel(run.placed.params)


Runner = ExpertRunner
