"""Optimizers: global-norm clipping + AdamW | Adafactor | Lion | SGD on the CS336 warmup/cosine schedule.

`make_optimizer(cfg)` builds `TrainConfig.optimizer` inside `clip_and_guard`
(global-norm clipping, then the skip of non-finite steps; its `GuardState` is
the outer state, which `trainer.apply_gradients` reads). Every optimizer runs
on the same lr schedule and decays weights the same way: decoupled, by
lr(t) * weight_decay * param per step (AdamW's convention), so `--lr`,
`--weight_decay` and the schedule keep their meaning across optimizers.

    adamw      optax.adamw(b1=beta1, b2=beta2, eps=eps, weight_decay).
               State 2 x params (mu, nu).
    lion       optax.lion(b1=beta1, b2=beta2, weight_decay): update
               sign(b1 m + (1-b1) g), momentum m <- b2 m + (1-b2) g (Chen et al.
               2023). State 1 x params (mu). The sign makes every step lr in
               size: Lion wants an lr 3-10x below AdamW's (and weight_decay
               3-10x above) - set them with --lr/--weight_decay.
    sgd        heavy-ball momentum with beta1 (optax.trace: m <- g + beta1 m,
               update -lr (m + weight_decay p): SGDW, the decay outside the
               momentum). The momentum buffer is always kept (beta1=0 is plain
               SGD with a buffer equal to g): state 1 x params.
    adafactor  `adafactor` below (Shazeer & Stern 2018) = optax.adafactor with
               its defaults - factored second moments for params with two dims
               >= 128 (min_dim_size_to_factor), decay 1-(t+1)^-0.8, eps 1e-30,
               update clipping at block RMS 1, lr relative to the param's RMS
               (multiply_by_parameter_scale, floor 1e-3), no momentum - on our
               lr schedule, with weight decay lr(t) * weight_decay. beta1/beta2/
               eps are NOT used. State: for a factored [.., n, .., m ..] param
               one row and one column statistic (the param with one of its two
               largest dims removed), else a full `v`.

The global norm is computed by a `norm_fn` the caller may replace: on one
device (and under GSPMD) it is `optax.tree.norm`; the manual shard_map twin
passes a norm whose partial sums of squares are `psum`-ed over the mesh axes
each gradient is sharded on. AdamW, Lion and SGD are elementwise after that,
so they run unchanged on local shards. Adafactor is not: its factored
statistics are means over whole rows and columns, its update clipping and its
parameter scale are RMSs of whole params. It takes those means from
`blocks` (one `Block` per param: its whole shape and a `BlockMean`): `full_mean`
(jnp.mean) on one device and under GSPMD (XLA adds the all-reduces), and in the
manual twin a local mean followed by a `pmean` over exactly the mesh axes that
split the reduced dims (manual_parallel/runner.py, `block_mean`). The GSPMD twin
needs nothing: its arrays are global, and XLA partitions each mean itself.
The extra all-reduces are rows and scalars, a few KiB a step.
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
        # float32 sums of squares whatever the gradients' dtype (bfloat16 weights: their norm in bf16
        # came back bfloat16, changing GuardState's type after the first step; XLA fuses the casts)
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
    """Each gradient in its param's dtype (bfloat16 weights: ModelConfig.weight_dtype), so the
    moments the optimizer keeps stay in that dtype. Measured (optax 0.2): lion's and sgd's moments
    initialised as bfloat16 came back float32 from an update on float32 gradients (the float32
    accumulator of grad_accum), so the donated state changed type after the first step."""
    if params is None:
        return grads
    return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


# --- Adafactor, with injectable block means -------------------------------------------------

BlockMean = Callable[[jax.Array, tuple[int, ...]], jax.Array]
"""mean(x, dims): the mean over `dims` (kept, as size 1) of the WHOLE param-shaped array whose
(local) value is x. Adafactor's only non-elementwise operation."""


@dataclasses.dataclass(frozen=True)
class Block:
    """What Adafactor must know of a param beyond its (possibly local) value: the whole param's
    shape (which dims are factored is decided on it - on a shard [L, D/8, F] the second largest
    dim may fall below 128) and how to take means over whole rows, columns and params."""

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
    """The param dims an optimizer-state leaf keeps, in order; None for a placeholder.

    `field` names the state leaf (optax's FactoredState: `v_row` = the param without d0,
    `v_col` = without d1, `v` = the full second moment of an unfactored param; the other
    slot(s) of each param hold zeros((1,)) placeholders). Every other optimizer's moments
    (mu, nu, trace) keep all dims."""
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
    """optax.scale_by_factored_rms (defaults) with its row/column means taken by `blocks`.

    For a factored param g [..., n@d1, ..., m@d0, ...] (keepdims shapes in comments):
        v_row <- r v_row + (1-r) mean_d0(g^2 + eps)        [..., n, ..., 1, ...]
        v_col <- r v_col + (1-r) mean_d1(g^2 + eps)        [..., 1, ..., m, ...]
        update = g / sqrt(v_row / mean_d1(v_row)) / sqrt(v_col)
    with r = 1 - (t+1)^-0.8; unfactored params: v <- r v + (1-r)(g^2 + eps), update g / sqrt(v).
    The state (and its init, on whole params) is optax's FactoredState.
    """
    init = optax.scale_by_factored_rms(min_dim_size_to_factor=MIN_DIM_SIZE_TO_FACTOR, epsilon=EPS).init

    def leaf(rate, g, v_row, v_col, v, block: Block):
        g2, mean = jnp.square(g) + EPS, block.mean
        dims = factored_dims(block.shape)
        if dims is None:
            v = rate * v + (1 - rate) * g2
            return g * v ** -0.5, v_row, v_col, v
        d1, d0 = dims
        v_row = rate * v_row + (1 - rate) * jnp.squeeze(mean(g2, (d0,)), d0)
        v_col = rate * v_col + (1 - rate) * jnp.squeeze(mean(g2, (d1,)), d1)
        row = jnp.expand_dims(v_row, d0)
        row_factor = (row / mean(row, (d1,))) ** -0.5
        return g * row_factor * jnp.expand_dims(v_col, d1) ** -0.5, v_row, v_col, v

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
    """optax.adafactor(learning_rate, weight_decay_rate=weight_decay) with optax's defaults,
    written out so that its four block means come from `blocks` (a params-shaped tree of Block;
    None: the arrays are whole params). Same chain and state as optax (tests/test_optimizers.py)."""
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
    """`cfg.optimizer` on `lr_schedule(cfg)` inside `clip_and_guard` (module docstring).

    norm_fn: the global gradient norm (manual twin: psum of partial squares).
    blocks: for Adafactor, a params-shaped tree of Block - each param's whole shape and its
    means over whole rows, columns and params (manual twin: local mean + pmean); None: the
    updated arrays are whole params (one device, GSPMD). Unused by the other optimizers.
    """
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
