"""Megatron tensor parallelism, GSPMD twin: heads, d_ff and the vocabulary split over
`tensor`; every device sees the whole batch and the whole residual stream.

The collectives and why: docs/design.md (auto_parallel/tp.py)."""

from auto_parallel.runner import GSPMD

__all__ = ["TensorParallel", "parallelism"]


class TensorParallel(GSPMD):
    """No hooks: the placement derives Megatron's f and g, the vocab-parallel lookup and loss."""


def parallelism(mesh, run) -> TensorParallel:
    return TensorParallel(mesh, run.placed.activations)
