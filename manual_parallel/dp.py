"""Data parallelism, shard_map twin: every device runs the single-device
program on its B/data rows with a full copy of the weights.

Forward: no communication.
Backward: the gradient of every parameter is averaged over `data` - the
all-reduce written in manual_parallel/runner.py `mean_over_tokens` (params are
`pcast` to varying over `data` first, so autodiff adds no psum of its own).
Optimizer: gradients are then replicated, so the global norm is local.
"""

from manual_parallel.base import ManualParallelism

__all__ = ["DataParallel", "PARALLELISM"]


class DataParallel(ManualParallelism):
    """No hooks: the model runs unchanged on local batch rows [B/data, T]."""


PARALLELISM = DataParallel
