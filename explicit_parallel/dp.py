"""Data parallelism, explicit twin: every weight replicated, the batch split over `data`;
the types say where the gradient is reduced.

Forward: no communication: each matmul's rows [B*T@data, D] meet a replicated weight.
Backward: the runner casts every weight matrix to `reduced` over `data` (a free reshard), so
each matrix gradient leaves the backward pass `unreduced` over `data` (each device's partial
sum, typed `{U:data}`); the reshard of each stacked [L, ...] gradient to replicated after
the layer loop is its all-reduce (explicit_parallel/runner.py `_loss_and_grads`). The RMSNorm
gains' gradients are all-reduced inside the backward layer loop (the runner's docstring).
Optimizer: gradients are replicated, so the global norm is local.
"""

from explicit_parallel.runner import Explicit

__all__ = ["DataParallel", "parallelism"]


class DataParallel(Explicit):
    """No hooks: the placement (strategies.DP) and the runner's `reduced` cast are all there is."""


def parallelism(mesh, run) -> DataParallel:
    return DataParallel(mesh, run.placed.activations)
