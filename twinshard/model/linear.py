"""How a module declares and uses a weight (Flax NNX), shared by the Transformer's modules.

A weight is an `nnx.Param` carrying its `logical_axes` (vocab, embed, heads, kv_heads, mlp, ...),
which a strategy maps to mesh axes; `use` hands it to the math as the strategy wants it (FSDP:
gathered), in the compute dtype. `Linear` is the bias-free [in, out] matmul every projection is.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from twinshard.model import layers
from twinshard.model.hooks import SINGLE_DEVICE, Parallelism

Array = jax.Array


def param(value: Array, axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(value, logical_axes=axes)


def use(var: nnx.Param, par: Parallelism, dtype: str = "float32") -> Array:
    """A weight as the strategy hands it to the math (FSDP: gathered), keyed by its logical axes.

    Cast to the compute dtype BEFORE the hook, so FSDP gathers the bf16 copy (half the bytes)
    and its gradient comes back through the cast as float32 for the float32 master weight."""
    return par.weight(var[...].astype(dtype), var.logical_axes)


def truncated_normal(key: Array, shape: tuple[int, ...], std: float) -> Array:
    """N(0, std^2) truncated at +-3 std."""
    return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)


class Linear(nnx.Module):
    """y = x W, W: [d_in, d_out], std sqrt(2 / (d_in + d_out)).

    `fan_out` overrides d_out in the std (the lm_head uses the unpadded vocab,
    as the CS336 model does); `valid_out` zeroes the padded output columns.
    """

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, rngs: nnx.Rngs,
                 fan_out: int | None = None, valid_out: int | None = None, dtype: str = "float32"):
        std = math.sqrt(2.0 / (d_in + (fan_out or d_out)))
        w = truncated_normal(rngs.params(), (d_in, d_out), std)
        if valid_out is not None:
            w = jnp.where(jnp.arange(d_out) < valid_out, w, 0.0)
        self.weight = param(w, axes)
        self.dtype = dtype

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        return layers.linear(x, use(self.weight, par, self.dtype), par.flat_rows)
