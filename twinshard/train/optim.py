"""Optimizers: global-norm clipping + AdamW | Adafactor | Lion | SGD on the CS336 warmup/cosine schedule.

`make_optimizer(cfg)` builds `TrainConfig.optimizer` inside `clip_and_guard` (global-norm clipping,
then the skip of non-finite steps). Every optimizer runs on the same lr schedule with decoupled
weight decay lr(t) * weight_decay * param, so the flags keep their meaning across optimizers:
adamw (optax.adamw), lion (optax.lion: every step lr in size, so it wants an lr 3-10x below
AdamW's), sgd (heavy-ball momentum beta1, SGDW), adafactor (optax.adafactor's defaults, beta1,
beta2 and eps unused).

The global norm is a `norm_fn` the manual twin replaces with a psum of partial squares; AdamW,
Lion and SGD are then elementwise on local shards. Adafactor's means over whole rows, columns and
params come from `blocks` (one `Block` per param): `full_mean` on one device and under GSPMD, a
local mean + `pmean` over the axes splitting the reduced dims in the manual twin.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from twinshard.config import TrainConfig
from twinshard.optimizer_state import MIN_DIM_SIZE_TO_FACTOR, factored_dims

NormFn = Callable[[optax.Updates], jax.Array]


def cosine_lr(t, lr_max: float, lr_min: float, warmup_steps: int, cosine_steps: int):
    """CS336 `get_lr_cosine_schedule`: linear warmup from 0, cosine to lr_min at `cosine_steps`, then lr_min."""
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
    """Clip gradients to global L2 norm `max_norm` (0: none), then run `inner`; with `skip_nonfinite`
    an inf/nan norm makes a zero update and increments `skipped`."""

    def init(params):
        return GuardState(inner.init(params), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def update(grads, state, params=None):
        # float32 sums of squares whatever the gradients' dtype (a bf16 norm changed GuardState's type)
        norm = norm_fn(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        if max_norm > 0:
            scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        grads = in_param_dtypes(grads, params)
        updates, new_inner = inner.update(grads, state.inner, params)
        if not skip_nonfinite:
            return updates, GuardState(new_inner, state.skipped, norm)
        ok = jnp.isfinite(norm)
        updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
        new_inner = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_inner, state.inner)
        return updates, GuardState(new_inner, state.skipped + (~ok).astype(jnp.int32), norm)

    return optax.GradientTransformation(init, update)


def in_param_dtypes(grads: optax.Updates, params: optax.Params | None) -> optax.Updates:
    """Each gradient in its param's dtype, so the moments keep it (measured, optax 0.2: lion's and
    sgd's bf16 moments came back float32 from float32 gradients, changing the donated state's type)."""
    if params is None:
        return grads
    return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


# --- Adafactor, with injectable block means -------------------------------------------------

BlockMean = Callable[[jax.Array, tuple[int, ...]], jax.Array]
"""mean(x, dims): the mean over `dims` (kept, as size 1) of the WHOLE param-shaped array whose
(local) value is x. Adafactor's only non-elementwise operation."""


@dataclasses.dataclass(frozen=True)
class Block:
    """What Adafactor must know of a param beyond its local value: the whole shape (which decides the
    factored dims) and how to take means over whole rows, columns and params."""

    shape: tuple[int, ...]
    mean: BlockMean

CLIPPING_THRESHOLD = 1.0  # update clipping: block RMS of the scaled update <= 1
MIN_PARAM_SCALE = 1e-3  # the lr is relative to max(RMS(param), 1e-3)
DECAY_EXPONENT = 0.8  # second-moment decay 1 - (t+1)^-0.8
EPS = 1e-30  # added to squared gradients


def full_mean(x: jax.Array, dims: tuple[int, ...]) -> jax.Array:
    """The BlockMean of a whole array (one device; GSPMD's global view)."""
    return jnp.mean(x, axis=dims, keepdims=True)


def kept_dims(field: str | None, param_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The param dims an optimizer-state leaf keeps (optax's FactoredState: `v_row` without d0,
    `v_col` without d1, `v` all); None for a placeholder; other optimizers' moments keep all."""
    every = tuple(range(len(param_shape)))
    dims = factored_dims(param_shape)
    if field in ("v_row", "v_col"):
        if dims is None:
            return None
        removed = dims[1] if field == "v_row" else dims[0]
        return tuple(d for d in every if d != removed)
    if field == "v" and dims is not None:
        return None
    return every


def _blocks(blocks, tree):
    """`blocks`, or for arrays that are whole params (blocks=None): their own shapes and full_mean."""
    return jax.tree.map(lambda x: Block(x.shape, full_mean), tree) if blocks is None else blocks


def _everything(x: jax.Array) -> tuple[int, ...]:
    return tuple(range(x.ndim))


def scale_by_factored_rms(blocks=None) -> optax.GradientTransformation:
    """optax.scale_by_factored_rms (defaults) with its row/column means taken by `blocks`; for a
    factored g: v_row, v_col <- r v + (1-r) mean(g^2 + eps), update g / sqrt(v_row / mean(v_row)) / sqrt(v_col)."""
    init = optax.scale_by_factored_rms(min_dim_size_to_factor=MIN_DIM_SIZE_TO_FACTOR, epsilon=EPS).init

    def leaf(rate, g, v_row, v_col, v, block: Block):
        # the float32 `rate` promotes bf16 moments to float32: each is stored back in its own dtype (the
        # weight dtype), as the other optimizers' are, so a step returns the state in the types it was given
        g2, mean = jnp.square(g) + EPS, block.mean
        dims = factored_dims(block.shape)
        if dims is None:
            new_v = rate * v + (1 - rate) * g2
            return g * new_v ** -0.5, v_row, v_col, new_v.astype(v.dtype)
        d1, d0 = dims
        new_row = rate * v_row + (1 - rate) * jnp.squeeze(mean(g2, (d0,)), d0)
        new_col = rate * v_col + (1 - rate) * jnp.squeeze(mean(g2, (d1,)), d1)
        row = jnp.expand_dims(new_row, d0)
        row_factor = (row / mean(row, (d1,))) ** -0.5
        return (g * row_factor * jnp.expand_dims(new_col, d1) ** -0.5, new_row.astype(v_row.dtype),
                new_col.astype(v_col.dtype), v)

    def update(grads, state, params):
        rate = 1.0 - jnp.asarray(state.count + 1, jnp.float32) ** -DECAY_EXPONENT
        out = jax.tree.map(functools.partial(leaf, rate), grads, state.v_row, state.v_col, state.v,
                           _blocks(blocks, grads))
        field = lambda i: jax.tree.map(lambda _, o: o[i], grads, out)  # noqa: E731
        return field(0), optax.FactoredState(optax.safe_increment(state.count), field(1), field(2), field(3))

    return optax.GradientTransformation(init, update)


def clip_by_block_rms(threshold: float, blocks=None) -> optax.GradientTransformation:
    """optax.clip_by_block_rms: each param's update u -> u / max(1, RMS(u) / threshold)."""

    def update(updates, state, params=None):
        def clip(u, block: Block):
            return u / jnp.maximum(1.0, jnp.sqrt(block.mean(jnp.square(u), _everything(u))) / threshold)
        return jax.tree.map(clip, updates, _blocks(blocks, updates)), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def scale_by_param_block_rms(min_scale: float, blocks=None) -> optax.GradientTransformation:
    """optax.scale_by_param_block_rms: each param's update u -> u * max(RMS(param), min_scale)."""

    def update(updates, state, params):
        def scale(u, p, block: Block):
            return u * jnp.maximum(jnp.sqrt(block.mean(jnp.square(p), _everything(p))), min_scale)
        return jax.tree.map(scale, updates, params, _blocks(blocks, params)), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def adafactor(learning_rate: optax.Schedule, weight_decay: optax.Schedule,
              blocks=None) -> optax.GradientTransformation:
    """optax.adafactor with optax's defaults, its block means from `blocks` (tests/test_optimizers.py)."""
    return optax.chain(
        scale_by_factored_rms(blocks),
        clip_by_block_rms(CLIPPING_THRESHOLD, blocks),
        optax.scale_by_learning_rate(learning_rate, flip_sign=False),
        scale_by_param_block_rms(MIN_PARAM_SCALE, blocks),
        optax.add_decayed_weights(weight_decay),
        optax.scale(-1.0),
    )


def sgd(learning_rate: optax.Schedule, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    """Heavy-ball SGD with decoupled weight decay: m <- g + momentum m; update -lr (m + wd p)."""
    return optax.chain(optax.trace(decay=momentum), optax.add_decayed_weights(weight_decay),
                       optax.scale_by_learning_rate(learning_rate))


def make_optimizer(cfg: TrainConfig, norm_fn: NormFn = optax.tree.norm,
                   blocks=None) -> optax.GradientTransformation:
    """`cfg.optimizer` on `lr_schedule(cfg)` inside `clip_and_guard`; `norm_fn` and `blocks` as the
    module docstring says (None: the arrays are whole params)."""
    schedule = lr_schedule(cfg)
    if cfg.optimizer == "adamw":
        inner = optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    elif cfg.optimizer == "lion":
        inner = optax.lion(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay)
    elif cfg.optimizer == "sgd":
        inner = sgd(schedule, cfg.beta1, cfg.weight_decay)
    elif cfg.optimizer == "adafactor":
        inner = adafactor(schedule, lambda t: cfg.weight_decay * schedule(t), blocks)
    else:  # TrainConfig validates the name; a new entry of config.OPTIMIZERS needs a branch here
        raise ValueError(f"TrainConfig.optimizer={cfg.optimizer!r} has no optimizer in twinshard.train.optim.")
    return clip_and_guard(inner, cfg.grad_clip, cfg.skip_nonfinite, norm_fn)
