"""All-to-all sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023), shard_map twin: cp's
placement and contiguous layout; attention runs on whole sequences of h/C heads between
all_to_alls (4 per layer over `context`, their 4 inverses backward). docs/long-context.md says more.
"""

from jax import lax

from manual_parallel.collectives import heads_to_seq, seq_to_heads
from manual_parallel.runner import DATA, ManualParallelism, ManualRunner, SequenceShards
from twinshard.model import layers
from twinshard.parallel import context
from twinshard.parallel.context import CONTEXT
from twinshard.model.remat import also_saving

__all__ = ["UlyssesParallel", "UlyssesRunner", "Runner", "parallelism", "saves_exchanges"]


def saves_exchanges(prim, *_, **__) -> bool:
    """Remat policy: save every all_to_all output (seq_to_heads / heads_to_seq). The policy sees the
    custom_vjps' forward, a bare all_to_all: matching custom_vjp_call as cp's does saved nothing and
    the backward re-ran all 4 per layer (measured, JAX 0.12)."""
    return prim.name == "all_to_all"


class UlyssesParallel(SequenceShards, ManualParallelism):
    """The positions of contiguous sequence shards (SequenceShards); attention on whole sequences
    of h/C heads."""

    layout = "contiguous"

    def attention(self, q, k, v, impl="auto", block=0):
        """q [B, h, T/C, dh], k, v [B, hk, T/C, dh] -> [B, h, T/C, dh]; kv heads repeated r times
        (context.kv_repeats: C | hk r | h) when C does not divide them."""
        k, v = context.repeat_kv(k, v, q.shape[1], lax.axis_size(CONTEXT))
        q, k, v = (seq_to_heads(x, CONTEXT) for x in (q, k, v))
        return heads_to_seq(layers.causal_attention(q, k, v, impl, block=block), CONTEXT)

    def layer_policy(self, policy):
        return also_saving(super().layer_policy(policy), saves_exchanges)


class UlyssesRunner(ManualRunner):
    """ManualRunner whose tokens are split over `context` too: gradients and loss averaged over (data, context)."""

    TOKEN_AXES = (DATA, CONTEXT)


def parallelism(mesh, run) -> UlyssesParallel:
    return UlyssesParallel(run.placed.params)


Runner = UlyssesRunner
