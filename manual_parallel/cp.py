"""Context parallelism, shard_map twin: the sequence is split over `context` (C shards of T/C
tokens, twinshard/parallel/context.py's layout) from the embedding to the loss; every weight is
replicated; attention is ring attention (manual_parallel/ring_attention.py).

Every position-wise op runs on the local [B, T/C] tokens unchanged; RoPE rotates them by
their true positions (`positions`: this shard's row of context.shard_positions).
Forward, per layer: 2(C-1) collective-permutes over `context` (C-1 of the K block and C-1 of
the V block [B, h, T/C, dh], `ring_shift`).
Backward, per layer: the reverse ring, 2(C-1) collective-permutes of dK and dV blocks.
Then the gradient of EVERY param is averaged over `context`: a sequence shard is to the
params what a data shard is - its loss is the mean over its own T/C tokens, the global loss
the mean of the C equal-sized shard means, so dL/dW = mean over shards of each shard's
gradient, for the embedding and lm_head as for the attention weights. `ContextRunner` names
`context` a token axis beside `data` (ManualRunner.TOKEN_AXES): ManualRunner then pcasts the
params to varying over it before `grad` (so autodiff adds no psum of its own) and pmeans the
gradients and the loss over the token axes each param is replicated on (cp: (data, context);
fsdp_cp's matrix shards: context alone). Optimizer: gradients are replicated after the mean: the global norm is local.

Remat: a checkpointed layer keeps the received K/V blocks (`layer_policy`), so its backward
never re-runs the ring's forward permutes (the project's rule: remat trades FLOPs, not
communication).
"""

import jax.numpy as jnp
from jax import lax

from manual_parallel.base import ManualParallelism
from manual_parallel.ring_attention import ring_attention, saves_ring_shifts
from manual_parallel.runner import DATA, ManualRunner
from twinshard.model.remat import also_saving
from twinshard.parallel import context
from twinshard.parallel.context import CONTEXT

__all__ = ["ContextParallel", "ContextRunner", "Runner", "parallelism"]


class ContextParallel(ManualParallelism):
    """RoPE positions and attention of a sequence shard; everything else is single-device code."""

    def __init__(self, param_rules, layout: str = "zigzag"):
        super().__init__(param_rules)
        self.layout = layout

    def table(self, t_local: int):
        """[C, T/C]: every shard's true positions (T = t_local * C)."""
        c = lax.axis_size(CONTEXT)
        return context.shard_positions(t_local * c, c, self.layout)

    def positions(self, t):
        """This shard's t = T/C positions in the whole sequence."""
        return jnp.asarray(self.table(t))[lax.axis_index(CONTEXT)]

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
