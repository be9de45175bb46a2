"""Pipeline parallelism with FSDP inside each stage, GSPMD twin: pp's stage loop
(auto_parallel/pp.py PipelineParallel) on a `stage` x `data` mesh with fsdp's placement.

The collectives and why: docs/pipelines.md (auto_parallel/pp_fsdp.py)."""

from auto_parallel.fsdp import FullyShardedDataParallel
from auto_parallel.pp import PipelineParallel

__all__ = ["FSDPPipelineParallel", "parallelism"]


class FSDPPipelineParallel(FullyShardedDataParallel, PipelineParallel):
    """weight from FSDP (each stage's layers pinned whole over `data`); layer_stack from pp."""


def parallelism(mesh, run) -> FSDPPipelineParallel:
    return FSDPPipelineParallel(mesh, run.placed.activations, run.cfg.train.microbatches,
                                run.cfg.train.virtual_stages)
