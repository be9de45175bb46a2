"""Pipeline parallelism with FSDP inside each stage, GSPMD twin: pp's stage loop
(auto_parallel/pp.py GSPMDPipeline) on a `stage` x `data` mesh with fsdp's tables.

Placement: pp's `layers -> stage` plus fsdp's `embed -> data` and `batch -> data`.
Stage s holds its L/S layers, each matrix a 1/data slice of its d_model dim
(W1: [L/S, D/data, F] per device); embedding and lm_head are replicated over
`stage` and sharded over `data` like fsdp's ([V, D/data], [D/data, V]); norm gains
replicated. The batch is split over `data`, then each data shard's B/data rows into
M micro-batches: the stage buffers are [S, B/M, T, D] placed P('stage', 'data').
The stages run under `vmap(..., spmd_axis_name='stage')`, so the GSPMD hooks inside
a stage (the weight pin that gathers each layer's weights, the batch constraint on
the residual stream) keep `stage` on the vmapped dim.

Measured (tiny, L=4, stage:2,data:2, M=4, XLA:CPU; tests/test_pipeline.py):
  collective-permutes over stage: pp's, 1 per tick forward and 2 backward, each one
    micro-batch of one data shard [1, B/(data M), T, D], + 2 outside the tick loop.
  all-gathers over data: 9, ONCE per step, before the tick loop: each stage's 7 matrix
    leaves whole ([L/S, D, ...]: XLA hoists the per-layer weight pin out of the layer scan
    and out of the tick loop), the embedding and the lm_head. Nothing is re-gathered in
    the backward pass (GSPMD keeps the gathered weights, as fsdp under --remat=none).
  all-reduces over data: every weight gradient of the stage per layer AND per tick in the
    backward tick loop (7 L/S (M + S - 1) matrices, XLA:CPU's form of reduce-scatter, + the
    norm gains 2 L/S (M + S - 1)), the embedding, lm_head and ln_final gradients once, the
    global norm's partials, the loss.
The manual twin gathers once per step too (FSDP's gather_step) and reduce-scatters each
accumulated gradient once after the tick loop (manual_parallel/pp_fsdp.py): the same 9
gathers; GSPMD reduces the gradients per tick instead.
"""

from auto_parallel.pp import GSPMDPipeline
from twinshard.parallel.strategies import PP_FSDP


def parallelism(mesh, cfg) -> GSPMDPipeline:
    """pp's GPipe loop with fsdp's activation rules (the stage functions run with GSPMD hooks)."""
    return GSPMDPipeline(mesh, PP_FSDP.activations, cfg.train.microbatches)
