"""Megatron sequence parallelism (tp_sp), GSPMD twin: TP's placement, plus the residual
stream between blocks split along the sequence over `tensor`, [B/data, T/tensor, D].

Placement only (twinshard/parallel/strategies.py TP_SP): the parameters are placed as TP's; the batch (tokens) is replicated over `tensor`
as in TP (split over `data`); the residual stream - the `ACTIVATION` constraint on the
embedding output and on each block's output (twinshard/model/transformer.py) - uses its `sequence` table
(seq -> tensor). The hooks pin the two layouts of the manual twin: whole T entering a
tensor-parallel region (enter_tensor_parallel, before the column-parallel matmuls and the
lm_head) and inside it (column/row-parallel activations on heads/mlp), sequence shards
leaving it (exit_tensor_parallel) and after the embedding lookup. XLA derives the collectives.

Measured (tiny, num_heads 8, XLA:CPU, JAX 0.12.0.1):
- The residual-stream rule alone is not enough: GSPMD then split the column-parallel
  matmuls by gathering the WEIGHTS ([64, 64], [64, 192] all-gathers), all-reduced weight
  gradients and sent attention's pieces through 20 all-to-alls (tensor:8: 76 collectives,
  88 with only the gathered input pinned). With the region layouts pinned: 4L + 2
  all-gathers of [B, T, D] over tensor, as the manual twin (tests/test_sequence.py).
- No reduce-scatter: each sequence scatter is an all-reduce of [B, T, D] + a slice, 2L + 1
  forward; in the backward pass GSPMD all-reduces the input gradients of q, k, v, w1, w3
  separately (5L) and the lm_head's (1), where the manual twin reduce-scatters their sums.
  The same on a TPU ahead-of-time compile (v5e:2x2, tensor:4, libtpu 0.0.50.1: 10
  all-gathers, all-reduces, no reduce-scatter): GSPMD's partial-sum -> sequence-shard
  reshard is an all-reduce + dynamic-slice on both backends, so the auto twin moves TP's
  all-reduce bytes PLUS the all-gathers.
- Without the `embed` pin GSPMD split the token ids along T (s32 all-gathers and
  collective-permutes on data:2,tensor:4).
- grad_accum K > 1 with data > 1: the runner's per-data-shard vmap (auto_parallel/runner.py
  `shard_loss`) runs these hooks with 'batch' dropped from both tables (`without_batch`), so
  each micro-batch [B/(data K), T, D] runs sequence-parallel. data:2,tensor:4, L=2, K=2
  (tests/test_sequence.py): 28 all-gathers over tensor = K (6L + 2), against 4L + 2 = 10 at
  K = 1: per micro-batch the forward's 2L + 1, but 4L + 1 backward - inside the vmap GSPMD
  gathers each layer-loop gradient twice, from the same operand, under two spellings of the
  tensor groups that XLA does not merge; all-reduces over tensor 57 = K (9L + 6) + 9 (K = 1:
  33), over data 13, once per step. With plain GSPMD hooks in the vmap (before
  `without_batch`) the micro-batches ran as TP: 47 all-reduces over tensor, no all-gather.
"""

from __future__ import annotations

from auto_parallel.runner import GSPMD
from twinshard.model import ACTIVATION
from twinshard.parallel.strategies import TP_SP

# Inside a region: [B, T, H*dh/t] or [B, T, F/t] (heads and mlp both map to tensor).
REGION = ("batch", "seq", "heads")


class SequenceParallelGSPMD(GSPMD):
    """GSPMD with two layouts of the residual stream [B, T, D]: split along T between the
    tensor-parallel regions, whole inside them (the manual twin's gather / scatter)."""

    def __init__(self, mesh):
        super().__init__(mesh, TP_SP.activations)  # TP's, the batch over data
        self.sequence = GSPMD(mesh, TP_SP.sequence)  # the residual stream [B, T, D]: T over tensor too
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

    def column_parallel(self, x, ws):
        """x @ each w on the whole sequence, each output [B, T, out/t] (heads or mlp: tensor)."""
        return tuple(self.constrain(y, REGION) for y in super().column_parallel(x, ws))

    def row_parallel(self, x, w):
        """x [B, T, in/t] (heads or mlp on tensor) @ w [in/t, D], then the reduce-scatter."""
        return super().row_parallel(self.constrain(x, REGION), w)

    def exit_tensor_parallel(self, x):
        """The row-parallel partial sums [B, T, D] -> summed, on sequence shards."""
        return self.constrain(x, ACTIVATION)

    def without_batch(self) -> SequenceParallelGSPMD:
        """Both tables without 'batch' (the per-data-shard vmap of grad_accum > 1)."""
        hooks = super().without_batch()
        hooks.sequence = self.sequence.without_batch()
        return hooks


def parallelism(mesh, cfg) -> GSPMD:
    return SequenceParallelGSPMD(mesh)
