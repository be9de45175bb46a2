"""Data parallelism, GSPMD twin: every weight replicated, the batch split over `data`.

The collectives and why: docs/design.md (auto_parallel/dp.py)."""

from auto_parallel.runner import GSPMD

__all__ = ["DataParallel", "parallelism"]


class DataParallel(GSPMD):
    """No hooks: the placement (strategies.DP) is all there is; XLA derives the all-reduces."""


def parallelism(mesh, run) -> DataParallel:
    return DataParallel(mesh, run.placed.activations)
