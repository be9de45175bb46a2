"""FSDP + Megatron sequence parallelism (fsdp_tp_sp), GSPMD twin: tp_sp's layout over `tensor`
(auto_parallel/tp_sp.py), with every weight's d_model dimension further sliced over `data`
(auto_parallel/fsdp.py); the batch over `data`. MaxText's layout for its largest models.

Per layer, for W1 [D, F] stored as [D/data, F/tensor] and the residual stream x [B/data, T/tensor, D]:

    forward    W1 pinned to [D, F/tensor]            all-gather over data (the weight pin)
               x pinned whole along T                all-gather over tensor [B/data, T, D]
               W2's partial sums to T shards         reduce-scatter over tensor [B/data, T/tensor, D]
    backward   the weight pin again (remat)          all-gather over data
               dW1's transpose of the pin            reduce-scatter over data, to [D/data, F/tensor]
               dx's transpose of the T pins          reduce-scatter / all-gather over tensor

XLA derives each of them from the two tables (Strategy.placed and Strategy.sequence); the manual
twin (manual_parallel/fsdp_tp_sp.py) writes them out. The collectives of each part and why:
docs/design.md (auto_parallel/tp_sp.py) and docs/memory.md (auto_parallel/fsdp.py)."""

from auto_parallel.fsdp import FullyShardedDataParallel
from auto_parallel.tp_sp import SequenceParallel

__all__ = ["FSDPSequenceParallel", "parallelism"]


class FSDPSequenceParallel(FullyShardedDataParallel, SequenceParallel):
    """weight / gather_step from FSDP (the pin: the all-gather over `data`); the residual stream's
    two layouts (T shards between the tensor-parallel regions, whole T inside) from tp_sp."""


def parallelism(mesh, run) -> FSDPSequenceParallel:
    return FSDPSequenceParallel(mesh, run.placed)
