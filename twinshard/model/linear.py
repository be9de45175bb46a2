"""How a module declares and uses a weight (Flax NNX): an `nnx.Param` with its `logical_axes`,
handed to the math by `use` as the strategy wants it; `Linear` is the bias-free [in, out] matmul."""

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
    """A weight as the strategy hands it to the math, cast to the compute dtype BEFORE the hook (FSDP gathers bf16)."""
    return par.weight(var[...].astype(dtype), var.logical_axes)


def truncated_normal(key: Array, shape: tuple[int, ...], std: float) -> Array:
    """N(0, std^2) truncated at +-3 std."""
    return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)


class Linear(nnx.Module):
    """y = x W, W: [d_in, d_out], std sqrt(2 / (d_in + fan_out)); `valid_out` zeroes padded columns."""

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
