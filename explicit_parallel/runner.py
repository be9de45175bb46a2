"""The Explicit machinery shared by every explicit strategy: sharding in types.

The collectives and why: docs/explicit.md (explicit_parallel/runner.py)."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from twinshard.model.hooks import Parallelism
from twinshard.model.remat import also_saving
from twinshard.model.transformer import ACTIVATION
from twinshard.parallel import placement
from twinshard.parallel.placement import spec
from twinshard.parallel.resolve import Run
from twinshard.placed import GlobalRunner, Hooks, sharded_attention
from twinshard.testing import expect_sharding  # a trace-time type check, the assertion users run too
from twinshard.train.optim import make_optimizer
from twinshard.train.trainer import accumulated_value_and_grad, logical_axes

Rules = Mapping[str, str]
DATA, NORM = "data", "norm"  # NORM: the logical axis of the RMSNorm gains
TOKEN_AXES = (DATA, "context")  # the mesh axes that split the tokens (each device's loss: its own tokens' mean)


def _split(mesh: jax.sharding.Mesh, rules: Rules) -> dict[str, str]:
    """The rules without the mesh axes of size 1 (JAX drops them from types)."""
    return {k: a for k, a in rules.items() if mesh.shape.get(a, 1) > 1}


def saves_reductions(prim, *avals, **params) -> bool:
    """Remat policy: True for a reshard whose input is typed `unreduced` (its output is a sum)."""
    return prim.name == "reshard" and bool(avals[0].sharding.spec.unreduced)


class Explicit(Parallelism):
    """Single-device math on a mesh of Explicit axes: the hooks say the layouts JAX cannot infer."""

    def __init__(self, mesh: jax.sharding.Mesh, activation_rules: Rules):
        self.mesh, self.rules = mesh, _split(mesh, activation_rules)

    def sharding(self, axes, **extra) -> NamedSharding:
        """The sharding of an array with logical `axes` under the activation rules; `extra`:
        `unreduced=` / `reduced=` mesh axes."""
        return NamedSharding(self.mesh, P(*spec(axes, self.rules), **extra))

    def constrain(self, x, axes):
        """The residual stream and the logits: their type is checked at trace time, nothing moves."""
        expect_sharding(x, spec(axes, self.rules))
        return x

    def attention(self, q, k, v, impl="auto", block=0):
        """Causal attention of q, k, v [B, h, T, dh] as typed; splash in a shard_map (twinshard/placed.py)."""
        return sharded_attention(self.mesh, self.rules, q, k, v, impl, block)

    def layer_policy(self, policy):
        """The layer's policy, plus `saves_reductions` (without it remat `full` re-ran g in the backward loop, measured)."""
        return also_saving(policy, saves_reductions)

    def embed(self, ids, table):
        """ids: [B@data, T]; table: [V, D] -> [B@data, T, D] (jnp.take refuses ids split over `data`, JAX 0.12)."""
        return table.at[ids].get(out_sharding=self.sharding(ACTIVATION))


class ExplicitRunner(GlobalRunner):
    """Runs one strategy on a mesh of Explicit axes; the interface of trainer.SingleDevice."""

    AXIS_TYPE = jax.sharding.AxisType.Explicit  # kv heads split: resolve.check_kv_heads

    def __init__(self, run: Run, parallelism: Hooks, tx: optax.GradientTransformation | None = None):
        super().__init__(run, parallelism, tx)
        token_axes = placement.active_axes(TOKEN_AXES, self.sizes)
        # per matrix, the token axes it is replicated over: cast to `reduced` over them for grad.
        # Not the RMSNorm gains: JAX 0.12 refuses an elementwise operand reduced over `data`.
        self.reduced_over = jax.tree.map(
            lambda s, axes: () if NORM in axes else tuple(a for a in token_axes if a not in placement.sharded_axes(s)),
            self.param_specs, logical_axes(run.cfg.model), is_leaf=lambda x: isinstance(x, P))

    def optimizer(self, train_cfg) -> optax.GradientTransformation:
        return make_optimizer(train_cfg, norm_fn=self.global_norm)

    def step_params(self, params):
        """Each param in the type the step differentiates: `gather_step` under grad_accum > 1, then
        `reduced` over the token axes it is replicated over (its gradient comes back `unreduced`)."""
        axes = logical_axes(self.cfg.model)
        if self.cfg.train.grad_accum > 1:
            params = self.par.gather_step(params, axes, self.param_specs, self.cfg.model.dtype)

        def typed(p, over):
            if not over:
                return p
            s = jax.typeof(p).sharding
            return jax.sharding.reshard(p, NamedSharding(self.mesh, P(*s.spec.partitions, reduced=set(over))))
        return jax.tree.map(typed, params, self.reduced_over)

    def _loss_and_grads(self, params, x, y):
        """(mean loss, gradients) of x, y [B@data, T] over K micro-batches; the reshard of each gradient
        to its param's sharding is the step's ONE reduction per leaf."""
        typed = self.step_params(params)
        loss, grads = accumulated_value_and_grad(self.loss, typed, x, y, self.cfg.train.grad_accum,
                                                  sum_dtype=self.cfg.train.grad_accum_dtype)
        # grads: in `typed`'s dtypes (accumulated_value_and_grad's rule); the weight dtype after the reshard
        sync = lambda g, p, s: jax.sharding.reshard(g, s).astype(p.dtype)  # noqa: E731
        return loss, jax.tree.map(sync, grads, params, self.state_shardings.params)

    def global_norm(self, grads) -> jax.Array:
        """sqrt(sum of squares of the full gradient): one reshard of unreduced partial sums per group of
        axes (the plain norm under JAX's rules ran one all-reduce per leaf, measured, JAX 0.12)."""
        groups: dict[tuple[str, ...], jax.Array] = {}
        for g in jax.tree.leaves(grads):
            split = placement.sharded_axes(jax.typeof(g).sharding.spec)
            axes = placement.active_axes(split, self.sizes)
            out = NamedSharding(self.mesh, P(unreduced=set(axes)))
            sq = jax.lax.reduce_sum(jnp.square(g.astype(jnp.float32)), tuple(range(g.ndim)), out_sharding=out)
            groups[axes] = groups[axes] + sq if axes in groups else sq
        return jnp.sqrt(sum(jax.sharding.reshard(sq, NamedSharding(self.mesh, P())) for sq in groups.values()))
