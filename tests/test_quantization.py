"""ModelConfig.quantization="int8" (--quantization=int8; twinshard/model/quantize.py): the blocks'
projections as int8 x int8 -> int32 dots, forward and for dx, with per-channel absmax scales.

- the product equals its definition (numpy: each operand rounded per channel, then multiplied) and dW
  is the unquantized x^T g;
- the traced step holds 7 int8 dots with int32 sums per layer forward and 7 backward (q, k, v, o, w1,
  w3, w2), the dW dots and the LM head in the compute dtype;
- each twin equals single device under int8 as tightly as without (the scales are per device, and
  no strategy it runs splits a quantized contraction); the ledger of each is unchanged by it;
- the loss stays within a stated band of bf16's over training steps on the embedded corpus.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import auto_parallel
import explicit_parallel
import manual_parallel
import reference
from runners import CFG
from test_data_tensor import LOSS_ATOL, NORM_RTOL, PARAM_ATOL
from twinshard import hlo
from twinshard.config import Config
from twinshard.model import layers
from twinshard.train import trainer

INT8 = Config(dataclasses.replace(CFG.model, quantization="int8"), CFG.train)
STEPS = 3
PER_LAYER = 7  # q, k, v, o, w1, w3, w2


def int8_rounded(v: np.ndarray, axis: int) -> np.ndarray:
    """v quantized to int8 by the absmax along `axis` (one scale per channel of the other axis), dequantized:
    qwix's symmetric int8, s = absmax / 127.5 (its largest bucket spans [126.5, 127.5)), round half to even."""
    scale = np.abs(v).max(axis=axis, keepdims=True) / np.float32(127.5)
    return np.clip(np.round(v / scale), -128, 127) * scale


def exact_operand(rng, shape: tuple[int, int], peak_column: int, channel_axis: int) -> np.ndarray:
    """Integers in [-255, 255] with 255 in `peak_column` of every row, times 2^(0..3) per channel along
    `channel_axis`: every absmax is 255 * 2^k, so s = 2^(k+1) and v / s is exact, ties and all (the
    absmax itself lands on 127.5, which float rounding would otherwise send either way). Channels of
    different magnitude tell per-channel scales from one scale per tensor."""
    v = rng.integers(-255, 256, size=shape).astype(np.float32)
    v[:, peak_column] = 255
    powers = 2.0 ** (np.arange(shape[channel_axis]) % 4)
    return (v * (powers[:, None] if channel_axis == 0 else powers[None, :])).astype(np.float32)


def test_the_product_and_its_gradients_are_per_channel_int8():
    rng = np.random.default_rng(0)
    x, g = exact_operand(rng, (16, 24), 0, 0), exact_operand(rng, (16, 40), 0, 0)  # per token
    w = exact_operand(rng, (40, 24), 3, 0).T.copy()  # [24, 40]: each column's peak 255 * 2^k in row 3
    w[:, 3] = 255 * 8  # each row's peak in column 3 (2^3: the largest power), for dx's per-row scales
    y, vjp = jax.vjp(lambda x, w: layers.matmul(x, w, "int8"), x, w)
    dx, dw = vjp(g)
    want = int8_rounded(x, 1) @ int8_rounded(w, 0)  # x per token, w per output column, both over `in`
    np.testing.assert_allclose(y, want, rtol=1e-6)
    np.testing.assert_allclose(dx, int8_rounded(g, 1) @ int8_rounded(w, 1).T, rtol=1e-6)  # w per row, over `out`
    np.testing.assert_allclose(dw, x.T @ g, rtol=1e-6)  # dW unquantized
    assert float(np.abs(y - x @ w).max()) > 1.0  # rounded: the check can fail


def dots(cfg) -> list[tuple]:
    """(input dtypes, output dtype, output shape) of every dot_general of the traced gradient step, scans
    and custom rules included; with scan_unroll 1 each scanned layer's dots appear once."""
    params = jax.eval_shape(functools.partial(trainer.create_params, cfg, 0))
    x = jax.ShapeDtypeStruct((CFG.train.batch_size, cfg.context_length), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(functools.partial(trainer.loss_fn, cfg=cfg)))(params, x, x)
    found = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general":
                out = eqn.outvars[0].aval
                found.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(out.dtype), out.shape))
            for p in eqn.params.values():
                for sub in p if isinstance(p, (list, tuple)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_layer_runs_its_projections_as_int8_dots_forward_and_backward(dtype):
    m = dataclasses.replace(INT8.model, dtype=dtype)
    d, f, kv, rows = m.d_model, m.d_ff, m.kv_dim, CFG.train.batch_size * m.context_length
    int8 = sorted(shape for ins, out, shape in dots(m) if ins == ("int8", "int8") and out == "int32")
    # forward [rows, out]: q, o [D], k, v [kv], w1, w3 [F], w2 [D]; backward dx [rows, in]: q, k, v, w1, w3 [D], o [D], w2 [F]
    forward = [(rows, n) for n in (d, kv, kv, d, f, f, d)]
    backward = [(rows, n) for n in (d, d, d, d, d, d, f)]
    assert int8 == sorted(forward + backward) and len(int8) == 2 * PER_LAYER
    plain = [(ins, shape) for ins, out, shape in dots(m) if ins != ("int8", "int8")]
    assert sum(shape in ((d, d), (d, kv), (d, f), (f, d)) for _, shape in plain) == PER_LAYER  # the dW dots
    assert all(ins == (dtype, dtype) for ins, _ in plain)  # attention, the LM head, dW: unquantized
    assert not [s for ins, out, s in dots(dataclasses.replace(m, quantization="none")) if "int8" in ins]
