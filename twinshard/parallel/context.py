"""Context parallelism's token layout: which positions of the sequence each `context` shard holds.

Under `cp` / `fsdp_cp` the sequence [B, T] is split over the mesh axis `context` (C shards of
T/C tokens) from the embedding to the loss. Every position-wise op (embedding, norms, the
projections, SwiGLU, the loss) runs on a shard as it would on the whole sequence; only
attention mixes positions, and it needs the TRUE positions of the shard's tokens: for RoPE
(`Parallelism.positions`) and for the causal mask (key position <= query position).

Two layouts (`TrainConfig.cp_layout`, `--cp_layout`):

    contiguous  shard c holds positions [c T/C, (c+1) T/C). Causal attention is unbalanced:
                shard c's queries see (c + 1/2) T/C keys on average, so shard C-1 does about
                2C-1 times the useful work of shard 0.
    zigzag      T is cut into 2C chunks of T/(2C); shard c holds chunks c and 2C-1-c (an early
                and a late chunk: Brandon et al. 2023, "Striped Attention", and the zig-zag of
                Llama 3's context parallelism). Every shard holds the same number of (query, key)
                pairs under the causal mask: the work is balanced (`useful_pairs`).

The layout is a permutation of the sequence, applied ONCE on the host (`order`, in the
runners' `place_batch`) before the batch is placed: token order does not change a mean
loss over tokens, so the permuted batch trains exactly like the original as long as RoPE
and the mask use the true positions (`shard_positions`). Both twins use these tables.
"""

from __future__ import annotations

import functools

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
    """[C, T/C] int32: row c = the positions (in the whole sequence) of shard c's tokens, in the
    order the shard holds them (zigzag: chunk c, then chunk 2C-1-c). Cached and read-only: the
    runners' `place_batch` asks for it every step, the model's hooks at every trace."""
    check(seq, shards, layout)
    if layout == "contiguous":
        table = np.arange(seq, dtype=np.int32).reshape(shards, seq // shards)
    else:
        chunks = np.arange(seq, dtype=np.int32).reshape(2 * shards, seq // (2 * shards))
        table = np.stack([np.concatenate([chunks[c], chunks[2 * shards - 1 - c]]) for c in range(shards)])
    table.setflags(write=False)
    return table


def order(seq: int, shards: int, layout: str) -> np.ndarray:
    """[T]: the host permutation of the sequence; x[:, order] split into C contiguous blocks puts
    shard c's tokens on shard c (the identity for the contiguous layout)."""
    return shard_positions(seq, shards, layout).reshape(-1)


def useful_pairs(seq: int, shards: int, layout: str) -> np.ndarray:
    """[C]: the (query, key) pairs each shard's queries keep under the causal mask, over all keys
    of the sequence: the attention work a kernel that skips masked scores does per shard."""
    return np.array([int(np.sum(p + 1)) for p in shard_positions(seq, shards, layout)])


class PermutedBatches:
    """Runner mixin: `place_batch` permutes the sequence by `order` on the host, then places it
    (tokens and targets alike: the pair (x[t], y[t]) stays together, the loss is a mean over
    tokens). Needs `self.cfg` and `self.sizes` (placement.PlacedRunner)."""

    def place_batch(self, x, y):
        perm = order(np.shape(x)[1], self.sizes[CONTEXT], self.cfg.train.cp_layout)
        return super().place_batch(np.asarray(x)[:, perm], np.asarray(y)[:, perm])


def layout_of(strategy: str, cp_layout: str) -> str:
    """The layout `strategy` runs: the ring's `cp_layout`, contiguous for the all-to-all strategies."""
    from twinshard.parallel import strategies

    return "contiguous" if strategy in strategies.ALL_TO_ALL_CONTEXT else cp_layout


def kv_repeats(heads: int, kv_heads: int, shards: int) -> int:
    """How often ulysses repeats each kv head so that the kv heads split over `shards` devices: the
    least r with shards | kv_heads r | heads (as tp replicates a kv head over its query group)."""
    check_heads(heads, shards)
    return next(r for r in range(1, heads // kv_heads + 1) if (kv_heads * r) % shards == 0 and heads % (kv_heads * r) == 0)


def check_heads(heads: int, shards: int) -> None:
    """ValueError unless the all-to-all strategies can split `heads` query heads over `shards` devices."""
    if heads % shards:
        fits = [k for k in range(2, shards + 1) if heads % k == 0]
        raise ValueError(f"num_heads={heads} does not split over context={shards} (ulysses's attention runs h/C "
                         f"heads per device); make --num_heads a multiple of {shards}"
                         + (f", or use context from {fits}" if fits else "") + ", or use --strategy=cp (the ring).")
