"""Layer math, once: pure functions on arrays, called by every strategy. Local sizes come from
array shapes, never a world size (under Megatron TP `wq` arrives as [D, H/tensor * dh]).
Notation: B batch, T sequence, D d_model, H heads, dh head dim, F d_ff, V vocab."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from twinshard.splash_blocks import splash_block, splash_padded
from twinshard.model import quantize, taps
from twinshard.model.matmuls import cotangent_like, matmul, partial_sums, varying_axes
from twinshard.model.tracing import TraceSetting


Array = jax.Array
# checkpoint_name of the attention kernel's saved out and log-sum-exp (remat policy "minimal")
ATTENTION_RESIDUALS = "attention_residuals"
# checkpoint_name of the SwiGLU projections (MaxText's names): w1, w3 outputs; w2's output.
MLP_IN, MLP_OUT = ("mlpwi_0", "mlpwi_1"), "mlpwo"


def linear(x: Array, w: Array, flat: bool = True) -> Array:
    """y = x W, W [in, out]: x [..., in] -> [..., out]; flat: ONE 2-D dot on [prod(...), in] rows.

    Batch dims kept made XLA:CPU transpose-copy the cotangent for dW; a float32 result made JAX run
    both backward matmuls in f32 (measured, JAX 0.12). cp and tp_sp pass flat=False (GSPMD gathers).
    Inside quantize.quantizing("int8") (the transformer blocks) forward and dx run in int8. A tapped op
    (twinshard/model/taps.py: the zero-bubble split backward)."""
    mode = quantize.active()
    axes = quantize.token_axes() if mode == "int8_dw" else ()  # dW's absmax over every token

    def product(x: Array, w: Array) -> Array:
        if not flat:
            return matmul(x, w, mode, axes)
        return matmul(x.reshape(-1, x.shape[-1]), w, mode, axes).reshape(*x.shape[:-1], w.shape[-1])

    return taps.tapped(product, x, w)


def linears(x: Array, ws: tuple[Array, ...], flat: bool = True) -> tuple[Array, ...]:
    """x @ w for each w of a shared input, x flattened ONCE (one reshape per matmul saved 3 extra
    [B, T, D] residuals per layer, measured in tests/test_sequence.py)."""
    rows = x.reshape(-1, x.shape[-1]) if flat else x
    return tuple(linear(rows, w, flat).reshape(*x.shape[:-1], w.shape[-1]) for w in ws)


def batch_chunks(x: Array, n: int) -> tuple[Array, ...]:
    """x [B, ...] -> n chunks [B/n, ...], chunk j the sequences j, j+n, j+2n, ...: splitting B as
    [B/n, n] keeps a batch split over `data` where it is (GSPMD: each device chunks its own rows)."""
    b = x.shape[0]
    if b % n:
        raise ValueError(f"ModelConfig.tp_overlap_chunks={n} (--tp_overlap_chunks) does not divide the {b} "
                         f"sequences of a device's batch; choose a divisor of {b} (1: off).")
    rows = x.reshape(b // n, n, *x.shape[1:])  # [B/n, n, ...]
    return tuple(rows[:, j] for j in range(n))


def merge_chunks(xs: tuple[Array, ...]) -> Array:
    """The inverse of `batch_chunks`: n chunks [B/n, ...] -> [B, ...]."""
    return jnp.stack(xs, axis=1).reshape(-1, *xs[0].shape[1:])


def embedding(ids: Array, table: Array) -> Array:
    """Row lookup. ids: [...] int, table: [V, D] -> [..., D]; a tapped op (twinshard/model/taps.py)."""
    return taps.tapped(lambda ids, table: jnp.take(table, ids, axis=0), ids, table)


def rms_norm(x: Array, gain: Array, eps: float, compute: bool = False) -> Array:
    """x / sqrt(mean(x^2) + eps) * g, returned in x.dtype: computed in float32, or (compute) in x.dtype
    with mean(x^2) accumulated in float32 (ModelConfig.norm_dtype="compute": no float32 [..., D] array)."""
    if compute and x.dtype != jnp.float32:
        return _narrow_rms_norm(x, gain, eps)
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    # the gain's product x^ g is a tapped op (twinshard/model/taps.py), x^ = x32 inv_rms its operand
    return taps.tapped(lambda x_hat, g: (x_hat * g.astype(jnp.float32)).astype(x.dtype), x32 * inv_rms, gain)


def row_dot(a: Array, b: Array) -> Array:
    """sum_d a * b over the last axis in float32, [..., D] x [..., D] (or [D]) -> [...], without a float32
    copy of either (jnp.sum(dtype=f32) converts its operand first): the loss's and the norm's statistics."""
    spec = "...d,...d->..."
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, out_sharding=partial_sums(spec, a, b))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _narrow_rms_norm(x: Array, gain: Array, eps: float) -> Array:
    return _narrow_rms_norm_fwd(x, gain, eps)[0]


def _narrow_rms_norm_fwd(x, gain, eps):
    inv = jax.lax.rsqrt(row_dot(x, x)[..., None] / x.shape[-1] + eps)  # [..., 1] f32
    return x * inv.astype(x.dtype) * gain.astype(x.dtype), (x, inv, gain)


def _narrow_rms_norm_bwd(eps, res, dy):
    """x^ = x inv, y = x^ g: dg = sum_rows dy x^ (f32), dx = inv (dy g - x^ mean_d(dy g x^)), in x's dtype
    (autodiff of the f32 accumulations would hand back float32 [..., D] cotangents)."""
    x, inv, gain = res  # dy [..., D]
    x_hat, dx_hat = x * inv.astype(x.dtype), dy * gain.astype(x.dtype)
    rows = "".join(chr(0x3b1 + i) for i in range(x.ndim - 1))
    dg = jnp.einsum(f"{rows}d,{rows}d->d", dy, x_hat, preferred_element_type=jnp.float32,
                    out_sharding=partial_sums(f"{rows}d,{rows}d->d", dy, x_hat))
    mean = (row_dot(dx_hat, x_hat)[..., None] / x.shape[-1]).astype(x.dtype)  # [..., 1]
    dx = inv.astype(x.dtype) * (dx_hat - x_hat * mean)
    return cotangent_like(dx, x), cotangent_like(dg, gain)


_narrow_rms_norm.defvjp(_narrow_rms_norm_fwd, _narrow_rms_norm_bwd)


def silu(x: Array) -> Array:
    return x * jax.nn.sigmoid(x)


@jax.custom_vjp
def swiglu_gate(h1: Array, h3: Array) -> Array:
    """SiLU(h1) * h3 for h1 = x W1, h3 = x W3 [..., F]; its backward keeps h1 and h3 and recomputes
    the sigmoid (autodiff of the plain expression saved four more [..., F] arrays per layer)."""
    return silu(h1) * h3


def _swiglu_gate_fwd(h1: Array, h3: Array) -> tuple[Array, tuple[Array, Array]]:
    return swiglu_gate(h1, h3), (h1, h3)


def _swiglu_gate_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    h1, h3 = res  # [..., F] each; g: [..., F]
    sig = jax.nn.sigmoid(h1)
    silu_h1 = h1 * sig
    # d silu(h)/dh = sig + h sig (1 - sig) = sig + silu (1 - sig)
    return cotangent_like(g * h3 * (sig + silu_h1 * (1 - sig)), h1), cotangent_like(g * silu_h1, h3)


swiglu_gate.defvjp(_swiglu_gate_fwd, _swiglu_gate_bwd)


def swiglu(x: Array, w1: Array, w2: Array, w3: Array) -> Array:
    """W2 (SiLU(x W1) * x W3). x: [..., D], w1/w3: [D, F], w2: [F, D] -> [..., D]."""
    return linear(swiglu_gate(*linears(x, (w1, w3))), w2)


def row_max(x: Array, axis: int = -1) -> Array:
    """The max along `axis` (kept as size 1) a stable softmax subtracts; no gradient flows through it."""
    return jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))


def softmax(x: Array, axis: int = -1) -> Array:
    """Numerically stable softmax: subtract the max before exp."""
    z = x - row_max(x, axis)
    e = jnp.exp(z)
    return e / jnp.sum(e, axis=axis, keepdims=True)


@functools.lru_cache(maxsize=None)
def rope_tables(head_dim: int, theta: float, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cached cos/sin tables [max_len, head_dim/2] float32: pair k of position i turns by i * theta^(-2k/head_dim)."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: Array, positions: Array, theta: float, max_len: int) -> Array:
    """Rotate interleaved (even, odd) feature pairs. x: [..., T, dh], positions: [T]."""
    cos, sin = _rope_at(x.shape[-1], positions, theta, max_len)
    rot_even, rot_odd = _rotate(x[..., 0::2], x[..., 1::2], cos, sin)
    return jnp.stack([rot_even, rot_odd], axis=-1).reshape(x.shape).astype(x.dtype)


def apply_rope_halves(x: Array, positions: Array, theta: float, max_len: int) -> Array:
    """apply_rope on features that come as (evens, odds) halves: for x' = x[..., evens_then_odds(dh)],
    apply_rope_halves(x') == apply_rope(x)[..., evens_then_odds(dh)]. Each pair's two features sit dh/2
    apart, so the rotation reads two contiguous halves where apply_rope reads stride-2 slices (on a TPU a
    relayout of q and k in every layer, forward and backward, where the halves are whole vregs:
    twinshard.config.rope_on_halves). x: [..., T, dh], positions: [T]."""
    cos, sin = _rope_at(x.shape[-1], positions, theta, max_len)
    evens, odds = jnp.split(x, 2, axis=-1)
    return jnp.concatenate(_rotate(evens, odds, cos, sin), axis=-1).astype(x.dtype)


def evens_then_odds(dh: int) -> np.ndarray:
    """The permutation of a head's dh features that puts RoPE's pairs dh/2 apart: [0, 2, ..., 1, 3, ...]."""
    return np.concatenate([np.arange(0, dh, 2), np.arange(1, dh, 2)])


def _rope_at(dh: int, positions: Array, theta: float, max_len: int) -> tuple[Array, Array]:
    """RoPE's cos and sin at `positions` [T]: each [T, dh/2]."""
    cos_table, sin_table = rope_tables(dh, float(theta), int(max_len))
    return jnp.asarray(cos_table)[positions], jnp.asarray(sin_table)[positions]


def _rotate(even: Array, odd: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
    """Each (even, odd) pair rotated by its angle: the pair's two new features."""
    return even * cos - odd * sin, even * sin + odd * cos


def causal_mask(t: int) -> Array:
    """[T, T] boolean keep-mask: query i sees keys j <= i."""
    return jnp.tril(jnp.ones((t, t), dtype=bool))


def scaled_dot_product_attention(q: Array, k: Array, v: Array, mask: Array | None = None) -> Array:
    """softmax(q k^T / sqrt(dk), masked) v; mask boolean [Tq, Tk], True = keep. q: [..., Tq, dk], v: [..., Tk, dv]."""
    scores = attention_scores(q, k, mask)
    return jnp.einsum("...qk,...kd->...qd", softmax(scores, axis=-1).astype(v.dtype), v)


def attention_scores(q: Array, k: Array, mask: Array | None = None) -> Array:
    """q k^T / sqrt(dk) in float32, masked scores -inf. q: [..., Tq, dk], k: [..., Tk, dk] -> [..., Tq, Tk]."""
    scores = jnp.einsum("...qd,...kd->...qk", q, k).astype(jnp.float32)  # softmax in f32
    scores = scores / np.sqrt(q.shape[-1]).astype(np.float32)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    return scores


def group_heads(q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
    """Grouped-query layout: q [B, h, T, dh], k, v [B, hk, Tk, dh] -> q [B, hk, h/hk, T, dh], k, v
    [B, hk, 1, Tk, dh]; query head i uses kv head i // (h/hk), broadcast by the einsums without a copy."""
    b, h, t, dh = q.shape
    hk = k.shape[-3]
    assert h % hk == 0 and k.shape == v.shape[:-1] + (k.shape[-1],), (q.shape, k.shape, v.shape)
    return q.reshape(b, hk, h // hk, t, dh), k[:, :, None], v[:, :, None]


def ungroup_heads(o: Array) -> Array:
    """[B, hk, h/hk, T, dh] -> [B, h, T, dh]."""
    b, hk, g, t, dh = o.shape
    return o.reshape(b, hk * g, t, dh)


_TARGET = TraceSetting(default=lambda: jax.default_backend())  # looked up at each call


def compiling_for(platform: str):
    """Trace the kernels for `platform` instead of this process's backend: a TPU topology compiled
    ahead of time from a CPU host lowers splash for the chip (Mosaic), not in interpret mode."""
    return _TARGET.using(platform)


def target_backend() -> str:
    """The platform the traced kernels run on (compiling_for's, else jax.default_backend())."""
    return _TARGET.current()


def attention_kernel(impl: str, dtype, positions: tuple[int, ...] | None = None) -> str:
    """The kernel `causal_attention` runs: "auto" is cudnn on a GPU in bf16/fp16, splash on a TPU in
    bf16, recompute elsewhere; with permuted `positions` splash runs recompute."""
    if impl == "auto":
        backend, half = target_backend(), dtype in (jnp.bfloat16, jnp.float16)
        impl = ("cudnn" if half and backend == "gpu" and positions is None
                else "splash" if dtype == jnp.bfloat16 and backend == "tpu" else "recompute")
    return "recompute" if impl == "splash" and positions is not None else impl


def causal_attention(q: Array, k: Array, v: Array, impl: str = "auto",
                     positions: tuple[int, ...] | None = None, block: int | Splash = 0) -> Array:
    """Causal attention of q [B, h, T, dh] with k, v [B, hk, T, dh] -> [B, h, T, dh] (hk < h: GQA).

    impl: reference, recompute, xla / cudnn, splash or auto; positions: true places in a permuted
    sequence (jax.nn's kernels mask by index only, so with positions recompute or reference runs)."""
    impl = attention_kernel(impl, q.dtype, positions)
    if impl == "splash":
        return splash_attention(q, k, v, block)
    if impl in ("recompute", "reference") or positions is not None:
        grouped = k.shape[-3] != q.shape[-3]
        qg, kg, vg = group_heads(q, k, v) if grouped else (q, k, v)
        if impl == "recompute":
            o = recompute_attention(qg, kg, vg, positions)
        else:
            o = scaled_dot_product_attention(qg, kg, vg, _keep_mask(q.shape[-2], positions))
        return ungroup_heads(o) if grouped else o
    bthd = lambda t: t.transpose(0, 2, 1, 3)  # noqa: E731  [B, h, T, dh] <-> [B, T, h, dh]
    return bthd(jax.nn.dot_product_attention(bthd(q), bthd(k), bthd(v), is_causal=True, implementation=impl))


class Splash(NamedTuple):
    """The splash kernel's options, handed down as causal_attention's `block` (an int: the block alone)."""
    block: int = 0  # ModelConfig.attention_block (0: splash_block's choice)
    fused_bwd: bool = True  # ModelConfig.splash_fused_bwd: one backward kernel for dq, dk, dv; else dq apart
    # splash.BlockSizes fields set apart from `block` (("block_kv_compute", 256), ("k_layout", "SEQ_MINOR"), ...):
    # what tools/chip_micro.py's splash sweep times
    overrides: tuple[tuple[str, int | str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Splash:
        """'block=512:fused=0:k_layout=SEQ_MINOR' (tools/chip_micro.py --splash_sweep) as Splash; a ValueError
        naming the part and what is accepted for a malformed one."""
        fields = {}
        for part in filter(None, text.split(":")):
            name, sep, value = part.partition("=")
            ok = sep and (value in SPLASH_LAYOUTS if name.endswith("_layout") else value.isdigit())
            if name not in ("block", "fused", *SPLASH_FIELDS) or not ok:
                raise ValueError(f"splash options {text!r}: {part!r} is not NAME=VALUE with NAME one of block, fused, "
                                 f"{', '.join(SPLASH_FIELDS)} and VALUE a whole number or, for a layout, one of "
                                 f"{', '.join(SPLASH_LAYOUTS)}.")
            fields[name] = value if name.endswith("_layout") else int(value)
        block, fused = fields.pop("block", 0), fields.pop("fused", 1) != 0
        return cls(block, fused, tuple(sorted(fields.items())))


# splash.BlockSizes' fields a Splash may set apart from its block, and the kernel's QKVLayout names
SPLASH_FIELDS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute",
                 "block_q_dq", "block_kv_dq", "q_layout", "k_layout", "v_layout")
SPLASH_LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")


def splash_block_sizes(t: int, options: Splash):
    """The splash kernel's BlockSizes for t tokens: every block splash_block(t, options.block), the fused or
    separate backward, then options.overrides."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    n = splash_block(t, options.block)
    # The fused backward ran fwd+bwd 24% faster on a TPU v5e (B16 H12 T1024 dh64, block 512: 3.25
    # against 4.26 ms; JAX 0.10.2); it writes dq per key block ([T/n, h, T, dh]) and sums them after.
    dq = {} if options.fused_bwd else {"block_q_dq": n, "block_kv_dq": n}
    fields = dict(block_q=n, block_kv=n, block_kv_compute=n, block_q_dkv=n, block_kv_dkv=n,
                  block_kv_dkv_compute=n, use_fused_bwd_kernel=options.fused_bwd, **dq)
    for name, value in options.overrides:
        fields[name] = splash.QKVLayout[value] if name.endswith("_layout") else value
    return splash.BlockSizes(**fields)


def splash_attention(q: Array, k: Array, v: Array, block: int | Splash = 0) -> Array:
    """Causal attention by JAX's Pallas splash kernel (TPU flash attention), q [B, h, T, dh], k, v
    [B, hk, T, dh] -> [B, h, T, dh]; off a TPU in Pallas' interpret mode. T is zero-padded to a
    multiple of 128 (JAX 0.12 refuses "bkv_compute=32 must be a multiple of 128"); no real query
    sees a padded key. Its residuals are named ATTENTION_RESIDUALS."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b, h, t, dh = q.shape
    hk, padded = k.shape[-3], splash_padded(t)
    sizes = splash_block_sizes(t, block if isinstance(block, Splash) else Splash(block))
    make = splash.make_splash_mqa if hk == 1 else splash.make_splash_mha

    def run(q, k, v):  # the kernel built where it runs: its mask tables are arrays of that trace
        kernel = make(masks.MultiHeadMask([masks.CausalMask((padded, padded))] * h), block_sizes=sizes,
                      head_shards=1, q_seq_shards=1, residual_checkpoint_name=ATTENTION_RESIDUALS,
                      interpret=target_backend() != "tpu")
        return jax.vmap(kernel)(q, k, v)

    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, padded - t), (0, 0)))  # noqa: E731
    q = pad(q * np.asarray(1 / np.sqrt(dh), q.dtype))
    k, v = pad(k), pad(v)
    if hk == 1:
        k, v = k[:, 0], v[:, 0]  # [B, T, dh]: the multi-query kernel's one kv head
    o = _unchecked(run, q, k, v) if varying_axes(q) | varying_axes(k) | varying_axes(v) else run(q, k, v)
    return o[:, :, :t]


def _unchecked(f, *args: Array) -> Array:
    """A Pallas kernel f(*args) in a check_vma shard_map, unchecked, typed varying as its inputs, with a
    custom_vjp (JAX 0.12 refuses it checked: "`manual_axis_type` ... must not be `None`", measured)."""
    return _unchecked_vjp(f, *args)


def _untyped(f, *args):
    """f(*args) in a shard_map over no mesh axes with check_vma=False (bwd checks off while it traces)."""
    from jax._src import config  # jax_disable_bwd_checks, as a context (JAX 0.10 and 0.12)

    with config.disable_bwd_checks(True):
        return jax.shard_map(f, in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(),
                             axis_names=frozenset(), check_vma=False)(*args)


def _varying_as(x: Array, *like: Array) -> Array:
    """x typed varying over every mesh axis one of `like` varies over (a pcast: no data moves)."""
    axes = tuple(sorted(frozenset().union(*(varying_axes(a) for a in like)) - varying_axes(x)))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unchecked_vjp(f, *args):
    return _varying_as(_untyped(f, *args), *args)


def _unchecked_fwd(f, *args):
    return _unchecked_vjp(f, *args), args


def _unchecked_bwd(f, args, g):
    grads = lambda g, *a: jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=tuple(range(len(a))))(*a)  # noqa: E731
    return tuple(_varying_as(ct, a) for ct, a in zip(_untyped(grads, g, *args), args))


_unchecked_vjp.defvjp(_unchecked_fwd, _unchecked_bwd)


def recompute_attention(q: Array, k: Array, v: Array, positions: tuple[int, ...] | None = None) -> Array:
    """Causal softmax(q k^T / sqrt(dh)) v, [B, h, T, dh] x3 -> [B, h, T, dh]; the backward saves o and the
    log-sum-exp [B, h, T, 1] and recomputes the probabilities (no [T, T] array saved)."""
    return _recompute_attention(q, k, v, positions)


def _causal_scores(q: Array, k: Array, positions: tuple[int, ...] | None) -> Array:
    """q k^T / sqrt(dh) in float32, future keys -inf; forward and backward compute it alike."""
    s = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32)
    s = s / np.sqrt(q.shape[-1]).astype(np.float32)
    return jnp.where(_keep_mask(q.shape[-2], positions), s, -jnp.inf)  # every row keeps its own key


def visible(q_pos, k_pos):
    """The causal keep-mask [Tq, Tk]: key j is seen by query i iff k_pos[j] <= q_pos[i]."""
    return k_pos[None, :] <= q_pos[:, None]


def _keep_mask(t: int, positions: tuple[int, ...] | None) -> Array:
    """[T, T] causal keep-mask by index (positions None) or by the tokens' true positions."""
    if positions is None:
        return causal_mask(t)
    pos = np.asarray(positions)
    return jnp.asarray(visible(pos, pos))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _recompute_attention(q: Array, k: Array, v: Array, positions: tuple[int, ...] | None) -> Array:
    return _recompute_attention_fwd(q, k, v, positions)[0]


def _recompute_attention_fwd(q: Array, k: Array, v: Array, positions: tuple[int, ...] | None):
    s = _causal_scores(q, k, positions)  # [B, h, T, T] f32
    m = row_max(s)  # [B, h, T, 1]
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    o = (jnp.einsum("...qk,...kd->...qd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
         / total).astype(v.dtype)  # [B, h, T, dh]
    lse = m + jnp.log(total)  # [B, h, T, 1] f32: p = exp(s - lse)
    name = functools.partial(checkpoint_name, name=ATTENTION_RESIDUALS)  # an identity without a policy naming it
    return o, (q, k, v, name(o), name(lse))


def _recompute_attention_bwd(positions, res, do: Array) -> tuple[Array, Array, Array]:
    q, k, v, o, lse = res
    p = jnp.exp(_causal_scores(q, k, positions) - lse)  # [B, h, T, T] f32, 0 on future keys
    dv = jnp.einsum("...qk,...qd->...kd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("...qd,...kd->...qk", do, v, preferred_element_type=jnp.float32)
    # softmax backward: ds = p (dp - sum_k dp p), and sum_k dp_qk p_qk = do_q . o_q
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    ds = p * (dp - delta) / np.sqrt(q.shape[-1]).astype(np.float32)  # d(q k^T) [B, h, T, T]
    dq = jnp.einsum("...qk,...kd->...qd", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("...qk,...qd->...kd", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
    return cotangent_like(dq, q), cotangent_like(_sum_to(dk, k.shape), k), cotangent_like(_sum_to(dv, v.shape), v)


def _sum_to(x: Array, shape: tuple[int, ...]) -> Array:
    """x summed to `shape` over its broadcast dims (grouped-query attention's k, v [B, hk, 1, T, dh])."""
    dims = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return jnp.sum(x, axis=dims, keepdims=True) if dims else x


_recompute_attention.defvjp(_recompute_attention_fwd, _recompute_attention_bwd)


def split_heads(x: Array, head_dim: int) -> Array:
    """[B, T, h*dh] -> [B, h, T, dh]."""
    b, t, hd = x.shape
    return x.reshape(b, t, hd // head_dim, head_dim).transpose(0, 2, 1, 3)


def merge_heads(x: Array) -> Array:
    """[B, h, T, dh] -> [B, T, h*dh]."""
    b, h, t, dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * dh)


def attend_heads(q: Array, k: Array, v: Array, positions: Array, head_dim: int, theta: float, max_len: int,
                 attend=causal_attention) -> Array:
    """The attention core on projections: q [B, T, h*dh], k, v [B, T, hk*dh] -> [B, T, h*dh]; RoPE at
    `positions` [T], then `attend` (causal_attention or ring attention)."""
    q, k, v = (split_heads(p, head_dim) for p in (q, k, v))
    return merge_heads(attend_rotated(q, k, v, positions, theta, max_len, attend))


def attend_rotated(q: Array, k: Array, v: Array, positions: Array, theta: float, max_len: int,
                   attend=causal_attention, halves: bool = False) -> Array:
    """`attend` after RoPE at `positions` [T]: q [B, h, T, dh], k, v [B, hk, T, dh] -> [B, h, T, dh];
    halves: q's and k's features come as (evens, odds) halves (apply_rope_halves)."""
    rope = apply_rope_halves if halves else apply_rope
    return attend(rope(q, positions, theta, max_len), rope(k, positions, theta, max_len), v)


def causal_self_attention(
    x: Array, wq: Array, wk: Array, wv: Array, wo: Array,
    head_dim: int, theta: float, max_len: int, attention: str = "auto",
) -> Array:
    """Causal multi-head (or grouped-query) self-attention with RoPE: x [B, T, D], wq [D, h*dh],
    wk/wv [D, hk*dh], wo [h*dh, D] -> [B, T, D] (a partial sum over heads under TP)."""
    q, k, v = linears(x, (wq, wk, wv))
    attend = functools.partial(causal_attention, impl=attention)
    return linear(attend_heads(q, k, v, jnp.arange(x.shape[-2]), head_dim, theta, max_len, attend), wo)
