"""The GSPMD machinery shared by every auto strategy.

The collectives and why: docs/design.md (auto_parallel/runner.py)."""

from __future__ import annotations

import copy
import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from twinshard.model.hooks import Parallelism
from twinshard.parallel.placement import spec
from twinshard.parallel.resolve import Run
from twinshard.placed import GlobalRunner, Hooks, sharded_attention
from twinshard.train.trainer import accumulated_value_and_grad, logical_axes, loss_fn

Rules = Mapping[str, str]


class GSPMD(Parallelism):
    """Single-device math plus sharding constraints on activations."""

    def __init__(self, mesh: jax.sharding.Mesh, activation_rules: Rules):
        self.mesh, self.rules = mesh, activation_rules
        # [B, T/c] rows do not flatten into one tiled dim: keep the batch dims where seq is split
        self.flat_rows = activation_rules.get("seq") is None

    def constrain(self, x, axes):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec(axes, self.rules)))

    def attention(self, q, k, v, impl="auto", block=0):
        """Causal attention of q, k, v [B, h, T, dh] as placed; splash in a shard_map (twinshard/placed.py)."""
        return sharded_attention(self.mesh, self.rules, q, k, v, impl, block)

    def chunked_token_loss(self, x, w, targets, vocab_size, chunks):
        """The chunked loss of each batch shard apart (a vmap over [S, B/S, T], spmd_axis_name): without
        it GSPMD all-reduced the f32 accumulator dw [D, V] in every chunk (measured, JAX 0.12)."""
        axis = self.rules.get("batch")
        shards = 1 if axis is None else math.prod(
            self.mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
        if shards == 1:
            return super().chunked_token_loss(x, w, targets, vocab_size, chunks)
        split = lambda a: a.reshape(shards, a.shape[0] // shards, *a.shape[1:])  # noqa: E731  [S, B/S, ...]
        per_shard = jax.vmap(lambda xs, ys: super(GSPMD, self).chunked_token_loss(xs, w, ys, vocab_size, chunks),
                             spmd_axis_name=axis)
        return per_shard(split(x), split(targets)).reshape(targets.shape)

    def without_batch(self) -> GSPMD:
        """A copy of these hooks with 'batch' dropped from the rules, for the per-data-shard vmap."""
        hooks = copy.copy(self)
        hooks.rules = {a: m for a, m in self.rules.items() if a != "batch"}
        return hooks


class AutoRunner(GlobalRunner):
    """Runs one strategy with GSPMD; the interface of trainer.SingleDevice."""

    AXIS_TYPE = jax.sharding.AxisType.Auto

    def __init__(self, run: Run, parallelism: Hooks, tx: optax.GradientTransformation | None = None):
        super().__init__(run, parallelism, tx)
        # inside the per-data-shard vmap of `_loss_and_grads` the vmapped axis carries 'batch'
        self.shard_loss = functools.partial(loss_fn, cfg=run.cfg.model, par=self.par.without_batch())

    def _loss_and_grads(self, params, x, y):
        """(mean loss, gradients) of x, y [B, T] over K micro-batches; K > 1 with data > 1: each data
        shard's gradient accumulated apart in a vmap, the mean over `data` after it the ONE sync."""
        k, d = self.cfg.train.grad_accum, self.sizes.get("data", 1)
        if k == 1 or d == 1:  # K = 1: the program without accumulation; tp: no gradient sync at all
            return accumulated_value_and_grad(self.loss, params, x, y, k, sum_dtype=self.cfg.train.grad_accum_dtype)
        shards = lambda a: a.reshape(d, a.shape[0] // d, *a.shape[1:])  # noqa: E731  [data, B/data, T]
        shared = self.par.gather_step(params, logical_axes(self.cfg.model), self.param_specs, self.cfg.model.dtype)
        per_shard = jax.vmap(functools.partial(accumulated_value_and_grad, self.shard_loss, shared, grad_accum=k,
                                               sum_dtype=self.cfg.train.grad_accum_dtype),
                             spmd_axis_name="data")
        losses, grads = per_shard(shards(x), shards(y))  # [data], [data, *param]: each device its own
        # the mean over data in each gradient's own dtype (`shared`'s): jnp.mean sums bf16 in float32
        # (as jnp.sum does without dtype=), and GSPMD then all-reduced float32 (measured, JAX 0.12)
        mean = lambda g: jnp.sum(g, axis=0, dtype=g.dtype) / d  # noqa: E731
        grads = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(mean(g), s),
                             grads, self.state_shardings.params)
        return jnp.mean(losses), grads
