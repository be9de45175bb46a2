"""Cross-entropy over a padded (and possibly vocab-sharded) logit matrix.

The loss is written once, in terms of three statistics, each followed by a
reduction hook. On one device (and under GSPMD) the hooks are the identity;
Megatron's vocab-parallel cross-entropy (manual_parallel/tp.py) passes
`pmax`/`psum` over `tensor`, so no device ever holds the full [B, T, V] logits:

    m      = max_v z_v                       -> reduce_max (pmax)
    s      = sum_v exp(z_v - m)              -> reduce_sum (psum)
    z_y    = z_target (0 off this shard)     -> reduce_sum (psum)
    loss   = m + log s - z_y
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
Reduce = Callable[[Array], Array]


def _identity(x: Array) -> Array:
    return x


def mask_padded_logits(logits: Array, vocab_size: int, vocab_offset: Array | int = 0) -> Array:
    """-inf on columns whose global id >= vocab_size, so padding takes no probability.

    logits: [..., V_local]; this shard holds global ids vocab_offset + [0, V_local).
    A shard known (statically) to hold no padding is returned as it is: the select over
    [B, T, V] costs a visible share of a CPU step.
    """
    if isinstance(vocab_offset, int) and vocab_offset + logits.shape[-1] <= vocab_size:
        return logits
    ids = vocab_offset + jnp.arange(logits.shape[-1])
    return jnp.where(ids < vocab_size, logits, -jnp.inf)


def token_cross_entropy(
    logits: Array, targets: Array, vocab_size: int, vocab_offset: Array | int = 0,
    reduce_max: Reduce = _identity, reduce_sum: Reduce = _identity,
) -> Array:
    """Per-token -log softmax(logits)[target]. logits: [..., V_local], targets: [...] -> [...].

    Stable at any logit scale (log-sum-exp with the max subtracted); the max is a
    constant shift, so it is excluded from differentiation (the loss does not
    depend on it).
    """
    z = mask_padded_logits(logits.astype(jnp.float32), vocab_size, vocab_offset)
    m = reduce_max(jax.lax.stop_gradient(jnp.max(z, axis=-1)))  # [...]
    s = reduce_sum(jnp.sum(jnp.exp(z - m[..., None]), axis=-1))  # [...]
    local = targets - vocab_offset
    on_shard = (local >= 0) & (local < z.shape[-1])
    z_y = jnp.take_along_axis(z, jnp.clip(local, 0, z.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    z_y = reduce_sum(jnp.where(on_shard, z_y, 0.0))  # [...]
    return m + jnp.log(s) - z_y


def cross_entropy(logits: Array, targets: Array, vocab_size: int) -> Array:
    """Mean cross-entropy over all tokens. logits: [..., V_pad], targets: [...] int."""
    return jnp.mean(token_cross_entropy(logits, targets, vocab_size))
