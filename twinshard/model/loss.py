"""Cross-entropy over padded (possibly vocab-sharded) logits: loss = m + log s - z_y from m = max z,
s = sum exp(z - m) and z_y, each followed by a reduction hook (pmax / psum under vocab parallelism).
The chunked loss saved temporaries 2280 MB -> 1809 MB with 8 chunks (measured, XLA:CPU, gpt2_125m).
Logits in the compute dtype (ModelConfig.logits_dtype="compute") keep every [tokens, V] array in it,
forward and backward; m, s and z_y are float32 all the same (s: a dot with ones accumulating in f32)."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from twinshard.model import layers, matmuls

Array = jax.Array
Reduce = Callable[[Array], Array]


def _identity(x: Array) -> Array:
    return x


def mask_padded_logits(logits: Array, vocab_size: int, vocab_offset: Array | int = 0) -> Array:
    """-inf on columns whose global id >= vocab_size. logits: [..., V_local] holding ids vocab_offset + [0, V_local)."""
    if isinstance(vocab_offset, int) and vocab_offset + logits.shape[-1] <= vocab_size:
        return logits
    ids = vocab_offset + jnp.arange(logits.shape[-1])
    return jnp.where(ids < vocab_size, logits, -jnp.inf)


def row_sum(e: Array) -> Array:
    """e [..., V] summed over V in float32 -> [...]; for a narrower e without a float32 copy of it."""
    return jnp.sum(e, axis=-1) if e.dtype == jnp.float32 else layers.row_dot(e, jnp.ones(e.shape[-1:], e.dtype))


def _statistics(z: Array, targets: Array, vocab_offset: Array | int, reduce_max: Reduce,
                reduce_sum: Reduce) -> tuple[Array, Array, Array]:
    """(m, s, z_y) of the module docstring, each float32 [...], from masked logits z [..., V_local]
    (float32 or the compute dtype: the max and the target's logit are exact in it), targets [...]."""
    m = reduce_max(jax.lax.stop_gradient(jnp.max(z, axis=-1)))  # [...] in z's dtype
    s = reduce_sum(row_sum(jnp.exp(z - m[..., None])))  # [...]
    local = targets - vocab_offset
    on_shard = (local >= 0) & (local < z.shape[-1])
    z_y = jnp.take_along_axis(z, jnp.clip(local, 0, z.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    return m.astype(jnp.float32), s, reduce_sum(jnp.where(on_shard, z_y.astype(jnp.float32), 0.0))


def token_cross_entropy(
    logits: Array, targets: Array, vocab_size: int, vocab_offset: Array | int = 0,
    reduce_max: Reduce = _identity, reduce_sum: Reduce = _identity,
) -> Array:
    """Per-token -log softmax(logits)[target] in float32. logits: [..., V_local] float32 or bfloat16 (kept:
    the statistics accumulate in float32), targets: [...] -> [...]."""
    z = mask_padded_logits(logits, vocab_size, vocab_offset)
    if z.dtype != jnp.float32:
        return _narrow_cross_entropy(z, targets, jnp.asarray(vocab_offset, jnp.int32), (reduce_max, reduce_sum))
    m, s, z_y = _statistics(z, targets, vocab_offset, reduce_max, reduce_sum)
    return m + jnp.log(s) - z_y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _narrow_cross_entropy(z: Array, targets: Array, offset: Array, reduces: tuple[Reduce, Reduce]) -> Array:
    """token_cross_entropy of masked bf16 logits z [..., V_local] -> [...] float32; the backward keeps z
    and the lse, so autodiff's float32 outer product (the sum's transpose) and its saved exp(z - m) are gone."""
    return _narrow_fwd(z, targets, offset, reduces)[0]


def _narrow_fwd(z, targets, offset, reduces):
    m, s, z_y = _statistics(z, targets, offset, *reduces)
    lse = m + jnp.log(s)  # [...] f32
    return lse - z_y, (z, targets, offset, lse)


def _narrow_bwd(reduces, res, g):
    z, targets, offset, lse = res  # g [...] f32
    return matmuls.cotangent_like(softmax_minus_target(z, lse, targets, offset, g), z), None, None


_narrow_cross_entropy.defvjp(_narrow_fwd, _narrow_bwd)


def cross_entropy(logits: Array, targets: Array, vocab_size: int) -> Array:
    """Mean cross-entropy over all tokens. logits: [..., V_pad], targets: [...] int."""
    return jnp.mean(token_cross_entropy(logits, targets, vocab_size))


# Vocabulary tiling: the loss from the lm_head's INPUT, chunk by chunk.

class Chunks(NamedTuple):
    """How chunked_token_cross_entropy tiles the vocabulary (ModelConfig.loss_chunks, logits_dtype,
    loss_recompute): `count` chunks of tokens; each chunk's logits in the compute dtype (compute_logits)
    or float32; recomputed by the backward (recompute) or saved by the forward ([tokens, V] held)."""
    count: int
    compute_logits: bool = False
    recompute: bool = True


def chunks_of(cfg) -> Chunks:
    """The Chunks of a ModelConfig."""
    return Chunks(cfg.loss_chunks, cfg.logits_dtype == "compute", cfg.loss_recompute)


class _Tiling(NamedTuple):
    """The static half of chunked_token_cross_entropy's arguments (custom_vjp's nondiff one)."""
    vocab_size: int
    masked: bool  # some column of this shard may be padding (decided before tracing the chunks)
    reduce_max: Reduce
    reduce_sum: Reduce
    compute_logits: bool  # the chunk's logits in x's dtype, not float32
    recompute: bool  # the backward recomputes each chunk's logits (else the forward saves them)


def check_chunks(chunks: int, tokens: int) -> None:
    """A ValueError unless `chunks` splits `tokens` (this program's B*T) evenly."""
    if chunks < 1 or tokens % chunks:
        raise ValueError(
            f"ModelConfig.loss_chunks={chunks} (--loss_chunks) does not split the {tokens} tokens of a "
            f"device's batch (batch per device x context_length) evenly; choose a divisor of {tokens} "
            "(0: the loss from whole [B, T, V] logits).")


def chunked_token_cross_entropy(
    x: Array, w: Array, targets: Array, vocab_size: int, chunks: int | Chunks, vocab_offset: Array | int = 0,
    reduce_max: Reduce = _identity, reduce_sum: Reduce = _identity,
) -> Array:
    """token_cross_entropy(x @ w, targets) without [B, T, V] logits: x [B, T, D], w [D, V_local] -> [B, T];
    chunk c holds tokens i % chunks == c, the backward recomputes its logits (dw accumulated in f32)
    unless `chunks` (a count, or Chunks) says the forward saves them."""
    spec = chunks if isinstance(chunks, Chunks) else Chunks(chunks)
    chunks, tokens = spec.count, targets.size
    check_chunks(chunks, tokens)
    n = tokens // chunks
    rows = jnp.swapaxes(x.reshape(n, chunks, x.shape[-1]), 0, 1)  # [chunks, N, D]
    ys = targets.reshape(n, chunks).T  # [chunks, N]
    masked = not (isinstance(vocab_offset, int) and vocab_offset + w.shape[-1] <= vocab_size)
    tiling = _Tiling(vocab_size, masked, reduce_max, reduce_sum, spec.compute_logits, spec.recompute)
    per_token = _tiled(rows, w, ys, jnp.asarray(vocab_offset, jnp.int32), tiling)  # [chunks, N]
    return per_token.T.reshape(targets.shape)


def vocab_parallel_token_loss(logits, targets, vocab_size, axis, w=None, chunks=0):
    """Megatron's vocab-parallel cross-entropy inside a shard_map manual over `axis`: logits [B', T,
    V/t] -> [B', T] by pmax and psum; with w [D, V/t] `logits` is the lm_head's input, chunked."""
    reduce_max, reduce_sum = (functools.partial(f, axis_name=axis) for f in (lax.pmax, lax.psum))
    if w is not None:
        offset = lax.axis_index(axis) * w.shape[-1]
        return chunked_token_cross_entropy(logits, w, targets, vocab_size, chunks, offset, reduce_max, reduce_sum)
    assert logits.shape[:-1] == targets.shape, (logits.shape, targets.shape)
    offset = lax.axis_index(axis) * logits.shape[-1]
    return token_cross_entropy(logits, targets, vocab_size, offset, reduce_max=reduce_max, reduce_sum=reduce_sum)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tiled(rows: Array, w: Array, ys: Array, offset: Array, tiling: _Tiling) -> Array:
    return _tiled_fwd(rows, w, ys, offset, tiling)[0]


def _chunk_logits(x: Array, w: Array, offset: Array, tiling: _Tiling) -> Array:
    """x [N, D] @ w [D, V_local] in the compute dtype (then float32 unless compute_logits), padding -inf: [N, V_local]."""
    z = jnp.dot(x, w, out_sharding=matmuls.partial_sums("ij,jk->ik", x, w))
    z = z if tiling.compute_logits else z.astype(jnp.float32)
    return mask_padded_logits(z, tiling.vocab_size, offset) if tiling.masked else z


def _tiled_fwd(rows, w, ys, offset, tiling):
    def chunk(_, xy):  # x [N, D], y [N]
        z = _chunk_logits(xy[0], w, offset, tiling)
        m, s, z_y = _statistics(z, xy[1], offset, tiling.reduce_max, tiling.reduce_sum)
        saved = None if tiling.recompute else z  # [N, V_local] for the backward
        return None, (m + jnp.log(s) - z_y, m + jnp.log(s), saved)  # token_cross_entropy's sum, the lse

    _, (per_token, lse, logits) = jax.lax.scan(chunk, None, (rows, ys))  # [chunks, N] each; [chunks, N, V_local]
    return per_token, (rows, w, ys, offset, lse, logits)


def softmax_minus_target(z: Array, lse: Array, targets: Array, offset: Array | int, g: Array) -> Array:
    """d loss / d z = (softmax(z) - onehot(target)) * g in z's dtype: z [..., V_local] (float32 or the
    compute dtype), lse and g [...] float32 (cast to z's dtype: no float32 [..., V] array), targets [...]."""
    hit = jnp.arange(z.shape[-1]) + offset == targets[..., None]  # the target, if on this shard
    return (jnp.exp(z - lse.astype(z.dtype)[..., None]) - hit) * g.astype(z.dtype)[..., None]


def _tiled_bwd(tiling, res, g):
    rows, w, ys, offset, lse, logits = res  # g: [chunks, N] f32, each token's cotangent

    def chunk(dw, xs):  # dw [D, V_local] f32; x [N, D], y, lse, g [N]; z None or [N, V_local]
        x, y, lse_c, g_c, z = xs
        z = _chunk_logits(x, w, offset, tiling) if z is None else z
        dz = softmax_minus_target(z, lse_c, y, offset, g_c).astype(w.dtype)  # [N, V_local]
        dx = jnp.dot(dz, w.T, out_sharding=matmuls.partial_sums("ij,jk->ik", dz, w.T))  # [N, D]
        return dw + jnp.einsum("nd,nv->dv", x, dz, preferred_element_type=jnp.float32,
                               out_sharding=matmuls.partial_sums("nd,nv->dv", x, dz)), dx

    dw, dx = jax.lax.scan(chunk, _zeros_varying(w.shape, rows, w, ys, lse, g), (rows, ys, lse, g, logits))
    return matmuls.cotangent_like(dx, rows), matmuls.cotangent_like(dw, w), None, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def _zeros_varying(shape: tuple[int, ...], *like: Array) -> Array:
    """f32 zeros varying over every mesh axis one of `like` varies over (a scan carry's type)."""
    axes = tuple(sorted(set().union(*(matmuls.varying_axes(a) for a in like))))
    zeros = jnp.zeros(shape, jnp.float32)
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros
