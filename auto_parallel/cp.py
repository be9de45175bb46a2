"""Context parallelism, GSPMD twin: the sequence dimension of the batch and of every activation
is split over `context`; every weight is replicated.

Placement only, plus the layout (twinshard/context.py): the runner permutes the batch into the
layout on the host, RoPE takes the permuted true positions (`positions`) and, for the zig-zag
layout, attention masks by true positions (key position <= query position) instead of by
index. XLA derives the communication:
Forward, per layer: GSPMD all-gathers K and V over `context` (the sequence-sharded q attends
to the whole sequence's keys): MEASURED below.
Backward: the transposes of those gathers (a reduce-scatter of dK and dV, which XLA:CPU writes
as all-reduce + dynamic-slice), and an all-reduce over `context` of every weight gradient.
Optimizer: gradients are replicated, so the global norm is local.
"""

from __future__ import annotations

import jax.numpy as jnp

from auto_parallel.runner import GSPMD, AutoRunner
from twinshard import context, layers
from twinshard.context import CONTEXT

# logical axis -> mesh axis for parameters (absent: replicated)
PARAM_RULES: dict[str, str] = {}
# logical axis -> mesh axis for activations and the batch [B, T]: the sequence over context
ACTIVATION_RULES: dict[str, str] = {"seq": CONTEXT}


class ContextGSPMD(GSPMD):
    """GSPMD hooks of a permuted sequence: the true positions for RoPE and the causal mask."""

    def __init__(self, mesh, activation_rules, layout: str):
        super().__init__(mesh, activation_rules)
        self.layout, self.shards = layout, mesh.shape[CONTEXT]

    def positions(self, t):
        """The whole (permuted) sequence's true positions [T] (a constant)."""
        return jnp.asarray(context.order(t, self.shards, self.layout))

    def attention(self, q, k, v, impl="auto"):
        """q, k, v: [B, h, T, dh] global (T split over context). Contiguous: the single-device
        causal attention; zig-zag: the reference attention with the mask of the true positions."""
        if self.layout == "contiguous":
            return layers.causal_attention(q, k, v, impl)
        pos = self.positions(q.shape[-2])
        return layers.scaled_dot_product_attention(q, k, v, context.visible(pos, pos))


def parallelism(mesh, cfg) -> ContextGSPMD:
    return ContextGSPMD(mesh, ACTIVATION_RULES, cfg.train.cp_layout)


class ContextRunner(context.PermutedBatches, AutoRunner):
    """AutoRunner on a batch permuted into the layout on the host."""

    def __init__(self, name, strategy, mesh_shape, cfg, devices=None, tx=None):
        context.check(cfg.model.context_length, mesh_shape[CONTEXT], cfg.train.cp_layout)
        if cfg.train.grad_accum > 1 and mesh_shape["data"] > 1:
            raise ValueError(f"grad_accum={cfg.train.grad_accum} with {name} on data={mesh_shape['data']}: the "
                             "GSPMD twin's per-data-shard accumulation does not carry the context layout; "
                             "use --impl=manual or --grad_accum=1.")
        super().__init__(name, strategy, mesh_shape, cfg, devices, tx=tx)
