"""Data parallelism, shard_map twin: every weight replicated, the batch split over `data`;
each device runs the single-device program on its B/data rows.

Forward: no communication.
Backward: the gradient of every parameter is averaged over `data`: the all-reduce written in
manual_parallel/runner.py `mean_over_tokens`, once per stacked [L, ...] gradient after the
layer loop (params are `pcast` to varying over `data` first, so autodiff adds no psum of its own).
Optimizer: gradients are replicated, so the global norm is local.
"""

from manual_parallel.base import ManualParallelism

__all__ = ["DataParallel", "parallelism"]


class DataParallel(ManualParallelism):
    """No hooks: the model runs unchanged on local batch rows [B/data, T]; the runner means the gradients."""


def parallelism(mesh, run) -> DataParallel:
    return DataParallel(run.placed.params)
