"""FSDP + expert parallelism, GSPMD twin: ep's experts over `expert` and batch over
(data, expert), with every weight's d_model dimension (the experts' too) sliced over `data`.

The collectives and why: docs/experts.md (auto_parallel/fsdp_ep.py)."""

from auto_parallel.ep import ExpertParallel
from auto_parallel.fsdp import FullyShardedDataParallel

__all__ = ["FSDPExpertParallel", "parallelism"]


class FSDPExpertParallel(FullyShardedDataParallel, ExpertParallel):
    """weight from FSDP; dispatch / combine from ep."""


def parallelism(mesh, run) -> FSDPExpertParallel:
    return FSDPExpertParallel(mesh, run.placed.activations)
