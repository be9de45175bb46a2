"""Context parallelism, shard_map twin: the sequence is split over `context` (C shards of T/C
tokens, twinshard/parallel/context.py's layout) from the embedding to the loss; every weight is
replicated; attention is ring attention (manual_parallel/ring_attention.py).

The collectives and why: docs/long-context.md (manual_parallel/cp.py)."""

from manual_parallel.ring_attention import ring_attention, saves_ring_shifts
from manual_parallel.runner import DATA, ManualParallelism, ManualRunner, SequenceShards
from twinshard.model.remat import also_saving
from twinshard.parallel import context
from twinshard.parallel.context import CONTEXT

__all__ = ["ContextParallel", "ContextRunner", "Runner", "parallelism"]


class ContextParallel(SequenceShards, ManualParallelism):
    """RoPE positions (SequenceShards) and ring attention of a sequence shard; everything else is
    single-device code."""

    def __init__(self, param_rules, layout: str = "zigzag"):
        super().__init__(param_rules)
        self.layout = layout

    def attention(self, q, k, v, impl="auto", block=0):
        """q, k, v: [B, h, T/C, dh] -> [B, h, T/C, dh], ring attention over `context` (impl and
        block are unused: the ring computes its blocks itself)."""
        return ring_attention(q, k, v, self.table(q.shape[-2]), CONTEXT, self.layout)

    def layer_policy(self, policy):
        return also_saving(super().layer_policy(policy), saves_ring_shifts)


class ContextRunner(context.PermutedBatches, ManualRunner):
    """ManualRunner whose tokens are split over `context` too: the batch is permuted into the
    layout on the host; ManualRunner pcasts the params to varying over the token axes (data,
    context) before `grad` and averages the gradients and the loss over them."""

    TOKEN_AXES = (DATA, CONTEXT)


def parallelism(mesh, run) -> ContextParallel:
    return ContextParallel(run.placed.params, run.cfg.train.cp_layout)


Runner = ContextRunner  # the batch is permuted into the context layout on the host
