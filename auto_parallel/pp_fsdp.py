"""Pipeline parallelism with FSDP inside each stage, GSPMD twin: pp's stage loop
(auto_parallel/pp.py PipelineParallel) on a `stage` x `data` mesh with fsdp's placement.

Placement (twinshard/parallel/strategies.py PP_FSDP): pp's `layers -> stage` plus fsdp's
`embed -> data` and `batch -> data`. Stage s holds its L/S layers, each matrix a 1/data
slice of its d_model dim (W1: [L/S, D/data, F] per device); embedding and lm_head are
replicated over `stage` and sharded over `data` like fsdp's ([V, D/data], [D/data, V]);
norm gains replicated. The batch is split over `data`, then each data shard's B/data rows
into M micro-batches: the stage buffers are [S, B/M, T, D] placed P('stage', 'data').
The stages run under `vmap(..., spmd_axis_name='stage')`, so the GSPMD hooks inside
a stage (the weight pin that gathers each layer's weights, the batch constraint on
the residual stream) keep `stage` on the vmapped dim.

Collectives: pp's collective-permutes over `stage`, each one micro-batch of one data shard
[1, B/(data M), T, D]. XLA hoists the per-layer weight pin out of the layer scan and the
tick loop, so each stage's weights are all-gathered over `data` ONCE per step and never
re-gathered in the backward pass (GSPMD keeps them, as fsdp under --remat=none). GSPMD
reduces every weight gradient over `data` per layer AND per tick in the backward tick loop;
the manual twin gathers once per step too (FSDP's gather_step) but reduce-scatters each
accumulated gradient once after the tick loop (manual_parallel/pp_fsdp.py).
tests/test_pipeline.py (test_pp_fsdp_auto_shifts_per_tick_and_gathers_each_stage_once)
asserts them.
"""

from auto_parallel.fsdp import FullyShardedDataParallel
from auto_parallel.pp import PipelineParallel

__all__ = ["FSDPPipelineParallel", "parallelism"]


class FSDPPipelineParallel(FullyShardedDataParallel, PipelineParallel):
    """weight from FSDP (each stage's layers pinned whole over `data`); layer_stack from pp."""


def parallelism(mesh, run) -> FSDPPipelineParallel:
    return FSDPPipelineParallel(mesh, run.placed.activations, run.cfg.train.microbatches)
