"""Data parallelism, GSPMD twin: every weight replicated, the batch split over `data`.

Forward: no communication.
Backward: an all-reduce over `data` of every gradient (the transpose of the implicit
broadcast of replicated weights to batch shards). GSPMD all-reduces each block gradient
inside the backward layer loop, one layer at a time, where the manual twin means each
stacked [L, ...] gradient once after the loop (the same bytes).
Optimizer: gradients are replicated, so the global norm is local.
"""

from auto_parallel.runner import GSPMD

__all__ = ["DataParallel", "parallelism"]


class DataParallel(GSPMD):
    """No hooks: the placement (strategies.DP) is all there is; XLA derives the all-reduces."""


def parallelism(mesh, run) -> DataParallel:
    return DataParallel(mesh, run.placed.activations)
