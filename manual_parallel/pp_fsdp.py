"""Pipeline parallelism with FSDP inside each stage, shard_map twin: pp's
PipelineRunner (manual_parallel/pp.py) with FSDP's hooks (manual_parallel/fsdp.py)
on a `stage` x `data` mesh.

The collectives and why: docs/pipelines.md (manual_parallel/pp_fsdp.py)."""

from manual_parallel.fsdp import FullyShardedDataParallel
from manual_parallel.pp import PipelineParallel, PipelineRunner

__all__ = ["FSDPPipelineParallel", "Runner", "parallelism"]


class FSDPPipelineParallel(FullyShardedDataParallel, PipelineParallel):
    """weight / gather_step / resident from FSDP, run by pp's PipelineRunner."""


def parallelism(mesh, run) -> FSDPPipelineParallel:
    return FSDPPipelineParallel(run.placed.params)


Runner = PipelineRunner
