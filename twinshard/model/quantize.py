"""int8 training matmuls (ModelConfig.quantization="int8"), through qwix's public quantize and dot_general.

Each quantized product is ONE int8 x int8 dot_general summed in int32, each operand quantized per
channel by its absmax over the contracted axis (s = max|.| / 127, q = round(v / s) in [-127, 127]):

    forward   y [M, out] = (x_q [M, in] . w_q [in, out]) * s_x [M, 1] * s_w [1, out]   s_x per token, s_w per column
    backward  dx [M, in] = (g_q [M, out] . w^T_q [out, in]) * s_g [M, 1] * s_w' [1, in]  w re-quantized per row
              dW [in, out] = x^T g in the compute dtype, unquantized (matmuls._matmul_bwd)

dW stays in the compute dtype as in MaxText's int8 (AQT's drhs_bits=None): its contraction runs over
the tokens, which every data-parallel strategy splits, so a per-channel scale would be a max over
devices. The scales are those of the per-device product (after FSDP's all-gather), so no collective
is added; a strategy that splits a quantized contraction (Megatron's `tensor` axis splits `in` of the
row-parallel projections and `out` of the column-parallel ones' dx) is refused (parallel/resolve.py).

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
# qwix's absmax, scaled so the absmax maps to 127 (qwix's default maps it to 127.5, which rounds to 128 and
# overflows int8: XLA:CPU's convert wrapped it to -128 in one fusion and saturated it in another, measured)
ABSMAX = f"absmax,{127.5 / 127!r}"
_MODE = TraceSetting(default=lambda: "none")


def quantizing(mode: str):
    """The products layers.linear traces inside run as `mode` ("none" or "int8"; ModelConfig.quantization)."""
    return _MODE.using(mode)


def active() -> str:
    """The quantization of the products traced now ("none" outside `quantizing`)."""
    return _MODE.current()


def int8_product(x: Array, w: Array, out_sharding=None) -> Array:
    """x [..., in] @ w [in, out] -> [..., out] in x.dtype: x quantized per row (each token over `in`), w per
    column (over `in`), one int8 dot_general into int32, then the float32 scales (`out_sharding`: Explicit mode's)."""
    w = _unreduced(w)
    xq = qwix.quantize(x, jnp.int8, channelwise_axes=tuple(range(x.ndim - 1)), calibration_method=ABSMAX,
                       scale_dtype=jnp.float32)
    wq = qwix.quantize(w, jnp.int8, channelwise_axes=(1,), calibration_method=ABSMAX, scale_dtype=jnp.float32)
    contract = (((x.ndim - 1,), (0,)), ((), ()))
    return qwix.dot_general(xq, wq, contract, out_sharding=out_sharding).astype(x.dtype)


def _unreduced(w: Array) -> Array:
    """w without Explicit mode's `reduced` type (explicit_parallel's weights: reduced over the token axes for
    their gradient), which JAX 0.12 refuses beside a sharded operand in the scales' elementwise work."""
    sharding = jax.typeof(w).sharding
    if not sharding.spec.reduced:
        return w
    return jax.sharding.reshard(w, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
        *sharding.spec.partitions)))
