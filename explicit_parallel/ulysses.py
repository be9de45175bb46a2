"""All-to-all sequence parallelism (ulysses), explicit twin: the residual stream typed
[B, T@context, D] everywhere; attention reshards q, k, v to whole sequences of H/C heads
([B, h@context, T, dh]: an all-to-all each) and its output back. Mesh `context:C`.

The collectives and why: docs/long-context.md (ulysses)."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from explicit_parallel.runner import Explicit
from twinshard.parallel import context
from twinshard.parallel.context import CONTEXT
from twinshard.parallel.placement import ATTENTION_KV, ATTENTION_Q, spec
from twinshard.placed import sharded_attention

__all__ = ["UlyssesParallel", "parallelism"]


class UlyssesParallel(Explicit):
    """Explicit's hooks; attention on head shards of whole sequences."""

    def __init__(self, mesh, activation_rules):
        super().__init__(mesh, activation_rules)
        self.flat_rows = False  # [B, T@context] rows do not merge into one split dim (as tp_sp's)

    def attention(self, q, k, v, impl="auto", block=0):
        """q [B, h, T@context, dh], k, v [B, hk, T@context, dh] -> [B, h, T@context, dh]: reshard to
        [B, h@context, T, dh] (forward and backward: an all-to-all), the kernel, reshard back."""
        k, v = context.repeat_kv(k, v, q.shape[1], self.mesh.shape[CONTEXT])
        heads = context.head_rules(self.rules)
        to = lambda x, axes, rules: jax.sharding.reshard(x, NamedSharding(self.mesh, P(*spec(axes, rules))))  # noqa: E731
        q, k, v = to(q, ATTENTION_Q, heads), to(k, ATTENTION_KV, heads), to(v, ATTENTION_KV, heads)
        return to(sharded_attention(self.mesh, heads, q, k, v, impl, block), ATTENTION_Q, self.rules)


def parallelism(mesh, run) -> UlyssesParallel:
    return UlyssesParallel(mesh, run.placed.activations)
