"""FSDP + expert parallelism, GSPMD twin: ep's experts over `expert` and batch over
(data, expert), with every weight's d_model dimension (the experts' too) sliced over `data`.

Each hook composes the two strategies: `weight` is FSDP's pin (the all-gather over `data`, the
reduce-scatter of its gradient), `dispatch` / `combine` are ep's layouts of the capacity buffers.
Backward: FSDP's reduce-scatters over `data`; the dense gradients' all-reduce over `expert`.
Optimizer: small all-reduces for the global norm.
"""

from auto_parallel.ep import ExpertParallel
from auto_parallel.fsdp import FullyShardedDataParallel

__all__ = ["FSDPExpertParallel", "parallelism"]


class FSDPExpertParallel(FullyShardedDataParallel, ExpertParallel):
    """weight from FSDP; dispatch / combine from ep."""


def parallelism(mesh, run) -> FSDPExpertParallel:
    return FSDPExpertParallel(mesh, run.placed.activations)
