"""Data parallelism, explicit twin: every weight replicated, the batch split over `data`;
the types say where the gradient is reduced.

The collectives and why: docs/design.md (explicit_parallel/dp.py)."""

from explicit_parallel.runner import Explicit

__all__ = ["DataParallel", "parallelism"]


class DataParallel(Explicit):
    """No hooks: the placement (strategies.DP) and the runner's `reduced` cast are all there is."""


def parallelism(mesh, run) -> DataParallel:
    return DataParallel(mesh, run.placed.activations)
