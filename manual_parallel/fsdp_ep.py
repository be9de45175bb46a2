"""FSDP + expert parallelism, shard_map twin: ep's experts over `expert` and batch over
(data, expert), with every weight's d_model dimension (the experts' too) sliced over `data`.

Each hook composes the two strategies: `weight` is FSDP's (all_gather over `data` of each
matrix, the experts' local [E/ep, D/data, F] -> [E/ep, D, F]; reduce-scatter of its gradient),
`dispatch` / `combine` are ep's all_to_alls over `expert`.
Forward, per layer: FSDP's all-gathers over `data`; ep's 2 all_to_alls per MoE layer.
Backward, per layer: FSDP's re-gathers and reduce-scatters over `data`; ep's 2 inverse all_to_alls.
After the backward pass: a pmean over `expert` of each dense matrix's gradient shard (replicated
over `expert`; FSDP's scatter averaged over `data` only), the experts' gradients divided by the
`expert` size (ExpertRunner), one pmean over (data, expert) of each norm gain.
Optimizer: one psum over `data` and one over (data, expert) of the shards' squared norms.
"""

from manual_parallel.ep import ExpertParallel, ExpertRunner
from manual_parallel.fsdp import FullyShardedDataParallel

__all__ = ["FSDPExpertParallel", "Runner", "parallelism"]


class FSDPExpertParallel(FullyShardedDataParallel, ExpertParallel):
    """weight / head / gather_step from FSDP; dispatch / combine from ep; layer_policy both
    (FSDP never saves a gathered weight; ep saves the exchanged buffers)."""


def parallelism(mesh, run) -> FSDPExpertParallel:
    return FSDPExpertParallel(run.placed.params)


Runner = ExpertRunner
