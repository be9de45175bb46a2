"""Train state and the strategy-agnostic train step (single device).

The state is a plain pytree: params as a nested dict of arrays (paths as in
twinshard/model.py), the optax state, and the step counter. Strategies reuse
`train_step` (auto_parallel/ jits it with shardings) or its pieces
(manual_parallel/ runs them inside shard_map with its own collectives).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from twinshard.config import ModelConfig, TrainConfig
from twinshard.model import TransformerLM
from twinshard.optim import GuardState, lr_schedule, make_optimizer
from twinshard.parallelism import SINGLE_DEVICE, Parallelism

Params = dict[str, Any]


class TrainState(NamedTuple):
    params: Params
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: number of updates applied


def create_params(cfg: ModelConfig, seed: int) -> Params:
    """Initial parameters as a nested dict (same seed -> same values under any sharding)."""
    return nnx.to_pure_dict(nnx.state(TransformerLM(cfg, rngs=nnx.Rngs(seed)), nnx.Param))


@functools.lru_cache(maxsize=None)
def graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    """The model's static structure (no arrays are created)."""
    return nnx.split(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0))))[0]


def logical_axes(cfg: ModelConfig) -> Params:
    """The params' logical axis names, e.g. {'lm_head': {'weight': ('embed', 'vocab')}, ...}."""
    abstract = nnx.state(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return nnx.to_pure_dict(jax.tree.map(
        lambda v: v.get_metadata()["logical_axes"], abstract,
        is_leaf=lambda x: isinstance(x, nnx.Variable)))


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int) -> TrainState:
    params = create_params(model_cfg, seed)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def abstract_state(model_cfg: ModelConfig, tx: optax.GradientTransformation) -> TrainState:
    """Shapes and dtypes of the train state (nothing is allocated)."""
    return jax.eval_shape(functools.partial(init_state, model_cfg, tx, 0))


def loss_fn(params: Params, x: jax.Array, y: jax.Array, cfg: ModelConfig,
            par: Parallelism = SINGLE_DEVICE) -> jax.Array:
    """Mean next-token loss of the model with `params` on tokens x [B, T], targets y [B, T]."""
    return nnx.merge(graphdef(cfg), params).loss(x, y, par)


def apply_gradients(state: TrainState, grads: Params, tx: optax.GradientTransformation,
                    train_cfg: TrainConfig) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update; returns the new state and its metrics (grad norm, lr, skips)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    guard: GuardState = opt_state
    # A skipped update leaves optax's step count behind, so the schedule runs on
    # the count of applied updates: report the lr this update used (or would have).
    applied_before = state.step - state.opt_state.skipped
    metrics = {"grad_norm": guard.grad_norm, "lr": lr_schedule(train_cfg)(applied_before),
               "skipped": guard.skipped}
    return TrainState(params, opt_state, state.step + 1), metrics


def train_step(state: TrainState, x: jax.Array, y: jax.Array, *, cfg: ModelConfig,
               train_cfg: TrainConfig, tx: optax.GradientTransformation,
               par: Parallelism = SINGLE_DEVICE) -> tuple[TrainState, dict[str, jax.Array]]:
    loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y, cfg, par)
    state, metrics = apply_gradients(state, grads, tx, train_cfg)
    return state, {"loss": loss, **metrics}


class SingleDevice:
    """The reference run: one device, no sharding. Same interface as the strategy runners."""

    name = "single"

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig):
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.tx = make_optimizer(train_cfg)
        step = functools.partial(train_step, cfg=model_cfg, train_cfg=train_cfg, tx=self.tx)
        self.train_step = jax.jit(step, donate_argnums=0)
        self.eval_loss = jax.jit(functools.partial(loss_fn, cfg=model_cfg))
        self.loss_and_grads = jax.jit(jax.value_and_grad(functools.partial(loss_fn, cfg=model_cfg)))

    def init_state(self, seed: int) -> TrainState:
        return jax.jit(functools.partial(init_state, self.model_cfg, self.tx, seed))()

    def place_batch(self, x, y):
        return jnp.asarray(x), jnp.asarray(y)

    def abstract_state(self) -> TrainState:
        """Shapes/dtypes (with shardings, for strategies) of the state, for checkpoint restore."""
        return abstract_state(self.model_cfg, self.tx)
