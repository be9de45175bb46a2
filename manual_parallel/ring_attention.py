"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): causal
attention over a sequence split across the `context` axis, with K/V blocks travelling a ring.

Each of the C devices holds the q, k, v of its T/C tokens ([B, h, T/C, dh]) and their true
positions (twinshard/context.py: contiguous or zig-zag). C steps:

    step s: this device holds the K/V block of device (c - s) mod C; it scores its q against
            it (f32, mask from the true positions: key position <= query position, causal
            across chunks), and merges the block into running statistics
            (m: row max, l: sum of exp(score - m), acc: sum of exp(score - m) v), all f32;
            unless s = C-1, it passes the block on: `ring_shift` (ppermute c -> c+1).
    out = acc / l

the online softmax of flash attention (Milakov & Gimelshein 2018; Dao et al. 2022) across
devices. Step 0 is the device's own block, which holds every query's diagonal key, so m is
finite after it and a later block that is fully masked for a row adds exactly 0 (exp(-inf)).
Every block is computed and masked (no block is skipped): equal to the single-device
attention, and equal work on every device whatever the layout. What zig-zag balances is the
USEFUL work (context.useful_pairs): a kernel that skips masked scores, or the half blocks
zig-zag makes of every step after the first, would run equally long on every device.

Collectives per call (one layer): forward C-1 `ring_shift`s of K and C-1 of V, each a
collective-permute of [B, h, T/C, dh] over `context`; backward (ring_shift's custom_vjp) the
reverse ring, C-1 of dK and C-1 of dV. Autodiff of the loop saves each step's scores
inputs: every K/V block the device saw (so the whole sequence's K and V, [B, h, T, dh] each)
and each step's probabilities [B, h, T/C, T/C] (together [B, h, T/C, T]: 1/C of the
single-device [B, h, T, T]). A hand-written backward that passes K/V around the ring again
(with dK/dV) would hold one block instead, for twice the backward permutes: left out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array


def _next(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def ring_shift(x: Array, axis: str) -> Array:
    """Pass x (a K or V block [B, h, T/C, dh]) to the next device of the ring: c -> c+1 mod C, a
    collective-permute over `axis`. Backward: the reverse ring, c+1 -> c: the gradient of the
    block goes back to the device that sent it (autodiff would transpose the ppermute the same
    way; the pair written out names both directions)."""
    return lax.ppermute(x, axis, perm=_next(lax.axis_size(axis)))


def _shift_fwd(x, axis):
    return ring_shift(x, axis), None


def _shift_bwd(axis, _, grad):
    return (lax.ppermute(grad, axis, perm=[(dst, src) for src, dst in _next(lax.axis_size(axis))]),)


ring_shift.defvjp(_shift_fwd, _shift_bwd)


def saves_ring_shifts(prim, *_, **params) -> bool:
    """Remat policy: save every ring_shift output (a received K/V block), so a checkpointed
    layer's backward never re-runs the ring's forward permutes (manual_parallel/cp.py)."""
    return prim.name == "custom_vjp_call" and any(
        e.primitive.name == "ppermute" for e in params["call_jaxpr"].eqns)


def _merge(stats, q: Array, k: Array, v: Array, keep: Array):
    """One block into the running (m, l, acc). q [B, h, Tq, dh], k/v [B, h, Tk, dh], keep [Tq, Tk]."""
    m, l, acc = stats
    scores = jnp.einsum("...qd,...kd->...qk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1]).astype(np.float32)
    scores = jnp.where(keep, scores, -jnp.inf)
    # the max only keeps exp() in range: the result does not depend on it (as in layers.softmax)
    m_new = jnp.maximum(m, lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    p = jnp.exp(scores - m_new)  # [B, h, Tq, Tk]
    rescale = jnp.exp(m - m_new)  # [B, h, Tq, 1]: 0 at step 0 (m = -inf)
    acc = acc * rescale + jnp.einsum("...qk,...kd->...qd", p.astype(v.dtype), v).astype(jnp.float32)
    return m_new, l * rescale + jnp.sum(p, axis=-1, keepdims=True), acc


def ring_attention(q: Array, k: Array, v: Array, positions: np.ndarray, axis: str) -> Array:
    """Causal attention of this device's q, k, v [B, h, T/C, dh] over the whole sequence.

    positions: [C, T/C], row c = the true positions of device c's tokens (context.shard_positions);
    inside shard_map over `axis` (size C). Returns [B, h, T/C, dh] in q's dtype."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    assert positions.shape == (n, q.shape[-2]), (positions.shape, n, q.shape)
    table = jnp.asarray(positions)
    q_pos = table[me]  # [T/C]
    rows = (*q.shape[:-1], 1)
    stats = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(q.shape, jnp.float32))
    stats = jax.tree.map(lambda s: lax.pcast(s, axis, to="varying"), stats)
    for step in range(n):
        k_pos = table[(me - step) % n]  # the block now held came from device me - step
        stats = _merge(stats, q, k, v, k_pos[None, :] <= q_pos[:, None])
        if step < n - 1:
            k, v = ring_shift(k, axis), ring_shift(v, axis)
    _, l, acc = stats
    return (acc / l).astype(q.dtype)
