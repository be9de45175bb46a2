"""Context parallelism's token layout: which positions of the sequence each `context` shard holds.

Only attention mixes positions, so a shard needs its tokens' TRUE positions for RoPE and the
causal mask. contiguous: shard c holds [c T/C, (c+1) T/C) (unbalanced under the causal mask);
zigzag: chunks c and 2C-1-c of 2C (balanced, `useful_pairs`). The layout is a permutation applied
once on the host (`order`); docs/long-context.md has the rest.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from twinshard.config import CP_LAYOUTS as LAYOUTS  # ("zigzag", "contiguous")

CONTEXT = "context"  # the mesh axis


def check(seq: int, shards: int, layout: str) -> None:
    """ValueError (naming the value and the fix) unless `layout` splits `seq` tokens over `shards`."""
    if layout not in LAYOUTS:
        raise ValueError(f"cp_layout={layout!r} is not a context-parallel layout; choose one of "
                         f"{', '.join(LAYOUTS)} (--cp_layout).")
    chunks = 2 * shards if layout == "zigzag" else shards
    if seq % chunks:
        fits = [k for k in range(2, shards + 1) if seq % (2 * k if layout == "zigzag" else k) == 0]
        raise ValueError(
            f"context_length={seq} does not split into {chunks} equal chunks ({layout} layout over "
            f"context={shards}{': 2 chunks per shard' if layout == 'zigzag' else ''}); make --context_length "
            f"a multiple of {chunks}" + (f", or use context from {fits}" if fits else "")
            + (", or --cp_layout=contiguous (a multiple of the context size)" if layout == "zigzag" else "") + ".")


@functools.lru_cache(maxsize=None)
def shard_positions(seq: int, shards: int, layout: str) -> np.ndarray:
    """[C, T/C] int32: the true positions of shard c's tokens in the order it holds them (cached, read-only)."""
    check(seq, shards, layout)
    if layout == "contiguous":
        table = np.arange(seq, dtype=np.int32).reshape(shards, seq // shards)
    else:
        chunks = np.arange(seq, dtype=np.int32).reshape(2 * shards, seq // (2 * shards))
        table = np.stack([np.concatenate([chunks[c], chunks[2 * shards - 1 - c]]) for c in range(shards)])
    table.setflags(write=False)
    return table


def order(seq: int, shards: int, layout: str) -> np.ndarray:
    """[T]: the host permutation putting shard c's tokens in the c-th contiguous block."""
    return shard_positions(seq, shards, layout).reshape(-1)


def useful_pairs(seq: int, shards: int, layout: str) -> np.ndarray:
    """[C]: the (query, key) pairs each shard's queries keep under the causal mask."""
    return np.array([int(np.sum(p + 1)) for p in shard_positions(seq, shards, layout)])


class PermutedBatches:
    """Runner mixin: `place_batch` permutes tokens and targets by `order` on the host, then places them."""

    def place_batch(self, x, y):
        perm = order(np.shape(x)[1], self.sizes[CONTEXT], self.cfg.train.cp_layout)
        return super().place_batch(np.asarray(x)[:, perm], np.asarray(y)[:, perm])


def layout_of(strategy: str, cp_layout: str) -> str:
    """The layout `strategy` runs: the ring's `cp_layout`, contiguous for the all-to-all strategies."""
    from twinshard.parallel import strategies

    return "contiguous" if strategy in strategies.ALL_TO_ALL_CONTEXT else cp_layout


def kv_repeats(heads: int, kv_heads: int, shards: int) -> int:
    """How often ulysses repeats each kv head: the least r with shards | kv_heads r | heads."""
    check_heads(heads, shards)
    return next(r for r in range(1, heads // kv_heads + 1) if (kv_heads * r) % shards == 0 and heads % (kv_heads * r) == 0)


def repeat_kv(k, v, heads: int, shards: int):
    """k, v [B, hk, T, dh] with each kv head repeated kv_repeats times (C | hk r | h): every twin's ulysses."""
    r = kv_repeats(heads, k.shape[1], shards)
    k, v = (jnp.repeat(x, r, axis=1) if r > 1 else x for x in (k, v))
    return k, v


def head_rules(rules: dict) -> dict:
    """Attention's activation rules under ulysses: the heads (kv heads too) over context, not the sequence."""
    return {a: m for a, m in rules.items() if a != "seq"} | {"heads": CONTEXT, "kv_heads": CONTEXT}


def check_heads(heads: int, shards: int) -> None:
    """ValueError unless the all-to-all strategies can split `heads` query heads over `shards` devices."""
    if heads % shards:
        fits = [k for k in range(2, shards + 1) if heads % k == 0]
        raise ValueError(f"num_heads={heads} does not split over context={shards} (ulysses's attention runs h/C "
                         f"heads per device); make --num_heads a multiple of {shards}"
                         + (f", or use context from {fits}" if fits else "") + ", or use --strategy=cp (the ring).")
