"""Pipeline parallelism (GPipe), shard_map twin: each device IS one stage and runs
only its own L/S layers; micro-batches travel between stages by `ppermute`.

Placement (the GSPMD twin's table): the stacked block params [L, ...] are split
over `stage` on their `layers` dim (stage s holds layers [s*L/S, (s+1)*L/S) as
[L/S, ...]); embedding, ln_final and lm_head are replicated over `stage`
(twinshard/pipeline.py says why). The batch is replicated over `stage`.

Per device, M + S - 1 ticks of a `lax.scan` (twinshard/pipeline.py draws them):

    input  = embed(micro-batch i)  if this is stage 0, else what arrived last tick
    output = this stage's L/S layers (model.scan_stacked) on input   [B/M, T, D]
    stage S-1 keeps output as micro-batch i-(S-1)'s final activations
    send output to stage s+1: `shift_to_next_stage` (ppermute; stage S-1 sends nothing)

Forward: M + S - 1 collective-permutes of [B/M, T, D] over `stage`.
Backward (autodiff of the tick loop, GPipe: all forwards, then all backwards;
the activations of all M + S - 1 ticks are saved): the transpose of each
ppermute is the reverse ppermute, stage s+1 -> s, carrying the gradient of the
activations: M + S - 1 more. Then an all-reduce (psum) over `stage` of the
gradients of the replicated embedding, ln_final and lm_head (only stage 0 /
stage S-1 has a non-zero one), and the psum of the loss, which only stage S-1
computes (`lax.cond`: the other stages skip the lm_head and the cross-entropy).
Optimizer: one psum over `stage` of the stage-sharded gradients' squared norms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from auto_parallel.pp import ACTIVATION_RULES, PARAM_RULES  # same placement as the GSPMD twin
from manual_parallel.base import ManualParallelism
from manual_parallel.collectives import shift_to_next_stage
from manual_parallel.runner import ManualRunner
from twinshard import pipeline
from twinshard.model import scan_stacked
from twinshard.pipeline import STAGE
from twinshard.trainer import graphdef

__all__ = ["ACTIVATION_RULES", "PARAM_RULES", "PipelineRunner", "PARALLELISM"]

PARALLELISM = ManualParallelism  # no model hooks: a stage runs the single-device layers


class PipelineRunner(ManualRunner):
    """ManualRunner whose loss is the GPipe tick loop; the step, the optimizer and the
    global norm (one psum over `stage`) are ManualRunner's."""

    def __init__(self, name, strategy, mesh_shape, cfg, devices=None):
        pipeline.check(cfg.model.num_layers, cfg.train.batch_size, mesh_shape[STAGE], cfg.train.microbatches,
                       cfg.train.grad_accum)
        super().__init__(name, strategy, mesh_shape, cfg, devices)
        # True for params replicated over `stage` (their gradients are summed over it)
        self.replicated_over_stage = {k: k != "layers" for k in self.param_specs}

    def _loss_and_grads(self, params, x, y):
        """x, y: [B, T] (the whole batch on every stage)."""
        rep = self.replicated_over_stage
        params = {k: jax.tree.map(lambda p: lax.pcast(p, STAGE, to="varying"), v) if rep[k] else v
                  for k, v in params.items()}  # so autodiff adds no psum over stage of its own
        loss, grads = jax.value_and_grad(self._pipeline_loss)(params, x, y)
        grads = {k: jax.tree.map(lambda g: lax.psum(g, STAGE), v) if rep[k] else v for k, v in grads.items()}
        return loss, grads

    def _eval_loss(self, params, x, y):
        return self._pipeline_loss(params, x, y)

    def _pipeline_loss(self, params, x, y):
        """Mean loss over the batch, computed by the pipeline; invariant over `stage`."""
        cfg, m = self.cfg.model, self.cfg.train.microbatches
        model = nnx.merge(graphdef(cfg), params)  # model.layers: this stage's [L/S, ...] slice
        stage, n_stages = lax.axis_index(STAGE), lax.axis_size(STAGE)
        first, last = stage == 0, stage == n_stages - 1
        xs, ys = x.reshape(m, -1, x.shape[1]), y.reshape(m, -1, y.shape[1])  # [M, B/M, T]
        act = (xs.shape[1], xs.shape[2], cfg.d_model)  # one micro-batch's activations [B/M, T, D]
        varying = lambda a: lax.pcast(a, STAGE, to="varying")  # noqa: E731  (differs per stage)

        def tick(carry, i):
            arrived, finished = carry  # [B/M, T, D] from stage-1; [M, B/M, T, D] on stage S-1
            inputs = jnp.where(first, model.embed(xs[jnp.minimum(i, m - 1)]), arrived)
            out = scan_stacked(nnx.to_pure_dict(nnx.state(model.layers, nnx.Param)), cfg, inputs)
            j = i - (n_stages - 1)  # the micro-batch that leaves the last stage at tick i
            done = lax.dynamic_update_index_in_dim(finished, out, jnp.maximum(j, 0), 0)
            finished = jnp.where(last & (j >= 0), done, finished)
            return (shift_to_next_stage(out, STAGE), finished), None

        dtype = jnp.dtype(cfg.dtype)  # the residual stream's (compute) dtype
        start = (varying(jnp.zeros(act, dtype)), varying(jnp.zeros((m, *act), dtype)))
        (_, finished), _ = lax.scan(tick, start, jnp.arange(pipeline.ticks(m, n_stages)))
        flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731  [M, B/M, ...] -> [B, ...]
        loss = lax.cond(last, lambda f: model.head_loss(flat(f), flat(ys)),
                        lambda f: varying(jnp.zeros((), jnp.float32)), finished)
        return lax.psum(loss, STAGE)  # only stage S-1's is non-zero
