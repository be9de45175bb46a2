"""Train state and the strategy-agnostic train step (single device).

The state is a plain pytree (params dict, optax state, step). auto_parallel/ jits `train_step`;
manual_parallel/ runs its pieces inside shard_map. `accumulated_value_and_grad` runs grad_accum
micro-batches under `lax.scan`, weighting each by its tokens, so the result is the full-batch
gradient; only one micro-batch's activations are alive, beside a float32 gradient accumulator.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from twinshard.config import GRAD_ACCUM_DTYPES, ModelConfig, TrainConfig
from twinshard.model import TransformerLM
from twinshard.train.optim import GuardState, lr_schedule, make_optimizer
from twinshard.train.xla_options import compiler_options  # the train step's XLA options, beside it
from twinshard.model.hooks import SINGLE_DEVICE, Parallelism

Params = dict[str, Any]


class TrainState(NamedTuple):
    params: Params
    opt_state: optax.OptState
    step: jax.Array  # int32 scalar: number of updates applied


def init_key(seed: int) -> jax.Array:
    """The init's PRNG key, passed to the compiled init as an argument (a constant key let XLA fold
    its derivations at compile time: tiny's TPU init compile 3.3 s -> 1.3 s, measured AOT for v5e:1x1)."""
    return jax.random.key(seed, impl="threefry2x32")  # pinned: the same values whatever jax_default_prng_impl


def draws_on_host(devices) -> bool:
    """Whether the init's random draws run on the host CPU: on one TPU chip, where each random
    chain costs the TPU compiler seconds (measured on a v5e: one normal [12, 768, 2048] 1.5-3.9 s
    with rbg bits, 10.5 s with threefry; gpt2_125m's whole init 8.4 s). The host's threefry draws
    the same values as any device (docs/speed.md, "Init on a TPU")."""
    devices = list(devices)
    if len(devices) != 1 or devices[0].platform != "tpu":
        return False
    try:
        return bool(jax.local_devices(backend="cpu"))
    except RuntimeError:  # JAX_PLATFORMS=tpu: no host backend; the chip draws (threefry: a slower compile)
        return False


def init_on_host(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, sharding) -> TrainState:
    """init_state's values with the params drawn by the host CPU, copied to `sharding`'s device,
    and the optimizer state (zeros) made there."""
    cpu = jax.local_devices(backend="cpu")[0]  # this process's host (jax.devices("cpu")[0] is process 0's)
    with jax.default_device(cpu):
        params = jax.jit(functools.partial(create_params, model_cfg))(init_key(seed))
    params = jax.device_put(params, sharding)
    return jax.jit(functools.partial(state_of, tx), out_shardings=sharding, donate_argnums=0)(params)


def create_params(cfg: ModelConfig, seed: int | jax.Array) -> Params:
    """Initial parameters (same seed -> same values under any sharding) in cfg.weight_dtype; `seed`: int or init_key's key."""
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


def state_of(tx: optax.GradientTransformation, params: Params) -> TrainState:
    """The train state at step 0 around `params`."""
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int | jax.Array) -> TrainState:
    return state_of(tx, create_params(model_cfg, seed))


def abstract_state(model_cfg: ModelConfig, tx: optax.GradientTransformation) -> TrainState:
    """Shapes and dtypes of the train state (nothing is allocated)."""
    return jax.eval_shape(functools.partial(init_state, model_cfg, tx, 0))


def loss_fn(params: Params, x: jax.Array, y: jax.Array, cfg: ModelConfig,
            par: Parallelism = SINGLE_DEVICE) -> jax.Array:
    """Mean next-token loss of the model with `params` on tokens x [B, T], targets y [B, T]."""
    return nnx.merge(graphdef(cfg), params).loss(x, y, par)


def stats_fn(params: Params, x: jax.Array, y: jax.Array, cfg: ModelConfig,
             par: Parallelism = SINGLE_DEVICE) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, stats) of the model on x, y [B, T] (a dense model's stats hold the cross-entropy alone)."""
    return nnx.merge(graphdef(cfg), params).loss_and_stats(x, y, par)


def router_summary(stats: dict) -> dict[str, float | list[int]]:
    """The training log's view of `stats`: mean aux loss, the dropped fraction, tokens per expert."""
    import numpy as np

    dropped = np.asarray(stats["dropped"])
    return {"router_aux": float(np.mean(stats["aux"])), "router_z": float(np.mean(stats["z"])),
            "dropped_fraction": float(dropped.sum() / (int(stats["assignments"]) * dropped.size)),
            "tokens_per_expert": [int(n) for n in np.asarray(stats["tokens_per_expert"]).sum(axis=0)]}


def micro_batches(x: jax.Array, grad_accum: int) -> jax.Array:
    """[B, T] -> [K, B/K, T], micro-batch k = the rows b % K == k: strided, so a contiguously
    sharded batch splits without moving a row."""
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
                               count: Callable[[jax.Array], jax.Array] = all_tokens,
                               sum_dtype: str = "float32", per_layer: tuple[str, ...] = ()) -> tuple[jax.Array, Params]:
    """(mean token loss, its gradient) over x, y [B, T] as K = grad_accum micro-batches, each adding
    its SUMMED loss; divided by the token count once after the scan. K = 1: plain value_and_grad.
    The gradient comes back in each param's dtype whatever K (the accumulator cast once). The sum runs in
    float32, or with sum_dtype="weight" in each param's own dtype (--grad_accum_dtype: bf16 weights add
    bf16 gradients, as frameworks that accumulate into the param's .grad do; on one v5e 17 ms less a step
    at the 160M shape's 16 micro-batches, BENCHMARKS "TPU (one v5e)").
    Inside shard_map it adds no collective (the caller synchronizes once).
    per_layer: keys of params holding a stack of layers [L, ...] (`unrolled_stacks`) whose gradient is summed
    layer by layer (`sum_by_layer`)."""
    if grad_accum == 1:
        return jax.value_and_grad(loss)(params, x, y)
    if per_layer:
        return sum_by_layer(loss, params, x, y, grad_accum, count, sum_dtype, per_layer)

    def summed(p, xm, ym):  # xm, ym: [B/K, T]
        tokens = count(ym)
        return loss(p, xm, ym) * tokens, tokens

    def body(grad_sum, batch):
        (loss_sum, tokens), grads = jax.value_and_grad(summed, has_aux=True)(params, *batch)
        return jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads), (loss_sum, tokens)

    # the carry: a zero gradient of each leaf's sharding / type in the sum's dtype; per-micro-batch scalars stacked [K]
    zeros = jax.tree.map(functools.partial(zero_gradient, sum_dtype=sum_dtype), params)
    grad_sum, (loss_sums, tokens) = jax.lax.scan(
        body, zeros, (micro_batches(x, grad_accum), micro_batches(y, grad_accum)))
    total = jnp.sum(tokens)
    # The one rule of gradient bytes: a gradient leaves accumulation in its param's dtype, so every twin's
    # data-parallel reduction after this moves it in the weight dtype (bf16 weights: half of float32's bytes).
    return jnp.sum(loss_sums) / total, jax.tree.map(lambda g, p: per_token(g, total).astype(p.dtype), grad_sum, params)


def sum_by_layer(loss: Callable[..., jax.Array], params: Params, x: jax.Array, y: jax.Array, grad_accum: int,
                 count: Callable[[jax.Array], jax.Array], sum_dtype: str,
                 stacks: tuple[str, ...]) -> tuple[jax.Array, Params]:
    """accumulated_value_and_grad with each layer of params[stack] [L, ...] carried through the micro-batch
    loop as a param of its own (restacked inside it, where XLA reads each layer back from its own array): the
    running sum is then L arrays a leaf, and XLA adds each layer's weight gradient into its sum in the
    matmul that makes it, instead of writing the [L, ...] gradient out and adding it after (on one v5e at the
    160M shape: 783.9 ms a step against 795.2, BENCHMARKS.md "TPU (one v5e)"). Only for a fully unrolled
    stack: a rolled scan would restack its L arrays every micro-batch."""
    unknown = [k for k in stacks if k not in params]
    if unknown:
        raise ValueError(f"per_layer={stacks}: {unknown} not among the params' keys {sorted(params)}.")
    rest = {k: v for k, v in params.items() if k not in stacks}
    layers = {k: [jax.tree.map(lambda a, i=i: a[i], params[k]) for i in range(_depth(params[k]))] for k in stacks}

    def whole(rest: Params, layers: dict) -> Params:  # the params as the model takes them, [L, ...] stacks
        return {**rest, **{k: jax.tree.map(lambda *a: jnp.stack(a), *layers[k]) for k in stacks}}

    loss_sum, (rest_grad, layer_grads) = accumulated_value_and_grad(
        lambda p, xm, ym: loss(whole(*p), xm, ym), (rest, layers), x, y, grad_accum, count, sum_dtype)
    return loss_sum, whole(rest_grad, layer_grads)


def _depth(stack: Params) -> int:
    """L of a stack of layers whose every leaf is [L, ...]."""
    return jax.tree.leaves(stack)[0].shape[0]


def unrolled_stacks(cfg: ModelConfig, grad_accum: int) -> tuple[str, ...]:
    """The params' keys of the layer stacks `sum_by_layer` should sum: each stack of more than one layer whose
    scan is fully unrolled (ModelConfig.scan_unroll >= its depth), where there are micro-batches to sum."""
    if grad_accum == 1:
        return ()
    return tuple(name for name, stack in cfg.stacks if 1 < stack.num_layers <= cfg.scan_unroll)


def zero_gradient(p: jax.Array, sum_dtype: str = "float32") -> jax.Array:
    """A zero of p's gradient type, float32 or (sum_dtype="weight") p's own dtype (in Explicit mode a
    `reduced` param's is `unreduced`)."""
    if sum_dtype not in GRAD_ACCUM_DTYPES:
        raise ValueError(f"sum_dtype={sum_dtype!r}: choose one of {', '.join(GRAD_ACCUM_DTYPES)}.")
    zero = jnp.zeros_like(p, jnp.float32 if sum_dtype == "float32" else p.dtype)
    if not jax.typeof(p).sharding.mesh.explicit_axes:
        return zero
    return jax.sharding.reshard(zero, jax.typeof(p).to_ct_aval().sharding)


def per_token(grad_sum: jax.Array, total: jax.Array) -> jax.Array:
    """grad_sum / total; in Explicit mode the denominator is cast `reduced` over the axes the numerator
    is unreduced on (JAX 0.12 refuses otherwise), moving no data."""
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
    # a skipped update leaves optax's count behind: report the lr this update used (or would have)
    applied_before = state.step - state.opt_state.skipped
    metrics = {"grad_norm": guard.grad_norm, "lr": lr_schedule(train_cfg)(applied_before),
               "skipped": guard.skipped}
    return TrainState(params, opt_state, state.step + 1), metrics


def train_step(state: TrainState, x: jax.Array, y: jax.Array, *, cfg: ModelConfig,
               train_cfg: TrainConfig, tx: optax.GradientTransformation,
               par: Parallelism = SINGLE_DEVICE, value_and_grad: Callable | None = None,
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One step on x, y [B, T]; `value_and_grad(params, x, y)` -> (loss, grads) replaces the default."""
    if value_and_grad is None:
        value_and_grad = functools.partial(accumulated_value_and_grad, functools.partial(loss_fn, cfg=cfg, par=par),
                                           grad_accum=train_cfg.grad_accum, sum_dtype=train_cfg.grad_accum_dtype,
                                           per_layer=unrolled_stacks(cfg, train_cfg.grad_accum))
    loss, grads = value_and_grad(state.params, x, y)
    state, metrics = apply_gradients(state, grads, tx, train_cfg)
    return state, {"loss": loss, **metrics}


class SingleDevice:
    """The reference run: one device, no sharding. Same interface as the strategy runners."""

    name = "single"

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig):
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.tx = make_optimizer(train_cfg)
        # The state lives committed on one device: measured (JAX 0.12.0.1), an uncommitted fresh init
        # and a committed restore compiled two train steps, differing only in sdy.sharding annotations.
        self.sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        step = functools.partial(train_step, cfg=model_cfg, train_cfg=train_cfg, tx=self.tx)
        options = compiler_options(model_cfg, jax.local_devices()[0].platform, 1)
        self.train_step = jax.jit(step, donate_argnums=0, compiler_options=options)
        self.eval_loss = jax.jit(functools.partial(loss_fn, cfg=model_cfg), compiler_options=options)
        self.router_stats = jax.jit(functools.partial(stats_fn, cfg=model_cfg))
        self.loss_and_grads = jax.jit(functools.partial(
            accumulated_value_and_grad, functools.partial(loss_fn, cfg=model_cfg),
            grad_accum=train_cfg.grad_accum, sum_dtype=train_cfg.grad_accum_dtype))

    def init_state(self, seed: int) -> TrainState:
        if draws_on_host(self.sharding.device_set):
            return init_on_host(self.model_cfg, self.tx, seed, self.sharding)
        init = functools.partial(init_state, self.model_cfg, self.tx)
        return jax.jit(init, out_shardings=self.sharding)(init_key(seed))

    def place_batch(self, x, y):
        return jnp.asarray(x), jnp.asarray(y)

    def to_model(self, tree):
        """The layers are in the model's order here (twinshard/placed.py's runners may store them otherwise)."""
        return tree

    to_stored = to_model

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state (for restore and for lowering the train step)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.sharding),
                            abstract_state(self.model_cfg, self.tx))
