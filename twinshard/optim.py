"""Optimizer: global-norm clipping + AdamW on the CS336 warmup/cosine schedule.

The global norm is computed by a `norm_fn` the caller may replace: on one
device (and under GSPMD) it is `optax.tree.norm`; the manual shard_map twin
passes a norm whose partial sums of squares are `psum`-ed over the mesh axes
each gradient is sharded on. Everything else in the update is elementwise, so
the same transformation runs unchanged on local shards.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from twinshard.config import TrainConfig

NormFn = Callable[[optax.Updates], jax.Array]


def cosine_lr(t, lr_max: float, lr_min: float, warmup_steps: int, cosine_steps: int):
    """CS336 `get_lr_cosine_schedule`: linear warmup from 0, cosine to lr_min at
    `cosine_steps`, then constant lr_min. Works on Python numbers and JAX arrays."""
    t = jnp.asarray(t, jnp.float32)
    warm = lr_max * t / max(warmup_steps, 1)
    span = max(cosine_steps - warmup_steps, 1)
    cos = lr_min + 0.5 * (1 + jnp.cos(jnp.pi * (t - warmup_steps) / span)) * (lr_max - lr_min)
    return jnp.where(t < warmup_steps, warm, jnp.where(t <= cosine_steps, cos, lr_min))


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Optimizer step t (0-based: the first update uses t=0, so lr 0 when warming up)."""
    return lambda t: cosine_lr(t, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)


class GuardState(NamedTuple):
    inner: optax.OptState
    skipped: jax.Array  # int32: updates skipped because the gradient norm was not finite
    grad_norm: jax.Array  # float32: global norm of the last gradient, before clipping


def clip_and_guard(
    inner: optax.GradientTransformation, max_norm: float, skip_nonfinite: bool,
    norm_fn: NormFn = optax.tree.norm,
) -> optax.GradientTransformation:
    """Clip gradients to global L2 norm `max_norm` (0: no clipping), then run `inner`.

    With `skip_nonfinite`, a step whose norm is inf/nan leaves params and the
    inner state unchanged (a zero update) and increments `skipped`.
    """

    def init(params):
        return GuardState(inner.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def update(grads, state, params=None):
        norm = norm_fn(grads)
        if max_norm > 0:
            scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, new_inner = inner.update(grads, state.inner, params)
        if not skip_nonfinite:
            return updates, GuardState(new_inner, state.skipped, norm)
        ok = jnp.isfinite(norm)
        updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
        new_inner = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_inner, state.inner)
        return updates, GuardState(new_inner, state.skipped + (~ok).astype(jnp.int32), norm)

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: TrainConfig, norm_fn: NormFn = optax.tree.norm) -> optax.GradientTransformation:
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
    return clip_and_guard(adamw, cfg.grad_clip, cfg.skip_nonfinite, norm_fn)
