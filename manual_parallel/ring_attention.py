"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): causal
attention over a sequence split across the `context` axis, with K/V blocks travelling a ring.

The collectives and why: docs/long-context.md (manual_parallel/ring_attention.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from manual_parallel.collectives import ring_shift
from twinshard.parallel import context
from twinshard.model import layers

Array = jax.Array


def saves_ring_shifts(prim, *_, **params) -> bool:
    """Remat policy: save every ring_shift output (a received K/V block), so a checkpointed
    layer's backward never re-runs the ring's forward permutes (manual_parallel/cp.py)."""
    return prim.name == "custom_vjp_call" and any(
        e.primitive.name == "ppermute" for e in params["call_jaxpr"].eqns)


@jax.checkpoint
def _merge(stats, q: Array, k: Array, v: Array, keep: Array | None = None):
    """One block into the running (m, l, acc). q [B, h, Tq, dh], k/v [B, h, Tk, dh], keep [Tq, Tk]
    (None: every key is visible to every query).

    Checkpointed: the backward pass recomputes the block's scores and probabilities from its
    inputs (the running statistics and the K/V block), as flash attention does, instead of
    keeping [Tq, Tk] per step: the saved attention memory is O(T dh), not O(T^2 / C)."""
    m, l, acc = stats
    scores = layers.attention_scores(q, k, keep)  # [B, h, Tq, Tk] f32
    m_new = jnp.maximum(m, layers.row_max(scores))
    p = jnp.exp(scores - m_new)  # [B, h, Tq, Tk]
    rescale = jnp.exp(m - m_new)  # [B, h, Tq, 1]: 0 at step 0 (m = -inf)
    acc = acc * rescale + jnp.einsum("...qk,...kd->...qd", p.astype(v.dtype), v).astype(jnp.float32)
    return m_new, l * rescale + jnp.sum(p, axis=-1, keepdims=True), acc


def _zigzag_block(stats, q, k, v, earlier):
    """A block from another device under zig-zag: exactly half of it is visible, all of it unmasked.
    Sent by an earlier device (its chunks c' < c and 2C-1-c' > 2C-1-c): every query sees the
    block's early chunk and none its late one -> q [T/C] x k [:T/2C]. Sent by a later device:
    only this device's late chunk sees the block, all of it -> q [T/2C:] x k [T/C]."""
    half = q.shape[-2] // 2
    cut = lambda x: x[..., :half, :]  # noqa: E731  the early chunk
    rest = lambda x: x[..., half:, :]  # noqa: E731  the late chunk

    def from_earlier(stats):
        return _merge(stats, q, cut(k), cut(v))

    def from_later(stats):
        late = _merge(tuple(rest(s) for s in stats), rest(q), k, v)
        return tuple(jnp.concatenate([cut(s), t], axis=-2) for s, t in zip(stats, late))

    return lax.cond(earlier, from_earlier, from_later, stats)


def _contiguous_block(stats, q, k, v, earlier):
    """A block from another device under the contiguous layout: all visible (an earlier device's)
    or all masked (a later device's: skipped). Device c computes c blocks after its own."""
    return lax.cond(earlier, lambda s: _merge(s, q, k, v), lambda s: s, stats)


BLOCKS = {"zigzag": _zigzag_block, "contiguous": _contiguous_block}


def ring_attention(q: Array, k: Array, v: Array, positions: np.ndarray, axis: str, layout: str) -> Array:
    """Causal attention of this device's q [B, h, T/C, dh] and k, v [B, hk, T/C, dh] over the whole
    sequence.

    positions: [C, T/C], row c = the true positions of device c's tokens in `layout`
    (context.shard_positions); inside shard_map over `axis` (size C). Step 0 (the device's own
    block) is masked by the true positions; later blocks compute only what the layout leaves
    visible (BLOCKS). Grouped-query attention (hk < h): the blocks travel as the hk kv heads
    (layers.group_heads: [B, hk, 1, T/C, dh], h/hk times fewer bytes than the query heads) and
    the merges broadcast them over each group. Returns [B, h, T/C, dh] in q's dtype."""
    if q.ndim == 4 and k.shape[1] != q.shape[1]:  # -> [B, hk, h/hk, T/C, dh] and [B, hk, 1, T/C, dh]
        return layers.ungroup_heads(ring_attention(*layers.group_heads(q, k, v), positions, axis, layout))
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    assert positions.shape == (n, q.shape[-2]), (positions.shape, n, q.shape)
    q_pos = jnp.asarray(positions)[me]  # [T/C]
    rows = (*q.shape[:-1], 1)
    stats = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(q.shape, jnp.float32))
    stats = jax.tree.map(lambda s: lax.pcast(s, axis, to="varying"), stats)
    stats = _merge(stats, q, k, v, layers.visible(q_pos, q_pos))  # own block: causal within it
    for step in range(1, n):
        k, v = ring_shift(k, axis, 1), ring_shift(v, axis, 1)  # now the block of device me - step
        stats = BLOCKS[layout](stats, q, k, v, earlier=step <= me)  # (me - step) mod n < me
    _, l, acc = stats
    return (acc / l).astype(q.dtype)
