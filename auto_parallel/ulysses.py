"""All-to-all sequence parallelism (DeepSpeed-Ulysses), GSPMD twin: cp's placement, and inside
attention q, k, v and the output pinned to head shards of whole sequences, [B, h@context, T, dh].

The collectives and why: docs/long-context.md (auto_parallel/ulysses.py)."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from auto_parallel.runner import GSPMD, AutoRunner
from twinshard.parallel import context
from twinshard.parallel.context import CONTEXT
from twinshard.parallel.placement import ATTENTION_KV, ATTENTION_Q, spec
from twinshard.placed import sharded_attention

__all__ = ["UlyssesParallel", "Runner", "parallelism"]


class UlyssesParallel(GSPMD):
    """GSPMD hooks of ulysses: the sequence split everywhere but in attention, split on heads there."""

    def attention(self, q, k, v, impl="auto", block=0):
        """q [B, h, T, dh], k, v [B, hk, T, dh] global, T split over context -> the same."""
        k, v = context.repeat_kv(k, v, q.shape[1], self.mesh.shape[CONTEXT])
        heads = context.head_rules(self.rules)
        pin = lambda x, axes, rules: jax.lax.with_sharding_constraint(  # noqa: E731
            x, NamedSharding(self.mesh, spec(axes, rules)))
        # seq-split first: without it the head layout propagated back into RoPE and the norms, and
        # GSPMD gathered the residual stream [B, T, D] over context there (measured, JAX 0.12)
        q, k, v = pin(q, ATTENTION_Q, self.rules), pin(k, ATTENTION_KV, self.rules), pin(v, ATTENTION_KV, self.rules)
        q, k, v = pin(q, ATTENTION_Q, heads), pin(k, ATTENTION_KV, heads), pin(v, ATTENTION_KV, heads)
        out = pin(sharded_attention(self.mesh, heads, q, k, v, impl, block), ATTENTION_Q, heads)
        return pin(out, ATTENTION_Q, self.rules)


def parallelism(mesh, run) -> UlyssesParallel:
    return UlyssesParallel(mesh, run.placed.activations)


Runner = AutoRunner
