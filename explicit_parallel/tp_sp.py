"""Megatron sequence parallelism (tp_sp), explicit twin: TP's placement, with the residual
stream between the tensor-parallel regions typed [B, T@tensor, D] (the strategy's `sequence`
table). Mesh `tensor:M` or `data:D,tensor:M`.

The collectives and why: docs/design.md (explicit_parallel/tp_sp.py)."""

from __future__ import annotations

import jax

from explicit_parallel.runner import Explicit
from explicit_parallel.tp import TENSOR, TensorParallel
from twinshard.model.transformer import ACTIVATION
from twinshard.parallel.strategies import Strategy

__all__ = ["SequenceParallel", "parallelism"]


class SequenceParallel(TensorParallel):
    """TP's hooks, with two types of the residual stream: sequence shards between the regions,
    the whole sequence inside them."""

    def __init__(self, mesh, placed: Strategy):
        super().__init__(mesh, placed.activations)  # TP's, the batch over data
        self.sequence = Explicit(mesh, placed.sequence)  # the residual stream: T over tensor too
        self.flat_rows = False  # [B, T@tensor] rows do not merge into one split dim

    def constrain(self, x, axes):
        """The residual stream (embedding and block outputs) typed on sequence shards."""
        return (self.sequence if axes == ACTIVATION else super()).constrain(x, axes)

    def enter_tensor_parallel(self, x):
        """f: [B, T@tensor, D] -> [B, T, D]{R:tensor}: TP's reshard, which from sequence shards is
        the all-gather along T (backward: the reduce-scatter of the summed input gradients)."""
        return super().enter_tensor_parallel(x)

    def exit_tensor_parallel(self, x):
        """g: partial sums [B, T, D]{U:tensor} -> [B, T@tensor, D]: the reduce-scatter along T."""
        return jax.sharding.reshard(x, self.sequence.sharding(ACTIVATION))


def parallelism(mesh, run) -> SequenceParallel:
    return SequenceParallel(mesh, run.placed)
