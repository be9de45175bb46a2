"""Megatron sequence parallelism (tp_sp), GSPMD twin: TP's placement, plus the residual
stream between blocks split along the sequence over `tensor`, [B/data, T/tensor, D].

The collectives and why: docs/design.md (auto_parallel/tp_sp.py)."""

from __future__ import annotations

from auto_parallel.runner import GSPMD
from twinshard.model import ACTIVATION
from twinshard.parallel.strategies import Strategy

__all__ = ["SequenceParallel", "parallelism"]

# Inside a region: [B, T, H*dh/t] or [B, T, F/t] (heads and mlp both map to tensor; the kv heads'
# [B, T, Hkv*dh/t] too while tensor divides them, else whole: Strategy.placed).
REGION = ("batch", "seq", "heads")


class SequenceParallel(GSPMD):
    """GSPMD with two layouts of the residual stream [B, T, D]: split along T between the
    tensor-parallel regions, whole inside them (the manual twin's gather / scatter)."""

    def __init__(self, mesh, placed: Strategy):
        super().__init__(mesh, placed.activations)  # TP's, the batch over data
        self.sequence = GSPMD(mesh, placed.sequence)  # the residual stream [B, T, D]: T over tensor too
        self.flat_rows = self.sequence.flat_rows  # False: the residual stream is split along T

    def constrain(self, x, axes):
        """The residual stream (embedding and block outputs) on sequence shards."""
        return (self.sequence if axes == ACTIVATION else super()).constrain(x, axes)

    def embed(self, ids, table):
        """The vocab-parallel lookup on the whole sequence (as TP); the model then constrains it
        to sequence shards (the scatter)."""
        return super().constrain(super().embed(ids, table), ACTIVATION)

    def enter_tensor_parallel(self, x):
        """[B, T/t, D] -> whole T, before the column-parallel matmuls and the lm_head."""
        return super().constrain(x, ACTIVATION)

    def column_parallel(self, x, ws, axes=None):
        """x @ each w on the whole sequence, each output [B, T, out/t] (heads or mlp: tensor; kv
        heads as placed)."""
        outs = super().column_parallel(x, ws, axes)
        return tuple(self.constrain(y, REGION[:2] + (a,)) for y, a in zip(outs, axes or (REGION[2],) * len(outs)))

    def row_parallel(self, x, w):
        """x [B, T, in/t] (heads or mlp on tensor) @ w [in/t, D], then the reduce-scatter."""
        return super().row_parallel(self.constrain(x, REGION), w)

    def exit_tensor_parallel(self, x):
        """The row-parallel partial sums [B, T, D] -> summed, on sequence shards."""
        return self.constrain(x, ACTIVATION)

    def without_batch(self) -> SequenceParallel:
        """Both tables without 'batch' (the per-data-shard vmap of grad_accum > 1)."""
        hooks = super().without_batch()
        hooks.sequence = self.sequence.without_batch()
        return hooks


def parallelism(mesh, run) -> SequenceParallel:
    return SequenceParallel(mesh, run.placed)
