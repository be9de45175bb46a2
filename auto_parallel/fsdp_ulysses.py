"""FSDP + all-to-all sequence parallelism, GSPMD twin: FSDP's weight pins over `data`
(auto_parallel/fsdp.py) and ulysses's head-shard pins in attention over `context`
(auto_parallel/ulysses.py), the batch over `data`; XLA derives the communication."""

from auto_parallel.fsdp import FullyShardedDataParallel
from auto_parallel.ulysses import UlyssesParallel

__all__ = ["FSDPUlyssesParallel", "parallelism"]


class FSDPUlyssesParallel(FullyShardedDataParallel, UlyssesParallel):
    """weight from FSDP (the pin: the all-gather over `data`); attention from ulysses."""


def parallelism(mesh, run) -> FSDPUlyssesParallel:
    return FSDPUlyssesParallel(mesh, run.placed.activations)
