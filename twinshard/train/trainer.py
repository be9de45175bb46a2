"""Train state and the strategy-agnostic train step (single device).

The state is a plain pytree: params as a nested dict of arrays (paths as in
twinshard/model/transformer.py), the optax state, and the step counter. Strategies reuse
`train_step` (auto_parallel/ jits it with shardings) or its pieces
(manual_parallel/ runs them inside shard_map with its own collectives).

Gradient accumulation (`TrainConfig.grad_accum` = K): `accumulated_value_and_grad`
splits the batch [B, T] into K micro-batches [K, B/K, T] and runs them one after
another under `lax.scan`, carrying the sum of the micro-batches' gradients of their
SUMMED token losses; after the loop, loss and gradients are divided by the total
token count. Weighting by tokens (not a mean of micro-batch means) keeps the result
the full-batch mean-loss gradient even when micro-batches hold different numbers of
target tokens (a loss mask, later); today every position is a target, so the counts
are equal and static. K = 1 is the plain `jax.value_and_grad` (no scan: the program
of a step without accumulation). Only one micro-batch's activations are alive at a
time; the price is a param-sized float32 gradient accumulator.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from twinshard.config import ModelConfig, TrainConfig
from twinshard.model import TransformerLM
from twinshard.train.optim import GuardState, lr_schedule, make_optimizer
from twinshard.model.hooks import SINGLE_DEVICE, Parallelism

Params = dict[str, Any]


class TrainState(NamedTuple):
    params: Params
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: number of updates applied


def init_key(seed: int, devices=None) -> jax.Array:
    """The init's PRNG key, made before the compiled init takes it as an argument (a constant key
    let XLA fold its derivations at compile time: the TPU compile of tiny's init fell from 3.3 s to
    1.3 s, measured AOT for v5e:1x1). On one TPU chip the key is "rbg" (the bits come from XLA's
    RngBitGenerator; keys still derive by threefry): threefry's 20 unrolled rounds cost the TPU
    compiler seconds per random call (gpt2_125m's init: 10.1 s -> 4.4 s, AOT for v5e:1x1). Elsewhere
    threefry: the same seed gives the same values on every backend and under any sharding, where
    rbg would draw each sharded weight whole on every device (gpt2_350m fsdp on v5e:2x4: 260 MiB of
    temporaries against 0.5). docs/speed.md, "init on a TPU"."""
    devices = jax.devices() if devices is None else list(devices)
    one_tpu = len(devices) == 1 and devices[0].platform == "tpu"
    return jax.random.key(seed, impl="rbg" if one_tpu else "threefry2x32")


def create_params(cfg: ModelConfig, seed: int | jax.Array) -> Params:
    """Initial parameters as a nested dict (same threefry seed -> same values under any sharding),
    stored in cfg.weight_dtype (drawn in float32, then rounded). `seed`: an int or init_key's key."""
    key = seed if isinstance(seed, jax.Array) else jax.random.key(seed)
    params = nnx.to_pure_dict(nnx.state(TransformerLM(cfg, rngs=nnx.Rngs(key)), nnx.Param))
    return jax.tree.map(lambda p: p.astype(cfg.weight_dtype), params)


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


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int | jax.Array) -> TrainState:
    params = create_params(model_cfg, seed)
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def abstract_state(model_cfg: ModelConfig, tx: optax.GradientTransformation) -> TrainState:
    """Shapes and dtypes of the train state (nothing is allocated)."""
    return jax.eval_shape(functools.partial(init_state, model_cfg, tx, 0))


def loss_fn(params: Params, x: jax.Array, y: jax.Array, cfg: ModelConfig,
            par: Parallelism = SINGLE_DEVICE) -> jax.Array:
    """Mean next-token loss of the model with `params` on tokens x [B, T], targets y [B, T]."""
    return nnx.merge(graphdef(cfg), params).loss(x, y, par)


def stats_fn(params: Params, x: jax.Array, y: jax.Array, cfg: ModelConfig,
             par: Parallelism = SINGLE_DEVICE) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, stats) of the model on x, y [B, T]: TransformerLM.loss_and_stats (the router's
    statistics of a mixture of experts; a dense model's stats hold the cross-entropy alone)."""
    return nnx.merge(graphdef(cfg), params).loss_and_stats(x, y, par)


def router_summary(stats: dict) -> dict[str, float | list[int]]:
    """The training log's view of `stats` (host values): the load-balancing loss averaged over
    layers, the fraction of assignments dropped over capacity, tokens kept per expert (summed over
    layers)."""
    import numpy as np

    dropped = np.asarray(stats["dropped"])
    return {"router_aux": float(np.mean(stats["aux"])), "router_z": float(np.mean(stats["z"])),
            "dropped_fraction": float(dropped.sum() / (int(stats["assignments"]) * dropped.size)),
            "tokens_per_expert": [int(n) for n in np.asarray(stats["tokens_per_expert"]).sum(axis=0)]}


def micro_batches(x: jax.Array, grad_accum: int) -> jax.Array:
    """[B, T] -> [K, B/K, T] with micro-batch k = the rows b with b % K == k (strided).

    Strided, so a batch sharded over `data` in contiguous blocks of B/data rows (B/data
    divisible by K: `check_grad_accum`) splits without moving a row: micro-batch k is
    the same global rows whether one device splits [B, T] or each device splits its
    local [B/data, T] (the manual twin), and the reshape is local under GSPMD."""
    b = x.shape[0]
    assert b % grad_accum == 0, (x.shape, grad_accum)
    return x.reshape(b // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1)


def check_grad_accum(train_cfg: TrainConfig, data_shards: int) -> None:
    """ValueError unless each of the `data_shards` batch shards splits into grad_accum micro-batches."""
    local, k = train_cfg.batch_size // data_shards, train_cfg.grad_accum
    if local % k:
        raise ValueError(
            f"TrainConfig.grad_accum={k} does not split the per-device batch of {local} sequences "
            f"(batch_size={train_cfg.batch_size} over data={data_shards}) into equal micro-batches; "
            f"choose grad_accum from {[n for n in range(1, local + 1) if local % n == 0]}, a "
            f"batch_size that is a multiple of {k * data_shards}, or a smaller data axis (--mesh, --devices).")


def all_tokens(y: jax.Array) -> jax.Array:
    """Tokens with a target in y [b, T]: all of them (no loss mask yet)."""
    return jnp.asarray(y.size, jnp.float32)


def accumulated_value_and_grad(loss: Callable[..., jax.Array], params: Params, x: jax.Array,
                               y: jax.Array, grad_accum: int,
                               count: Callable[[jax.Array], jax.Array] = all_tokens) -> tuple[jax.Array, Params]:
    """(mean token loss, its gradient) over x, y [B, T], as K = grad_accum micro-batches.

    `loss(params, x, y)` is the mean loss over the tokens `count(y)` counts. Each
    micro-batch [B/K, T] contributes its SUMMED loss (mean x its tokens) and that sum's
    gradient; the totals are divided by the total token count once, after the scan, so
    micro-batches weigh by their tokens (a masked loss passes the mask's sum as `count`).
    K = 1: plain `jax.value_and_grad`, no scan. Inside shard_map this runs on local shards
    and adds no collective of its own (the accumulator carries each device's
    unsynchronized gradient; the caller synchronizes once, after the loop).
    """
    if grad_accum == 1:
        return jax.value_and_grad(loss)(params, x, y)

    def summed(p, xm, ym):  # xm, ym: [B/K, T]
        tokens = count(ym)
        return loss(p, xm, ym) * tokens, tokens

    def body(grad_sum, batch):
        (loss_sum, tokens), grads = jax.value_and_grad(summed, has_aux=True)(params, *batch)
        return jax.tree.map(jnp.add, grad_sum, grads), (loss_sum, tokens)

    # the carry: a float32 zero gradient (jnp.zeros_like keeps each leaf's sharding and
    # shard_map varying-axes type; Explicit mode: the gradient's type, `zero_gradient`);
    # per-micro-batch scalars come out stacked [K]
    zeros = jax.tree.map(zero_gradient, params)
    grad_sum, (loss_sums, tokens) = jax.lax.scan(
        body, zeros, (micro_batches(x, grad_accum), micro_batches(y, grad_accum)))
    total = jnp.sum(tokens)
    return jnp.sum(loss_sums) / total, jax.tree.map(lambda g: per_token(g, total), grad_sum)


def zero_gradient(p: jax.Array) -> jax.Array:
    """A float32 zero of p's gradient type: jnp.zeros_like(p), in JAX's Explicit mode resharded to
    the cotangent type of p (a `reduced` param's gradient is `unreduced`: the accumulator of
    explicit_parallel/runner.py adds each micro-batch's partial sums, reduced once after the loop;
    zeros move no data)."""
    zero = jnp.zeros_like(p, jnp.float32)
    if not jax.typeof(p).sharding.mesh.explicit_axes:
        return zero
    return jax.sharding.reshard(zero, jax.typeof(p).to_ct_aval().sharding)


def per_token(grad_sum: jax.Array, total: jax.Array) -> jax.Array:
    """grad_sum / total. In Explicit mode a sum of partial sums (`unreduced`) divides only by a
    denominator `reduced` over the same axes (JAX 0.12: "Denominator should be reduced along the
    same axes numerator is unreduced on"): the scalar is cast to it, no data moves."""
    sharding = jax.typeof(grad_sum).sharding
    if sharding.spec.unreduced:
        total = jax.sharding.reshard(total, sharding.update(spec=jax.sharding.PartitionSpec(
            reduced=sharding.spec.unreduced)))
    return grad_sum / total


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
               par: Parallelism = SINGLE_DEVICE, value_and_grad: Callable | None = None,
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One step on x, y [B, T]. `value_and_grad(params, x, y)` -> (loss, grads) replaces the
    default: `loss_fn` under `par`, accumulated over train_cfg.grad_accum micro-batches."""
    if value_and_grad is None:
        value_and_grad = functools.partial(accumulated_value_and_grad, functools.partial(loss_fn, cfg=cfg, par=par),
                                           grad_accum=train_cfg.grad_accum)
    loss, grads = value_and_grad(state.params, x, y)
    state, metrics = apply_gradients(state, grads, tx, train_cfg)
    return state, {"loss": loss, **metrics}


class SingleDevice:
    """The reference run: one device, no sharding. Same interface as the strategy runners."""

    name = "single"

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig):
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.tx = make_optimizer(train_cfg)
        # The state lives committed on one device, fresh or restored. Measured (JAX 0.12.0.1):
        # jit lowers a committed single-device argument with a (replicated) sdy.sharding and an
        # uncommitted one without, so a fresh init (uncommitted) and an Orbax restore (committed)
        # compiled two train steps, identical but for those annotations: every --resume of a
        # single-device run compiled its step again.
        self.sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        step = functools.partial(train_step, cfg=model_cfg, train_cfg=train_cfg, tx=self.tx)
        self.train_step = jax.jit(step, donate_argnums=0)
        self.eval_loss = jax.jit(functools.partial(loss_fn, cfg=model_cfg))
        self.router_stats = jax.jit(functools.partial(stats_fn, cfg=model_cfg))
        self.loss_and_grads = jax.jit(functools.partial(
            accumulated_value_and_grad, functools.partial(loss_fn, cfg=model_cfg),
            grad_accum=train_cfg.grad_accum))

    def init_state(self, seed: int) -> TrainState:
        key = init_key(seed, self.sharding.device_set)
        return jax.jit(functools.partial(init_state, self.model_cfg, self.tx), out_shardings=self.sharding)(key)

    def place_batch(self, x, y):
        return jnp.asarray(x), jnp.asarray(y)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state (for checkpoint restore, and to lower the
        train step: the program that init_state's and a restore's state run)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.sharding),
                            abstract_state(self.model_cfg, self.tx))
