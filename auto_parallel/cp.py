"""Context parallelism, GSPMD twin: the sequence dimension of the batch and of every activation
is split over `context`; every weight is replicated.

The placement (twinshard/parallel/strategies.py CP) plus the layout (twinshard/parallel/context.py):
the runner permutes the batch into the layout on the host, RoPE takes the permuted true
positions (`positions`) and, for the zig-zag layout, attention masks by true positions (key
position <= query position) instead of by index. XLA derives the communication.
GSPMD does not run a ring: it all-gathers K (after RoPE) and V, [B, H, T, dh], over `context`
in the forward layer loop and again in the backward loop (it saves the local shards, not the
gathered copies); the gradients of the gathered K and V come back as full-size all-reduces
(XLA:CPU's reduce-scatter), and every weight gradient is all-reduced over `context`. The
manual twin's ring sends the same K and V in collective-permutes and their gradients back
as many, with no all-reduce of dK, dV. Both hold the whole K and V per device for the
backward pass (the ring's autodiff keeps every block it received:
manual_parallel/ring_attention.py). tests/test_context.py
(test_auto_gathers_k_and_v_over_context) asserts the collectives.
Optimizer: gradients are replicated, so the global norm is local.
"""

from __future__ import annotations

import jax.numpy as jnp

from auto_parallel.runner import GSPMD, AutoRunner
from twinshard.parallel import context
from twinshard.model import layers
from twinshard.parallel.context import CONTEXT

__all__ = ["ContextParallel", "ContextRunner", "Runner", "parallelism"]


class ContextParallel(GSPMD):
    """GSPMD hooks of a permuted sequence: the true positions for RoPE and the causal mask."""

    def __init__(self, mesh, activation_rules, layout: str):
        super().__init__(mesh, activation_rules)
        self.layout, self.shards = layout, mesh.shape[CONTEXT]

    def positions(self, t):
        """The whole (permuted) sequence's true positions [T] (a constant)."""
        return jnp.asarray(context.order(t, self.shards, self.layout))

    def attention(self, q, k, v, impl="auto", block=0):
        """q, k, v: [B, h, T, dh] global (T split over context). Contiguous: the single-device
        causal attention; zig-zag: masked by the true positions (layers.causal_attention). Splash
        runs recompute: its kernel needs the whole sequence on a device."""
        order = context.order(q.shape[-2], self.shards, self.layout)
        positions = None if self.layout == "contiguous" else tuple(int(i) for i in order)
        impl = "recompute" if layers.attention_kernel(impl, q.dtype) == "splash" else impl
        return layers.causal_attention(q, k, v, impl, positions)


def parallelism(mesh, run) -> ContextParallel:
    return ContextParallel(mesh, run.placed.activations, run.cfg.train.cp_layout)


class ContextRunner(context.PermutedBatches, AutoRunner):
    """AutoRunner on a batch permuted into the layout on the host."""


Runner = ContextRunner  # the batch is permuted into the context layout on the host
