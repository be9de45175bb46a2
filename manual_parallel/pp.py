"""Pipeline parallelism (GPipe), shard_map twin: each device IS one stage and runs
only its own L/S layers; micro-batches travel between stages by `ppermute`.

The collectives and why: docs/pipelines.md (manual_parallel/pp.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from manual_parallel.collectives import shift_to_next_stage, shift_to_previous_stage
from manual_parallel.runner import ManualParallelism, ManualRunner
from twinshard.parallel import pipeline, placement
from twinshard.model import scan_stacked
from twinshard.parallel.pipeline import STAGE
from twinshard.train.trainer import graphdef

__all__ = ["PipelineParallel", "PipelineRunner", "Runner", "parallelism"]


class PipelineParallel(ManualParallelism):
    """No model hooks: a stage runs the single-device layers; `PipelineRunner` runs the stages."""


def parallelism(mesh, run) -> PipelineParallel:
    return PipelineParallel(run.placed.params)


class PipelineRunner(ManualRunner):
    """ManualRunner whose gradients come from the pipeline (GPipe or 1F1B); the step, the
    optimizer and the global norm (one psum over `stage`) are ManualRunner's."""

    def __init__(self, run, parallelism):
        super().__init__(run, parallelism)
        # True for params replicated over `stage` (their gradients are summed over it)
        self.replicated_over_stage = {k: k != "layers" for k in self.param_specs}

    def _loss_and_grads(self, params, x, y):
        """x, y: [B/data, T]. ManualRunner's step, with the params replicated over `stage` (embedding,
        ln_final, lm_head) pcast to varying over it and their gradients psummed over it."""
        rep = self.replicated_over_stage
        params = {k: jax.tree.map(lambda p: lax.pcast(p, STAGE, to="varying"), v) if rep[k] else v
                  for k, v in params.items()}
        loss, grads = super()._loss_and_grads(params, x, y)
        return loss, {k: jax.tree.map(lambda g: lax.psum(g, STAGE), v) if rep[k] else v for k, v in grads.items()}

    def _gathers_once(self) -> bool:
        """pp_fsdp gathers each matrix leaf of its stage once per step, for both schedules (a
        pipeline's micro-batches are a gradient accumulation; docs/pipelines.md says why)."""
        return self.par.gathers_weights

    def _value_and_grad(self, params, x, y, par):
        """The pipeline's (loss, gradient) of this stage's params, with hooks `par` (pp_fsdp: the
        weights ManualRunner gathered once, in the compute dtype, and `resident()` hooks)."""
        if self.cfg.train.schedule == "1f1b":
            return self._one_f_one_b(params, x, y, par)
        return self._gpipe(params, x, y, par)

    def _varying(self, a):
        """a, made varying over the axes the activations differ over: `stage` (pp_fsdp: and `data`)."""
        return lax.pcast(a, (STAGE, *placement.sharded_axes(self.batch_spec)), to="varying")

    def _stage(self, params, tokens, arrived, targets, par):
        """One stage on one micro-batch: (its output [B/M, T, D], its loss: the micro-batch's mean
        token loss on the last stage, 0 elsewhere). Stage 0 embeds `tokens` instead of `arrived`."""
        cfg = self.cfg.model
        model = nnx.merge(graphdef(cfg), params)
        stage, n_stages = lax.axis_index(STAGE), lax.axis_size(STAGE)
        inputs = lax.cond(stage == 0, lambda: model.embed(tokens, par), lambda: arrived)
        out = scan_stacked(nnx.to_pure_dict(nnx.state(model.layers, nnx.Param)), cfg, inputs, par)
        loss = lax.cond(stage == n_stages - 1, lambda o: model.head_loss(o, targets, par),
                        lambda o: self._varying(jnp.zeros((), jnp.float32)), out)
        return out, loss

    def _one_f_one_b(self, params, x, y, par):
        """1F1B by hand (pipeline.one_f_one_b's schedule; docs/pipelines.md): per tick a forward, a
        backward (`jax.vjp` of `_stage` on the saved input, at most S in a ring of S slots) or
        nothing, then 2 collective-permutes of [B/M, T, D]. Gradients accumulate in float32."""
        cfg, m = self.cfg.model, self.cfg.train.microbatches
        stage, n = lax.axis_index(STAGE), lax.axis_size(STAGE)
        kinds, mbs = (jnp.asarray(t, jnp.int32) for t in pipeline.one_f_one_b(m, n))  # [ticks, S]
        xs, ys = x.reshape(m, -1, x.shape[1]), y.reshape(m, -1, y.shape[1])  # [M, B/(data M), T]
        varying = self._varying
        ring = varying(jnp.zeros((n, xs.shape[1], xs.shape[2], cfg.d_model), jnp.dtype(cfg.dtype)))
        nothing = ring[0]
        seed = varying(jnp.asarray(1.0 / m, jnp.float32))  # d(mean over micro-batches)/d(micro-batch loss)

        def forward(i, c):
            saved, inbox_f, inbox_b, grads, loss = c
            out, mb_loss = self._stage(params, xs[i], inbox_f[i % n], ys[i], par)
            return out, nothing, (saved.at[i % n].set(inbox_f[i % n]), inbox_f, inbox_b, grads, loss + mb_loss)

        def backward(i, c):
            saved, inbox_f, inbox_b, grads, loss = c
            _, pullback = jax.vjp(lambda p, a: self._stage(p, xs[i], a, ys[i], par), params, saved[i % n])
            d_params, d_arrived = pullback((inbox_b[i % n], seed))
            grads = jax.tree.map(jnp.add, grads, d_params)
            return nothing, d_arrived, (saved, inbox_f, inbox_b, grads, loss)

        def idle(i, c):
            return nothing, nothing, c

        def tick(c, t):
            i = mbs[t, stage]
            to_next, to_prev, c = lax.switch(kinds[t, stage], (idle, forward, backward), i, c)
            from_prev, from_next = shift_to_next_stage(to_next, STAGE), shift_to_previous_stage(to_prev, STAGE)
            saved, inbox_f, inbox_b, grads, loss = c
            prev, nxt = jnp.maximum(stage - 1, 0), jnp.minimum(stage + 1, n - 1)  # the senders' schedule
            got_f = (stage > 0) & (kinds[t, prev] == pipeline.FORWARD)
            got_b = (stage < n - 1) & (kinds[t, nxt] == pipeline.BACKWARD)
            inbox_f = jnp.where(got_f, inbox_f.at[mbs[t, prev] % n].set(from_prev), inbox_f)
            inbox_b = jnp.where(got_b, inbox_b.at[mbs[t, nxt] % n].set(from_next), inbox_b)
            return (saved, inbox_f, inbox_b, grads, loss), None

        zeros = jax.tree.map(lambda p: varying(jnp.zeros(p.shape, jnp.float32)), params)  # every param varies
        start = (ring, ring, ring, zeros, varying(jnp.zeros((), jnp.float32)))
        (_, _, _, grads, loss), _ = lax.scan(tick, start, jnp.arange(kinds.shape[0]))
        return lax.psum(loss, STAGE) / m, grads

    def _eval_loss(self, params, x, y):
        par = self.par
        if self._gathers_once():  # pp_fsdp: the stage's matrices whole, as for the step
            params, par = self._gather_step(params), par.resident()
        return self._mean_loss(self._pipeline_loss(params, x, y, par))

    def _gpipe(self, params, x, y, par):
        """GPipe: autodiff of the tick loop, on a float32 copy of the weights, since the transposed scan
        carries a loop-invariant's cotangent in its own dtype (measured, JAX 0.12)."""
        f32 = lambda p: jax.tree.map(lambda w: w.astype(jnp.float32), p)  # noqa: E731
        return jax.value_and_grad(lambda p: self._pipeline_loss(f32(p), x, y, par))(params)

    def _pipeline_loss(self, params, x, y, par):
        """Mean loss over this device's rows (pp: the batch), computed by the pipeline; invariant
        over `stage`. x, y: [B/data, T]; micro-batch i is rows [i B/(data M), (i+1) B/(data M))."""
        cfg, m = self.cfg.model, self.cfg.train.microbatches
        model = nnx.merge(graphdef(cfg), params)  # model.layers: this stage's [L/S, ...] slice
        stage, n_stages = lax.axis_index(STAGE), lax.axis_size(STAGE)
        first, last = stage == 0, stage == n_stages - 1
        ys = y.reshape(m, -1, y.shape[1])  # [M, B/(data M), T]
        embedded = model.embed(x, par).reshape(m, -1, *x.shape[1:], cfg.d_model)  # [M, B/(data M), T, D]
        act = embedded.shape[1:]  # one micro-batch's activations [B/(data M), T, D]
        varying = self._varying  # (differs per stage)

        layers = nnx.to_pure_dict(nnx.state(model.layers, nnx.Param))  # this stage's [L/S, ...] params

        def tick(carry, i):
            arrived, finished = carry  # [B/M, T, D] from stage-1; [M, B/M, T, D] on stage S-1
            inputs = jnp.where(first, embedded[jnp.minimum(i, m - 1)], arrived)
            out = scan_stacked(layers, cfg, inputs, par)
            j = i - (n_stages - 1)  # the micro-batch that leaves the last stage at tick i
            done = lax.dynamic_update_index_in_dim(finished, out, jnp.maximum(j, 0), 0)
            finished = jnp.where(last & (j >= 0), done, finished)
            return (shift_to_next_stage(out, STAGE), finished), None

        dtype = jnp.dtype(cfg.dtype)  # the residual stream's (compute) dtype
        start = (varying(jnp.zeros(act, dtype)), varying(jnp.zeros((m, *act), dtype)))
        (_, finished), _ = lax.scan(tick, start, jnp.arange(pipeline.ticks(m, n_stages)))
        flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731  [M, B/M, ...] -> [B, ...]
        loss = lax.cond(last, lambda f: model.head_loss(flat(f), flat(ys), par),
                        lambda f: varying(jnp.zeros((), jnp.float32)), finished)
        return lax.psum(loss, STAGE)  # only stage S-1's is non-zero


Runner = PipelineRunner
