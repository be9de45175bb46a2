"""All-to-all sequence parallelism (DeepSpeed-Ulysses), GSPMD twin: the sequence dimension of
the batch and of every activation split over `context`, every weight replicated (cp's placement),
and inside attention q, k, v and the output pinned to head shards of whole sequences:
[B, h, T, dh] split over `context` on h, not T. XLA derives the communication between the two
layouts. Grouped-query attention repeats the kv heads as the manual twin does
(context.kv_repeats) before the pin. Splash runs in placement.sharded_attention's shard_map over
the head axis (this module's head rules).

What XLA inserts (tests/test_ulysses.py, test_auto_all_to_alls, compiled on XLA:CPU): per layer
the 4 all-to-alls of the manual twin forward (q, k, v to head shards, the output back) and 4
backward, each [B, h, T/C, dh]: the resharding seq -> heads of an array is exactly an
all-to-all, which the SPMD partitioner emits for a change of the split dimension. The gradients
are all-reduced over `context`, as cp's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from auto_parallel.runner import GSPMD, AutoRunner
from twinshard.parallel import context, placement
from twinshard.parallel.context import CONTEXT
from twinshard.parallel.placement import ATTENTION_KV, ATTENTION_Q, spec
from twinshard.parallel.strategies import ULYSSES

__all__ = ["UlyssesParallel", "Runner", "parallelism"]


class UlyssesParallel(GSPMD):
    """GSPMD hooks of ulysses: the sequence split everywhere but in attention, split on heads there."""

    def attention(self, q, k, v, impl="auto", block=0):
        """q [B, h, T, dh], k, v [B, hk, T, dh] global, T split over context -> the same."""
        r = context.kv_repeats(q.shape[1], k.shape[1], self.mesh.shape[CONTEXT])
        k, v = (jnp.repeat(x, r, axis=1) if r > 1 else x for x in (k, v))
        heads = {a: m for a, m in self.rules.items() if a != "seq"} | {"heads": CONTEXT, "kv_heads": CONTEXT}
        pin = lambda x, axes, rules: jax.lax.with_sharding_constraint(  # noqa: E731
            x, NamedSharding(self.mesh, spec(axes, rules)))
        q, k, v = pin(q, ATTENTION_Q, heads), pin(k, ATTENTION_KV, heads), pin(v, ATTENTION_KV, heads)
        out = pin(placement.sharded_attention(self.mesh, heads, q, k, v, impl, block), ATTENTION_Q, heads)
        return pin(out, ATTENTION_Q, self.rules)


def parallelism(mesh, cfg) -> UlyssesParallel:
    return UlyssesParallel(mesh, ULYSSES.activations)


Runner = AutoRunner
