"""int8 training matmuls (ModelConfig.quantization "int8" and "int8_dw"), as qwix QArrays multiplied by qwix's
dot_general: ONE int8 x int8 dot summed in int32 per product, then the float32 scales.

Every operand is quantized by `quantized`: one float32 scale per channel, s = absmax / 127 over the
contracted axis, q = round(v / s) in [-127, 127]:

    forward  y [M, out]  = (x_q [M, in] . w_q [in, out]) * s_x [M, 1] * s_w [1, out]     x per token, w per column
    dx       dx [M, in]  = ((g s_w)_q [M, out] . w_q^T [out, in]) * s_g [M, 1]          the forward's w_q
    dW       "int8":    x^T g in the compute dtype, unquantized (matmuls._matmul_bwd)
             "int8_dw": (x_q^T [in, M] . g_q [M, out]) * s_x [in, 1] * s_g [1, out]  x, g per column over M

dx rests on w ~ w_q s_w: g w^T ~ (g s_w) w_q^T, so the backward re-rounds w by the forward's saved scales
(the same int8 values: no second absmax pass over the weight, and dx is the gradient of the forward's
int8 product up to g's rounding). Only s_w is saved: FSDP re-gathers w for dx as without int8.

On one v5e (llama_v5e) int8_dw's step is 1.24x bf16's tokens/s in 2 sequences and 1.21x in 3 or 4: the
roundings' memory-bound passes grow faster than the tokens (BENCHMARKS.md, "int8 matmuls").

"int8" is MaxText's int8 (AQT's drhs_bits=None). "int8_dw" also quantizes dW, whose contraction runs over
the tokens that data, FSDP and context parallelism split: its absmax is taken over the WHOLE batch, a pmax
over `splitting_tokens`' mesh axes in shard_map (GSPMD's and Explicit mode's max over a split axis is global
already), so each twin rounds as one device does. Gradient accumulation and pipelines quantize each
micro-batch's dW over its own tokens. The other scales are the per-device product's own (after FSDP's
all-gather); a strategy that splits a quantized contraction (Megatron's `tensor` axis) is refused
(parallel/resolve.py).

Quantized: the blocks' projections, q, k, v, o and the SwiGLU's w1, w3, w2 (the `Block` enters
`quantizing`). In the compute dtype: the LM head (its [tokens, V] logits feed the float32 loss),
attention's q k^T and p v (activations on both sides; MaxText and qwix leave them unquantized too),
the experts' einsums and the router (twinshard/model/moe.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix

from twinshard.model.tracing import TraceSetting

Array = jax.Array
_MODE = TraceSetting(default=lambda: "none")
_TOKEN_AXES = TraceSetting(default=lambda: ())


def quantizing(mode: str):
    """The products layers.linear traces inside run as `mode` ("none", "int8", "int8_dw"; ModelConfig.quantization)."""
    return _MODE.using(mode)


def active() -> str:
    """The quantization of the products traced now ("none" outside `quantizing`)."""
    return _MODE.current()


def splitting_tokens(axes: tuple[str, ...]):
    """Inside shard_map: the mesh axes that split this step's tokens (ManualRunner.token_axes), over which
    "int8_dw" takes dW's absmax."""
    return _TOKEN_AXES.using(tuple(axes))


def token_axes() -> tuple[str, ...]:
    """The mesh axes `splitting_tokens` names now (() outside it: one device, GSPMD, Explicit mode)."""
    return _TOKEN_AXES.current()


def quantized(v: Array, reduce: tuple[int, ...], scale: Array | None = None, over: tuple[str, ...] = ()) -> qwix.QArray:
    """v in int8 with one float32 scale per channel of the axes not in `reduce`: s = absmax / 127, the absmax
    over `reduce` (and the mesh axes `over`: a pmax), q = round(v / s); `scale`: s given (a saved one)."""
    if scale is None:
        absmax = jnp.max(jnp.abs(v), axis=reduce, keepdims=True).astype(jnp.float32)
        if over:
            absmax = jax.lax.pmax(absmax, over)
        scale = jnp.where(absmax > 0, absmax / 127, 1.0)  # an all-zero channel: q = 0 by any scale
    q = jnp.clip(jnp.round(v.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8)
    return qwix.QArray(q, scale, None, jnp.int8)


def int8_forward(x: Array, w: Array, out_sharding=None) -> tuple[Array, Array]:
    """(x [..., in] @ w [in, out] -> [..., out] in x.dtype, s_w [1, out]): x per token, w per column, each over
    `in`; `out_sharding`: Explicit mode's. s_w is the backward's residual (`int8_dx`)."""
    w = _unreduced(w)
    xq, wq = quantized(x, (x.ndim - 1,)), quantized(w, (0,))
    contract = (((x.ndim - 1,), (0,)), ((), ()))
    return qwix.dot_general(xq, wq, contract, out_sharding=out_sharding).astype(x.dtype), wq.scale


def int8_dx(g: Array, w: Array, s_w: Array, out_sharding=None) -> Array:
    """dx [..., in] of the forward's product, from g [..., out]: (g s_w) per token over `out`, times w re-rounded
    by the forward's column scales s_w [1, out] (the forward's int8 values), contracted over `out`."""
    w = _unreduced(w)
    # g s_w in g's dtype: XLA:TPU writes it once for its two readers (the absmax, the rounding), and in float32
    # that was a float32 [tokens, F] array per MLP product (llama_v5e int8_dw: 119.1 -> 111.2 ms a step on the chip)
    gq = quantized(g * s_w.astype(g.dtype), (g.ndim - 1,))
    wq = qwix.QArray(quantized(w, (0,), scale=s_w).qvalue, jnp.ones((1, 1), jnp.float32), None, jnp.int8)  # s_w: in gq
    contract = (((g.ndim - 1,), (1,)), ((), ()))
    return qwix.dot_general(gq, wq, contract, out_sharding=out_sharding).astype(g.dtype)


def int8_dw(x: Array, g: Array, over: tuple[str, ...] = (), out_sharding=None) -> Array:
    """dW [in, out] = x^T g as ONE int8 dot summed in int32 over the tokens: x [..., in] and g [..., out] each
    per column, the absmax over every token (`over`: the mesh axes splitting them, ManualRunner's)."""
    lead = tuple(range(x.ndim - 1))
    # x rounded again, per column: reusing the forward's per-token x_q (x^T g = x_q^T (s_x g), one pmax per
    # product instead of per operand) measured 112.9 against 111.2 ms a step on llama_v5e on the chip
    xq, gq = (_reduced_scales(quantized(v, lead, over=over), out_sharding) for v in (x, g))
    return qwix.dot_general(xq, gq, ((lead, lead), ((), ())), out_sharding=out_sharding)


def _reduced_scales(q: qwix.QArray, out_sharding) -> qwix.QArray:
    """q with its (replicated) scales typed `reduced` over the axes the product's int32 partial sums are
    `unreduced` over (Explicit mode: JAX 0.12 multiplies an unreduced array only by one reduced alike)."""
    if out_sharding is None or not out_sharding.spec.unreduced:
        return q
    spec = jax.sharding.PartitionSpec(*[None] * q.ndim, reduced=out_sharding.spec.unreduced)
    return qwix.QArray(q.qvalue, jax.sharding.reshard(q.scale, jax.sharding.NamedSharding(out_sharding.mesh, spec)),
                       None, q.qtype)


def _unreduced(w: Array) -> Array:
    """w without Explicit mode's `reduced` type (explicit_parallel's weights: reduced over the token axes for
    their gradient), which JAX 0.12 refuses beside a sharded operand in the scales' elementwise work."""
    sharding = jax.typeof(w).sharding
    if not sharding.spec.reduced:
        return w
    return jax.sharding.reshard(w, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        *sharding.spec.partitions)))
