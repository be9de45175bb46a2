"""FSDP + context parallelism, GSPMD twin: every weight's d_model dimension sharded over `data`
(FSDP), the batch over `data` and the sequence over `context` (auto_parallel/cp.py).

Placement only (and cp's layout hooks); XLA derives the communication:
Forward: an all-gather over `data` of each weight matrix (7L+2, runner.GSPMD.weight pins the
use layout); cp's all-gathers of K and V over `context`, per layer.
Backward: each weight gradient reduce-scattered over `data` and all-reduced over `context`
(the manual twin's hybrid sharding: params replicated over `context`, manual_parallel/fsdp_cp.py
says why); the transposes of the K/V gathers.
Optimizer: small all-reduces for the global norm.
Measured (tiny, data:2,context:2, XLA:CPU): 16 all-gathers over data (fsdp.py's), 8 all-gathers
of K and V over context (cp.py's), 26 all-reduces over context (cp.py's: dK, dV and the
full-size weight gradients, layer by layer) and 29 over data (fsdp.py's). GSPMD reduces each
weight gradient over context at full size, then over data; the manual twin reduce-scatters
over data first and all-reduces the 1/data shard over context.
grad_accum K > 1 (runner.py: the micro-batches of each data shard under a vmap, with cp's
hooks: `GSPMD.without_batch`). Measured (same mesh, K = 2; tests/test_context.py): the data
collectives once per step - 9 all-gathers (each matrix leaf whole, before the micro-batch
loop) and 22 all-reduces - and the context ones per micro-batch: K x 8 all-gathers of K and V
[B/(data K), H, T, dh] and K x 26 all-reduces, the weight gradients' reduction over context
included (the vmap covers the data shards, not the sequence shards).
"""

from auto_parallel.cp import ContextGSPMD, ContextRunner
from twinshard.parallel.strategies import FSDP_CP

__all__ = ["Runner", "parallelism"]


def parallelism(mesh, cfg) -> ContextGSPMD:
    return ContextGSPMD(mesh, FSDP_CP.activations, cfg.train.cp_layout)


Runner = ContextRunner
