"""Context parallelism, GSPMD twin: the sequence dimension of the batch and of every activation
is split over `context`; every weight is replicated.

The collectives and why: docs/long-context.md (auto_parallel/cp.py)."""

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
