"""Pipeline parallelism (GPipe), shard_map twin: each device IS one stage and runs
only its own L/S layers; micro-batches travel between stages by `ppermute`.

The collectives and why: docs/pipelines.md (manual_parallel/pp.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from manual_parallel import pp_split as pipeline_split
from manual_parallel.collectives import shift_to_next_stage, shift_to_previous_stage
from manual_parallel.runner import ManualParallelism, ManualRunner
from twinshard.parallel import pipeline, placement
from twinshard.model import scan_stacked
from twinshard.model.matmuls import varying_axes
from twinshard.parallel.pipeline import STAGE
from twinshard.train.optim import in_param_dtypes
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
        if self.cfg.train.schedule == "gpipe":
            return self._gpipe(params, x, y, par)
        loss, sums = self._scheduled(params, x, y, par)
        return loss, in_param_dtypes(sums, params)  # the float32 sums in `params`' dtypes, as ManualRunner's

    def _varying(self, a):
        """a, made varying over the axes the activations differ over: `stage` (pp_fsdp: and `data`)
        (those it already varies over left as they are)."""
        axes = tuple(ax for ax in (STAGE, *placement.sharded_axes(self.batch_spec)) if ax not in varying_axes(a))
        return lax.pcast(a, axes, to="varying") if axes else a

    def _stage(self, params, chunk, tokens, arrived, targets, par):
        """One chunk of this stage on one micro-batch: (its output [B/M, T, D], its loss: the
        micro-batch's mean token loss on the last virtual stage, 0 elsewhere). Virtual stage 0
        embeds `tokens` instead of `arrived`. Chunk c, the stage's stored rows [c L/(S V), (c+1) L/(S V)),
        is virtual stage c S + s (round_robin.stored_order)."""
        cfg, v = self.cfg.model, self.cfg.train.virtual_stages
        model = nnx.merge(graphdef(cfg), params)
        stage, n_stages = lax.axis_index(STAGE), lax.axis_size(STAGE)
        inputs = lax.cond((stage == 0) & (chunk == 0), lambda: model.embed(tokens, par), lambda: arrived)
        layers = nnx.to_pure_dict(nnx.state(model.layers, nnx.Param))  # [L/S, ...]
        if v > 1:
            k = cfg.num_layers // (n_stages * v)
            layers = jax.tree.map(lambda w: lax.dynamic_slice_in_dim(w, chunk * k, k, 0), layers)
        out = scan_stacked(layers, cfg, inputs, par)
        loss = lax.cond((stage == n_stages - 1) & (chunk == v - 1), lambda o: model.head_loss(o, targets, par),
                        lambda o: self._varying(jnp.zeros((), jnp.float32)), out)
        return out, loss

    def _scheduled(self, params, x, y, par):
        """1F1B, interleaved 1F1B and zb_h1 by hand, from their table (pipeline.build; docs/pipelines.md):
        per tick each device runs its op of the table (lax.switch) or nothing, then 2 collective-permutes
        of [B/M, T, D]: its output on to the next virtual stage, its input's gradient back (with V > 1
        device S-1 sends round to device 0 and back). A backward is a `jax.vjp` of `_stage` on the saved
        input; zb_h1's B computes the input's gradient alone and sends it at once, keeping each weighted
        op's operand and output gradient, from which its W later computes the weights' gradient alone
        (manual_parallel/pp_split.py). Rings of slots (pipeline.buffers) hold the arrived inputs, the
        gradients and zb_h1's stashes. Gradients accumulate in float32."""
        train, m = self.cfg.train, self.cfg.train.microbatches
        stage, n = lax.axis_index(STAGE), lax.axis_size(STAGE)
        sched = pipeline.build(train.schedule, n, m, train.virtual_stages)
        buf = pipeline.buffers(sched)
        kinds, mbs, chunks = (jnp.asarray(t, jnp.int32) for t in sched.arrays())  # [ticks, S]
        act, grad = jnp.asarray(buf.act, jnp.int32), jnp.asarray(buf.grad, jnp.int32)
        res = jnp.asarray(buf.res, jnp.int32)
        # where each tick's writes go: a ring's last slot (one past pipeline.buffers' sizes) takes the
        # writes of ticks that have none, so each write is one in-place update, not a select of the ring
        into = lambda table, ring: jnp.asarray([[k if k >= 0 else buf.sizes[ring] for k in r] for r in table])  # noqa: E731
        recv_act, recv_grad = into(buf.recv_act, "act"), into(buf.recv_grad, "grad")
        keep_at = into([[r if k == pipeline.INPUT else -1 for k, r in zip(kr, rr)]
                        for kr, rr in zip(sched.arrays()[0], buf.res)], "res")
        xs, ys = x.reshape(m, -1, x.shape[1]), y.reshape(m, -1, y.shape[1])  # [M, B/(data M), T]
        varying = self._varying
        one = varying(jnp.zeros((xs.shape[1], xs.shape[2], self.cfg.model.d_model), jnp.dtype(self.cfg.model.dtype)))
        ring = lambda a, k: jnp.zeros((k + 1, *a.shape), a.dtype) + a[None]  # noqa: E731  k slots + the spare
        seed = varying(jnp.asarray(1.0 / m, jnp.float32))  # d(mean over micro-batches)/d(micro-batch loss)
        last_virtual = lambda c: (stage == n - 1) & (c == train.virtual_stages - 1)  # noqa: E731

        def pullback(p, i, c, saved):
            return jax.vjp(lambda p, a: self._stage(p, c, xs[i], a, ys[i], par), p, saved)[1]

        # zb_h1: B and W split (manual_parallel/pp_split.py); a ring slot holds one B's stash for its W
        split = pipeline_split.SplitBackward(self.cfg.model, params, par, varying, one, xs[0]) \
            if train.schedule in pipeline.SPLIT else None
        no_residuals = split.stash_shapes() if split else []

        def out_grad(t, c, grads_in):
            """The gradient of this op's output: what the next virtual stage sent (0 on the last one)."""
            return jnp.where(last_virtual(c), jnp.zeros_like(one), grads_in[grad[t, stage]])

        def add(grads, d_params):
            return jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads, d_params)

        # each op: (t, micro-batch, chunk, the rings (read only), gradient sums, loss sum) ->
        # (output to send on, input gradient to send back, residuals to keep, gradient sums, loss sum)
        def forward(t, i, c, rings, grads, loss):
            acts, _, _ = rings
            out, mb_loss = self._stage(params, c, xs[i], acts[act[t, stage]], ys[i], par)
            return out, one, no_residuals, grads, loss + mb_loss

        def backward(t, i, c, rings, grads, loss):
            acts, grads_in, _ = rings
            d_params, d_arrived = pullback(params, i, c, acts[act[t, stage]])((out_grad(t, c, grads_in), seed))
            return one, d_arrived, no_residuals, add(grads, d_params), loss

        def input_grad(t, i, c, rings, grads, loss):
            acts, grads_in, _ = rings
            d_arrived, stash = split.input_grad(acts[act[t, stage]], xs[i], ys[i], out_grad(t, c, grads_in), seed,
                                                (stage == 0) & (c == 0), last_virtual(c))
            return one, d_arrived, stash, grads, loss

        def weight_grad(t, i, c, rings, grads, loss):
            _, _, stashes = rings
            d_params = split.weight_grad([r[res[t, stage]] for r in stashes], (stage == 0) & (c == 0), last_virtual(c))
            return one, one, no_residuals, add(grads, d_params), loss

        def idle(t, i, c, rings, grads, loss):
            return one, one, no_residuals, grads, loss

        # indexed by the op's kind (pipeline.IDLE ... WEIGHT); a split table has no whole BACKWARD
        branches = (idle, forward, idle, input_grad, weight_grad) if split else (idle, forward, backward)
        wrap = train.virtual_stages > 1  # the last stage's output goes round to stage 0 (and its gradient back)

        def tick(carry, t):
            acts, grads_in, residuals, grads, loss = carry
            to_next, to_prev, new, grads, loss = lax.switch(
                kinds[t, stage], branches, t, mbs[t, stage], chunks[t, stage], (acts, grads_in, residuals), grads, loss)
            # zb_h1's stash written every tick (the spare slot takes the ticks without a B): writing it in B's
            # branch alone, the ring passed through lax.switch, grew the compiled temporaries from 4.2 to 5.3 MB
            # (S = 4, M = 4, tiny; measured, JAX 0.12): XLA copied the ring through the conditional
            residuals = [r.at[keep_at[t, stage]].set(k) for r, k in zip(residuals, new)]
            acts = acts.at[recv_act[t, stage]].set(shift_to_next_stage(to_next, STAGE, wrap))
            grads_in = grads_in.at[recv_grad[t, stage]].set(shift_to_previous_stage(to_prev, STAGE, wrap))
            return (acts, grads_in, residuals, grads, loss), None

        zeros = jax.tree.map(lambda p: varying(jnp.zeros(p.shape, jnp.float32)), params)  # every param varies
        start = (ring(one, buf.sizes["act"]), ring(one, buf.sizes["grad"]),
                 [ring(r, buf.sizes["res"]) for r in no_residuals], zeros, varying(jnp.zeros((), jnp.float32)))
        (_, _, _, grads, loss), _ = lax.scan(tick, start, jnp.arange(sched.ticks))
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
        over `stage`. x, y: [B/data, T]; micro-batch i is rows [i B/(data M), (i+1) B/(data M)).
        With V > 1 chunks a stage (eval under --schedule=interleaved) V GPipe passes, one per chunk,
        the last stage's finished micro-batches going round to stage 0 between them."""
        cfg, m, v = self.cfg.model, self.cfg.train.microbatches, self.cfg.train.virtual_stages
        model = nnx.merge(graphdef(cfg), params)  # model.layers: this stage's [L/S, ...] slice
        stage, n_stages = lax.axis_index(STAGE), lax.axis_size(STAGE)
        first, last = stage == 0, stage == n_stages - 1
        ys = y.reshape(m, -1, y.shape[1])  # [M, B/(data M), T]
        inputs = model.embed(x, par).reshape(m, -1, *x.shape[1:], cfg.d_model)  # [M, B/(data M), T, D]
        act = inputs.shape[1:]  # one micro-batch's activations [B/(data M), T, D]
        varying = self._varying  # (differs per stage)
        layers = nnx.to_pure_dict(nnx.state(model.layers, nnx.Param))  # this stage's [L/S, ...] params
        k = cfg.num_layers // (n_stages * v)  # a chunk's layers (all L/S when V = 1)

        def gpipe_pass(chunk, inputs):
            """The M micro-batches [M, B/M, T, D] (read on stage 0) through one chunk of every stage:
            the outputs, on stage S-1."""
            def tick(carry, i):
                arrived, finished = carry  # [B/M, T, D] from stage-1; [M, B/M, T, D] on stage S-1
                out = scan_stacked(chunk, cfg, jnp.where(first, inputs[jnp.minimum(i, m - 1)], arrived), par)
                j = i - (n_stages - 1)  # the micro-batch that leaves the last stage at tick i
                done = lax.dynamic_update_index_in_dim(finished, out, jnp.maximum(j, 0), 0)
                finished = jnp.where(last & (j >= 0), done, finished)
                return (shift_to_next_stage(out, STAGE), finished), None

            dtype = jnp.dtype(cfg.dtype)  # the residual stream's (compute) dtype
            start = (varying(jnp.zeros(act, dtype)), varying(jnp.zeros((m, *act), dtype)))
            return lax.scan(tick, start, jnp.arange(pipeline.ticks(m, n_stages)))[0][1]

        for c in range(v):  # chunk c: virtual stage c S + s (round_robin.stored_order)
            finished = gpipe_pass(jax.tree.map(lambda w: w[c * k:(c + 1) * k], layers), inputs)
            if c < v - 1:  # S-1 -> 0: the next chunk's inputs
                inputs = shift_to_next_stage(finished, STAGE, wrap=True)
        flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731  [M, B/M, ...] -> [B, ...]
        loss = lax.cond(last, lambda f: model.head_loss(flat(f), flat(ys), par),
                        lambda f: varying(jnp.zeros((), jnp.float32)), finished)
        return lax.psum(loss, STAGE)  # only stage S-1's is non-zero


Runner = PipelineRunner
