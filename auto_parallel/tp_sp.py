"""Megatron sequence parallelism (tp_sp), GSPMD twin: TP's placement, plus the residual
stream between blocks split along the sequence over `tensor`, [B/data, T/tensor, D].

Placement (twinshard/parallel/strategies.py TP_SP): the parameters are placed as TP's; the
batch (tokens) is replicated over `tensor` as in TP (split over `data`); the residual
stream - the `ACTIVATION` constraint on the embedding output and on each block's output
(twinshard/model/transformer.py) - uses its `sequence` table (seq -> tensor). The hooks pin
the two layouts of the manual twin: whole T entering a tensor-parallel region
(enter_tensor_parallel, before the column-parallel matmuls and the lm_head) and inside it
(column/row-parallel activations on heads/mlp), sequence shards leaving it
(exit_tensor_parallel) and after the embedding lookup. XLA derives the collectives.

Why each pin (measured, JAX 0.12):
- The residual-stream rule alone is not enough: GSPMD then split the column-parallel
  matmuls by gathering the WEIGHTS, all-reduced weight gradients and sent attention's
  pieces through all-to-alls. With the region layouts pinned it all-gathers the sequence
  as the manual twin does.
- GSPMD's partial-sum -> sequence-shard reshard is an all-reduce + dynamic-slice, never a
  reduce-scatter, on XLA:CPU and on a TPU ahead-of-time compile alike, so the auto twin
  moves TP's all-reduce bytes PLUS the all-gathers.
- Without the `embed` pin GSPMD split the token ids along T (s32 all-gathers and
  collective-permutes).
grad_accum K > 1 with data > 1: the runner's per-data-shard vmap (auto_parallel/runner.py
`shard_loss`) runs these hooks with 'batch' dropped from both tables (`without_batch`), so
each micro-batch [B/(data K), T, D] runs sequence-parallel (with plain GSPMD hooks in the
vmap the micro-batches ran as TP). tests/test_sequence.py
(test_auto_twin_gathers_and_scatters_the_sequence, test_auto_twin_accumulates_on_sequence_shards)
asserts the collectives.
"""

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
