"""FSDP + expert parallelism, shard_map twin: ep's experts over `expert` and batch over
(data, expert), with every weight's d_model dimension (the experts' too) sliced over `data`.

The collectives and why: docs/experts.md (manual_parallel/fsdp_ep.py)."""

from manual_parallel.ep import ExpertParallel, ExpertRunner
from manual_parallel.fsdp import FullyShardedDataParallel

__all__ = ["FSDPExpertParallel", "Runner", "parallelism"]


class FSDPExpertParallel(FullyShardedDataParallel, ExpertParallel):
    """weight / head / gather_step from FSDP; dispatch / combine from ep; layer_policy both
    (FSDP never saves a gathered weight; ep saves the exchanged buffers)."""


def parallelism(mesh, run) -> FSDPExpertParallel:
    return FSDPExpertParallel(run.placed.params)


Runner = ExpertRunner
