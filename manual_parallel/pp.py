"""Pipeline parallelism (GPipe), shard_map twin: each device IS one stage and runs
only its own L/S layers; micro-batches travel between stages by `ppermute`.

The collectives and why: docs/pipelines.md (manual_parallel/pp.py)."""

from __future__ import annotations

import dataclasses

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

    def _chunk(self, layers, chunk):
        """Chunk `chunk`'s rows [c L/(S V), (c+1) L/(S V)) of the stage's layers [L/S, ...] (all of them
        when V = 1): virtual stage c S + s (round_robin.stored_order)."""
        v = self.cfg.train.virtual_stages
        if v == 1:
            return layers
        k = jax.tree.leaves(layers)[0].shape[0] // v
        return jax.tree.map(lambda w: lax.dynamic_slice_in_dim(w, chunk * k, k, 0), layers)

    def _add_to_chunk(self, sums, d_chunk, chunk):
        """sums [L/S, ...] with d_chunk [L/(S V), ...] added into chunk's rows, in place (pipeline_split.add_rows:
        the transpose of `_chunk`'s slice would zero-fill all L/S rows and add them all)."""
        v = self.cfg.train.virtual_stages
        if v == 1:
            return jax.tree.map(lambda s, d: s + d.astype(s.dtype), sums, d_chunk)
        return pipeline_split.add_rows(sums, d_chunk, chunk * (jax.tree.leaves(sums)[0].shape[0] // v))

    def _inputs(self, model, chunk, tokens, arrived, par):
        """What a chunk of this stage works on [B/M, T, D]: virtual stage 0 embeds `tokens`, the others take
        what `arrived`."""
        first = (lax.axis_index(STAGE) == 0) & (chunk == 0)
        return lax.cond(first, lambda: model.embed(tokens, par), lambda: arrived)

    def _stage(self, params, chunk, tokens, arrived, targets, par):
        """One chunk of this stage on one micro-batch: (its output [B/M, T, D], its loss: the
        micro-batch's mean token loss on the last virtual stage, 0 elsewhere). Virtual stage 0
        embeds `tokens` instead of `arrived`."""
        cfg, v = self.cfg.model, self.cfg.train.virtual_stages
        model = nnx.merge(graphdef(cfg), params)
        stage, n_stages = lax.axis_index(STAGE), lax.axis_size(STAGE)
        layers = nnx.to_pure_dict(nnx.state(model.layers, nnx.Param))  # [L/S, ...]
        out = scan_stacked(self._chunk(layers, chunk), cfg, self._inputs(model, chunk, tokens, arrived, par), par)
        loss = lax.cond((stage == n_stages - 1) & (chunk == v - 1), lambda o: model.head_loss(o, targets, par),
                        lambda o: self._varying(jnp.zeros((), jnp.float32)), out)
        return out, loss

    def _backward(self, params, chunk, tokens, arrived, targets, ring_grad, seed, sums, par):
        """A whole backward (1F1B, interleaved) of one chunk on one micro-batch: (the gradient of its input
        [B/M, T, D], `sums` with this chunk's weight gradients added in place). The chunk's forward re-runs
        on its saved input; on the last virtual stage the head's backward (under lax.cond: the other stages
        pass `ring_grad`, what the next virtual stage sent, and the head's sums through) gives the output's
        gradient and adds the ln_final and lm_head gradients; the layers' gradient [L/(S V), ...] is added
        into the chunk's rows; on virtual stage 0 the embedding's is added (lax.cond). Only what the chunk
        applies is differentiated: no zero gradient of the other weights is built and added."""
        cfg = self.cfg.model
        inputs = self._inputs(nnx.merge(graphdef(cfg), params), chunk, tokens, arrived, par)
        chunk_layers = self._chunk(params["layers"], chunk)  # [L/(S V), ...]
        out, pullback = jax.vjp(lambda w, a: scan_stacked(w, cfg, a, par), chunk_layers, inputs)
        head = {k: sums[k] for k in pipeline_split.HEAD}
        d_out, head = self._output_grad(params, chunk, out, targets, ring_grad, seed, head, par)
        d_chunk, d_inputs = pullback(d_out)
        sums = {**sums, **head, "layers": self._add_to_chunk(sums["layers"], d_chunk, chunk)}
        return d_inputs, self._add_embedding_grad(params, chunk, tokens, d_inputs, sums, par)

    def _scheduled(self, params, x, y, par):
        """1F1B, interleaved 1F1B and zb_h1 by hand, from their table (pipeline.build; docs/pipelines.md):
        per tick each device runs its op of the table (lax.switch) or nothing, then 2 collective-permutes
        of [B/M, T, D]: its output on to the next virtual stage, its input's gradient back (with V > 1
        device S-1 sends round to device 0 and back). A backward is `_backward` on the saved input; zb_h1's
        B computes the input's gradient alone and sends it at once, keeping each block matmul's operand and
        output gradient, from which its W later computes the blocks' weight gradient alone
        (manual_parallel/pp_split.py). Rings of slots (pipeline.buffers) hold the arrived inputs, the
        gradients and zb_h1's stashes. Gradients accumulate in float32, each op adding the gradient of only
        the weights it applied, in place (`_backward`)."""
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

        # zb_h1: B and W split (manual_parallel/pp_split.py); a ring slot holds one B's stash for its W
        split = pipeline_split.SplitBackward(self.cfg.model, params["layers"], par, varying, one) \
            if train.schedule in pipeline.SPLIT else None
        no_residuals = split.stash_shapes() if split else []

        # each op: (t, micro-batch, chunk, the rings (read only), gradient sums, loss sum) ->
        # (output to send on, input gradient to send back, residuals to keep, gradient sums, loss sum)
        def forward(t, i, c, rings, sums, loss):
            acts, _, _ = rings
            out, mb_loss = self._stage(params, c, xs[i], acts[act[t, stage]], ys[i], par)
            return out, one, no_residuals, sums, loss + mb_loss

        def backward(t, i, c, rings, sums, loss):
            acts, grads_in, _ = rings
            d_inputs, sums = self._backward(params, c, xs[i], acts[act[t, stage]], ys[i], grads_in[grad[t, stage]],
                                            seed, sums, par)
            return one, d_inputs, no_residuals, sums, loss

        def input_grad(t, i, c, rings, sums, loss):
            acts, grads_in, _ = rings
            inputs = self._inputs(nnx.merge(graphdef(self.cfg.model), params), c, xs[i], acts[act[t, stage]], par)
            head = {k: sums[k] for k in pipeline_split.HEAD}
            d_inputs, stash, head = split.input_grad(inputs, lambda out: self._output_grad(
                params, c, out, ys[i], grads_in[grad[t, stage]], seed, head, par))
            sums = self._add_embedding_grad(params, c, xs[i], d_inputs, {**sums, **head}, par)
            return one, d_inputs, stash, sums, loss

        def weight_grad(t, i, c, rings, sums, loss):
            _, _, stashes = rings
            layers = split.weight_grad([r[res[t, stage]] for r in stashes], sums["layers"])
            return one, one, no_residuals, {**sums, "layers": layers}, loss

        def idle(t, i, c, rings, sums, loss):
            return one, one, no_residuals, sums, loss

        # indexed by the op's kind (pipeline.IDLE ... WEIGHT); a split table has no whole BACKWARD
        branches = (idle, forward, idle, input_grad, weight_grad) if split else (idle, forward, backward)
        wrap = train.virtual_stages > 1  # the last stage's output goes round to stage 0 (and its gradient back)

        def tick(carry, t):
            acts, grads_in, residuals, sums, loss = carry
            to_next, to_prev, new, sums, loss = lax.switch(
                kinds[t, stage], branches, t, mbs[t, stage], chunks[t, stage], (acts, grads_in, residuals), sums, loss)
            # zb_h1's stash written every tick (the spare slot takes the ticks without a B). Written in B's branch
            # alone, the rings passed through lax.switch, XLA:TPU wrote it in place (gpt2_350m, v5e:2x2: 0.96 ms a
            # trip less, 197.3 ms a step against 205.8) but XLA:CPU copies a conditional's every output, and the
            # compiled temporaries grew to 1.45 x the memory model's (S = 4, M = 4, tiny; measured, JAX 0.12)
            residuals = [r.at[keep_at[t, stage]].set(k) for r, k in zip(residuals, new)]
            acts = acts.at[recv_act[t, stage]].set(shift_to_next_stage(to_next, STAGE, wrap))
            grads_in = grads_in.at[recv_grad[t, stage]].set(shift_to_previous_stage(to_prev, STAGE, wrap))
            return (acts, grads_in, residuals, sums, loss), None

        zeros = jax.tree.map(lambda p: varying(jnp.zeros(p.shape, jnp.float32)), params)  # every param varies
        start = (ring(one, buf.sizes["act"]), ring(one, buf.sizes["grad"]),
                 [ring(r, buf.sizes["res"]) for r in no_residuals], zeros, varying(jnp.zeros((), jnp.float32)))
        (_, _, _, sums, loss), _ = lax.scan(tick, start, jnp.arange(sched.ticks))
        return lax.psum(loss, STAGE) / m, sums

    def _output_grad(self, params, chunk, out, targets, ring_grad, seed, head, par):
        """(d loss / d out [B/M, T, D], `head`: the ln_final and lm_head gradient sums). On the last virtual
        stage the head's backward (lax.cond) gives the output's gradient and adds the head's weight gradient
        to `head` in place; the other stages pass `ring_grad`, what the next virtual stage sent, and `head`."""
        cfg, v = self.cfg.model, self.cfg.train.virtual_stages
        last = (lax.axis_index(STAGE) == lax.axis_size(STAGE) - 1) & (chunk == v - 1)

        def head_backward(o, head):
            loss = lambda h, o: nnx.merge(graphdef(cfg), {**params, **h}).head_loss(o, targets, par)  # noqa: E731
            d_head, d_out = jax.vjp(loss, {k: params[k] for k in pipeline_split.HEAD}, o)[1](seed)
            return d_out, jax.tree.map(lambda s, d: s + d.astype(s.dtype), head, d_head)

        return lax.cond(last, head_backward, lambda o, head: (ring_grad, head), out, head)

    def _add_embedding_grad(self, params, chunk, tokens, d_inputs, sums, par):
        """`sums` (the full gradient sums) with, on virtual stage 0, the embedding's gradient [V, D] from its
        output's, d_inputs [B/M, T, D], added (lax.cond: the other stages pass `sums` through). The lookup
        is differentiated in float32 (on the table in float32: the rows it reads are the same values): its
        gradient is then a float32 scatter-add into zeros, which XLA adds into the sum in place (the rows
        of the micro-batch's ids), where the compute dtype's scatter was converted and added over all V rows."""
        first = (lax.axis_index(STAGE) == 0) & (chunk == 0)
        lookup = graphdef(dataclasses.replace(self.cfg.model, dtype="float32"))

        def add(sums):
            embed = lambda e: nnx.merge(lookup, {**params, **e}).embed(tokens, par)  # noqa: E731
            table = {k: jax.tree.map(lambda w: w.astype(jnp.float32), params[k]) for k in pipeline_split.EMBED}
            d = jax.vjp(embed, table)[1](d_inputs.astype(jnp.float32))[0]
            return jax.tree.map(lambda s, g: s + g.astype(s.dtype), sums, d)

        return {**sums, **lax.cond(first, add, lambda e: e, {k: sums[k] for k in pipeline_split.EMBED})}

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
