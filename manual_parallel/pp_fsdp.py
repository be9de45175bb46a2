"""Pipeline parallelism with FSDP inside each stage, shard_map twin: pp's
PipelineRunner (manual_parallel/pp.py) with FSDP's hooks (manual_parallel/fsdp.py)
on a `stage` x `data` mesh.

Placement (twinshard/parallel/strategies.py PP_FSDP, as in the GSPMD twin): pp's
`layers -> stage` plus fsdp's `embed -> data` and `batch -> data`. Device (s, j) holds stage s's L/S layers,
each matrix as the j-th 1/data slice of its d_model dim (W1: [L/S, D/data, F]),
and the embedding [V, D/data] and lm_head [D/data, V]: replicated over `stage`,
sharded over `data` as under fsdp (every stage holds 1/data of them; only stage 0 /
S-1 uses them). Norm gains: replicated. x, y: [B/data, T], split into M
micro-batches of B/(data M) rows.

Per device and step, both schedules (GPipe and `--schedule=1f1b`), ManualRunner's
once-per-step gather (`_gathered_loss_and_grads`, fsdp's path under grad_accum) around the
pipeline (pp.py `_value_and_grad`):
  forward:  FullyShardedDataParallel.gather_step: each matrix leaf whole, once, before
            the tick loop (all_gather over data of the 7 stacked [L/S, D/data, ...]
            leaves, the embedding, the lm_head: 9), held in the compute dtype for the step
            (GPipe's tick loop reads a float32 copy: pp.py `_gpipe` says why); the tick
            loop runs on them with `resident()` hooks (no collective in a stage); pp's
            collective-permute over `stage` of one micro-batch [B/(data M), T, D] per tick.
  backward: pp's reverse collective-permute per tick; the gradients accumulate (float32)
            over the ticks, then gather_step's pullback reduce-scatters each leaf's over
            data once (9, / data: the mean); psum over stage of the replicated embedding,
            ln_final and lm_head gradients (embedding and lm_head as their [.., D/data]
            shards); pmean over data of the norm gains (ln1, ln2 [L/S, D], ln_final).
  optimizer: the global norm, one psum per group of gradients sharded alike: over
            (stage, data) the block matrices, over stage ln1/ln2, over data embedding and
            lm_head.
  metrics:  psum over stage of the loss (the last stage's), pmean over data.

Why once per step, not per layer inside the stage's scan (ZeRO-3, fsdp's default):
- GPipe: JAX's partial evaluation of the tick `scan` hoists the forward gathers (loop-invariant)
  out of the tick loop anyway, while the backward re-gathers and reduce-scatters per layer AND
  per tick; and the hoisted gathers and the embedding's gather, unordered, met in XLA:CPU's
  rendezvous in either order per device (every shard_map collective has channel_id 1), a
  segfault or a timeout in some runs (measured, JAX 0.12; `lax.optimization_barrier` did not
  order them).
- 1F1B: the gathers would sit in the schedule's `lax.switch` branches, 3 per weight and
  micro-batch, with a reduce-scatter per micro-batch, and the HLO ledger counts a branch's
  collectives as taken in every tick.
The price: the stage's matrices (and embedding, lm_head) whole (float32 under GPipe, the compute
dtype under 1F1B) and their float32 gradient, for the step: 1/S of what fsdp holds under grad_accum (fsdp.py weighs the same
trade: a pipeline's micro-batches are a gradient accumulation). The GSPMD twin gathers once
per step too (auto_parallel/pp_fsdp.py).
"""

from manual_parallel.fsdp import FullyShardedDataParallel
from manual_parallel.pp import PipelineParallel, PipelineRunner

__all__ = ["FSDPPipelineParallel", "Runner", "parallelism"]


class FSDPPipelineParallel(FullyShardedDataParallel, PipelineParallel):
    """weight / gather_step / resident from FSDP, run by pp's PipelineRunner."""


def parallelism(mesh, run) -> FSDPPipelineParallel:
    return FSDPPipelineParallel(run.placed.params)


Runner = PipelineRunner
