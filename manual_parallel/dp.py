"""Data parallelism, shard_map twin: every weight replicated, the batch split over `data`;
each device runs the single-device program on its B/data rows.

The collectives and why: docs/design.md (manual_parallel/dp.py)."""

from manual_parallel.runner import ManualParallelism

__all__ = ["DataParallel", "parallelism"]


class DataParallel(ManualParallelism):
    """No hooks: the model runs unchanged on local batch rows [B/data, T]; the runner means the gradients."""


def parallelism(mesh, run) -> DataParallel:
    return DataParallel(run.placed.params)
