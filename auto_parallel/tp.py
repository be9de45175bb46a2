"""Megatron tensor parallelism, GSPMD twin: heads, d_ff and the vocabulary split over
`tensor`; every device sees the whole batch and the whole residual stream.

The placement (strategies.TP): Q, K, V, W1, W3 column-parallel [D, out/tensor], O and W2
row-parallel [in/tensor, D], embedding and lm_head vocab-parallel.
Forward: an all-reduce of [B, T, D] after the embedding lookup and after each O and W2
(2 per layer); all-reduces of [B, T] softmax statistics (never the logits).
Backward: an all-reduce of [B, T, D] for the lm_head input gradient and 5 per layer:
GSPMD all-reduces the input gradient of q, k, v, w1 and w3 separately, where Megatron's
f (the manual twin) sums them first and all-reduces twice.
Optimizer: one scalar all-reduce per tensor-sharded gradient leaf (global norm).
No weight-sized collective, but with grouped-query attention where tensor > kv heads: the k/v
weights are placed replicated (Strategy.placed), GSPMD chooses how to use them (every device may
compute all kv heads), and their gradients, computed from each device's query heads, are summed
over `tensor`.
"""

from auto_parallel.runner import GSPMD

__all__ = ["TensorParallel", "parallelism"]


class TensorParallel(GSPMD):
    """No hooks: the placement derives Megatron's f and g, the vocab-parallel lookup and loss."""


def parallelism(mesh, run) -> TensorParallel:
    return TensorParallel(mesh, run.placed.activations)
