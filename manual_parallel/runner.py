"""The shard_map machinery shared by every manual strategy: the hooks' base class
(`ManualParallelism`, with the remat rule that keeps communication out of recomputation), the
positions of a sequence split over `context` (`SequenceShards`) and the runner (`ManualRunner`).

The collectives and why: docs/design.md (manual_parallel/runner.py)."""

from __future__ import annotations

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from twinshard.model import quantize
from twinshard.model.hooks import Parallelism
from twinshard.model.remat import also_saving
from twinshard.parallel import context, placement
from twinshard.parallel.context import CONTEXT
from twinshard.parallel.resolve import Run
from twinshard.placed import Hooks, PlacedRunner, param_specs
from twinshard.train.optim import Block, BlockMean, make_optimizer
from twinshard.train.trainer import (TrainState, accumulated_value_and_grad, apply_gradients, check_grad_accum,
                                     compiler_options, create_params, logical_axes, loss_fn, stats_fn)

DATA, TENSOR = "data", "tensor"

# Primitives whose output is a forward reduction: an all-reduce (Megatron g, the vocab-parallel
# statistics; `psum_invariant` is the psum of a value invariant over the axis under check_vma)
# or a reduce-scatter (`reduce_scatter`, lax.psum_scatter: sequence parallelism's g).
_REDUCTIONS = frozenset({"psum", "psum_invariant", "pmax", "reduce_scatter"})


def saves_reductions(prim, *_, **params) -> bool:
    """Remat policy: save the output of every forward all-reduce or reduce-scatter, direct or inside
    a custom_vjp of manual_parallel/collectives.py (Megatron's g, `scatter_sequence`), so a
    checkpointed layer never repeats one in its backward pass (docs/memory.md: remat trades FLOPs,
    not communication)."""
    if prim.name == "custom_vjp_call":
        return any(e.primitive.name in _REDUCTIONS for e in params["call_jaxpr"].eqns)
    return prim.name in _REDUCTIONS


class ManualParallelism(Parallelism):
    """Single-device hooks plus the strategy's parameter table (logical -> mesh axis)."""

    # The hooks gather sharded weights before use (FSDP): a step of several micro-batches then
    # gathers each matrix once (`gather_step`) instead of once per micro-batch and layer.
    gathers_weights = False

    def __init__(self, param_rules: Mapping[str, str]):
        self.param_rules = dict(param_rules)

    def layer_policy(self, policy):
        """The layer's policy, plus `saves_reductions`: a checkpointed layer's backward pass
        recomputes matmuls, never a reduction (tp, fsdp_tp: Megatron g; tp_sp: its reduce-scatter,
        but it re-gathers the sequence shards, and under full saves the layer input alone, see
        tp_sp.py; dp and fsdp run no all-reduce in a layer's forward, so for them this adds nothing)."""
        return also_saving(policy, saves_reductions)


class SequenceShards:
    """Hooks of a sequence split over `context` in `layout` (cp: zig-zag or contiguous; ulysses:
    contiguous): the RoPE positions of this device's shard. A mixin before ManualParallelism."""

    layout: str

    def table(self, t_local: int):
        """[C, T/C]: every shard's true positions (T = t_local * C)."""
        c = lax.axis_size(CONTEXT)
        return context.shard_positions(t_local * c, c, self.layout)

    def positions(self, t):
        """This shard's t = T/C positions in the whole sequence."""
        return jnp.asarray(self.table(t))[lax.axis_index(CONTEXT)]


class ManualRunner(PlacedRunner):
    """Runs one strategy as a shard_map program; the interface of trainer.SingleDevice."""

    # The mesh axes that split the tokens: each device's loss is the mean over its own share, so
    # the loss and the gradient of a param replicated over such an axis are averaged over it.
    # cp and fsdp_cp split the sequence over `context` too (manual_parallel/cp.py).
    TOKEN_AXES: tuple[str, ...] = (DATA,)

    def __init__(self, run: Run, parallelism: Hooks):
        cfg, declared, decl = run.cfg, run.declared, run.placed  # decl: the placement tables, for this model
        shapes = jax.eval_shape(functools.partial(create_params, cfg.model, 0))  # whole params
        blocks = jax.tree.map(lambda a, s: Block(a.shape, self.block_mean(s)), shapes,
                              param_specs(cfg, decl.params))
        self.tx = make_optimizer(cfg.train, norm_fn=self.global_norm, blocks=blocks)
        self._place(run, jax.sharding.AxisType.Explicit)
        self.par = parallelism(self.mesh, run)  # the strategy's hooks (manual_parallel/<name>.py)
        check_grad_accum(cfg.train, self.sizes[DATA])
        self.token_axes = placement.active_axes(self.TOKEN_AXES, self.sizes)  # those of size > 1
        # per param, the token axes it is replicated over: its gradient's mean runs over them
        # (dp: data; fsdp: data for the norm gains, none for the matrices; cp: data and context)
        self.replicated_over_tokens = jax.tree.map(
            lambda s: tuple(a for a in self.token_axes if a not in placement.sharded_axes(s)),
            self.param_specs, is_leaf=lambda x: isinstance(x, P))
        # per param, the axes its declaration splits and the model's placement replicates (GQA's
        # replicated kv heads, manual_parallel/tp.py): its gradient is summed over them
        self.summed_over = jax.tree.map(
            lambda d, s: placement.active_axes(tuple(a for a in placement.sharded_axes(d) if a not in placement.sharded_axes(s)),
                                 self.sizes),
            param_specs(cfg, declared.params), self.param_specs, is_leaf=lambda x: isinstance(x, P))
        smap = functools.partial(jax.shard_map, mesh=self.mesh, check_vma=True)
        b = self.batch_spec
        self.train_step = jax.jit(smap(self._train_step, in_specs=(self.state_specs, b, b),
                                       out_specs=(self.state_specs, P())), donate_argnums=0,
                                  compiler_options=compiler_options(cfg.model, self.mesh.devices.flat[0].platform,
                                                                   self.mesh.devices.size))
        self.loss_and_grads = jax.jit(smap(self._loss_and_grads, in_specs=(self.param_specs, b, b),
                                           out_specs=(P(), self.param_specs)))
        self.eval_loss = jax.jit(smap(self._eval_loss, in_specs=(self.param_specs, b, b), out_specs=P()))
        self.router_stats = jax.jit(smap(self._router_stats, in_specs=(self.param_specs, b, b), out_specs=P()))

    # --- inside shard_map: local shards only ---------------------------------

    def _local_loss(self, params, x, y, par=None):
        """Mean loss over this device's tokens with hooks `par` (default: the strategy's). x, y: [B/data, T]."""
        return loss_fn(params, x, y, self.cfg.model, self.par if par is None else par)

    def _loss_and_grads(self, params, x, y):
        """x, y: [B/data, T] (cp: [B/data, T/C], this shard's tokens in the layout's order). The token axes
        are named for --quantization=int8_dw (pipelines too): dW's int8 scales are maxima over every token."""
        with quantize.splitting_tokens(self.token_axes):
            return self._synced_loss_and_grads(params, x, y)

    def _synced_loss_and_grads(self, params, x, y):
        replicated = self.replicated_over_tokens
        params = jax.tree.map(lambda p, axes, summed: lax.pcast(p, axes + summed, to="varying") if axes + summed else p,
                              params, replicated, self.summed_over)
        if self._gathers_once():
            loss, grads = self._gathered_loss_and_grads(params, x, y)
        else:
            loss, grads = self._value_and_grad(params, x, y, self.par)
        return self._mean_loss(loss), self.mean_over_tokens(grads, replicated)

    def _gathers_once(self) -> bool:
        """Hooks that gather their weights (`gathers_weights`) gather them once per step when it runs
        several micro-batches: grad_accum = K > 1 (docs/memory.md; a pipeline: always)."""
        return self.cfg.train.grad_accum > 1 and self.par.gathers_weights

    def _value_and_grad(self, params, x, y, par):
        """(mean loss over this device's tokens, its unsynchronized gradient in `params`' dtypes): K
        micro-batches under lax.scan."""
        local = functools.partial(self._local_loss, par=par)
        return accumulated_value_and_grad(local, params, x, y, self.cfg.train.grad_accum,
                                          sum_dtype=self.cfg.train.grad_accum_dtype)

    def _gather_step(self, params):
        """The strategy's `gather_step`: the params every micro-batch reads (FSDP: each matrix
        whole); its pullback is the once-per-step gradient reduction."""
        return self.par.gather_step(params, logical_axes(self.cfg.model), self.param_specs, self.cfg.model.dtype)

    def _gathered_loss_and_grads(self, params, x, y):
        """Several micro-batches per step: the strategy's `gather_step` once, the micro-batches on its
        output (`resident()` hooks), its pullback once on the accumulated gradient (docs/memory.md).

        x, y: [B/data, T]; W1: [L, D/data, F] -> full [L, D, F] -> grad [L, D/data, F]."""
        full, scatter = jax.vjp(self._gather_step, params)
        # grads: in the gathered dtype (`_value_and_grad`'s rule), scattered in it; the cast's transpose
        # returns float32 master-weight gradients, as without accumulation
        loss, grads = self._value_and_grad(full, x, y, self.par.resident())
        (grads,) = scatter(grads)
        return loss, grads

    def mean_over_tokens(self, grads, replicated):
        """Data-parallel gradient sync: pmean of every gradient over the token axes its param is
        replicated over (`replicated`), summed too over its `summed_over` axes in the same all-reduce."""
        def sync(g, mean, summed):
            if not summed:
                return lax.pmean(g, mean) if mean else g
            total = lax.psum(g, placement.active_axes(mean + summed, self.sizes))
            return total / math.prod(self.sizes[a] for a in mean) if mean else total
        return jax.tree.map(sync, grads, replicated, self.summed_over)

    def _mean_loss(self, loss):
        return lax.pmean(loss, self.token_axes) if self.token_axes else loss

    def global_norm(self, grads) -> jax.Array:
        """sqrt(sum of squares of the full gradient): local partial sums, one psum
        per group of gradients sharded over the same mesh axes."""
        groups: dict[tuple[str, ...], jax.Array] = {}
        for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(self.param_specs, is_leaf=lambda x: isinstance(x, P))):
            axes = placement.active_axes(placement.sharded_axes(s), self.sizes)
            groups[axes] = groups.get(axes, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
        total = sum(lax.psum(sq, axes) if axes else sq for axes, sq in groups.items())
        return jnp.sqrt(total)

    def block_mean(self, spec: P) -> BlockMean:
        """Adafactor's mean over whole rows / columns / params of a param placed as `spec`: the local
        mean, then a `pmean` over the mesh axes that split the reduced dims (fsdp_tp's W1
        [L, D/data, F/tensor]: over F a pmean over `tensor`, over D one over `data`)."""
        def mean(x, dims):
            local = jnp.mean(x, axis=dims, keepdims=True)
            axes = placement.active_axes(placement.sharded_axes(P(*(spec[d] for d in dims))), self.sizes)
            return lax.pmean(local, axes) if axes else local
        return mean

    def _train_step(self, state: TrainState, x, y):
        loss, grads = self._loss_and_grads(state.params, x, y)
        state, metrics = apply_gradients(state, grads, self.tx, self.cfg.train)
        return state, {"loss": loss, **metrics}

    def _router_stats(self, params, x, y):
        """trainer.stats_fn on this device's tokens, then the whole batch's: counts summed and
        losses averaged over the token axes (every device holds whole capacity groups)."""
        loss, stats = stats_fn(params, x, y, self.cfg.model, self.par)
        axes = self.token_axes
        if not axes:
            return loss, stats
        counts = ("tokens_per_expert", "dropped", "assignments")
        return self._mean_loss(loss), {k: lax.psum(v, axes) if k in counts else lax.pmean(v, axes)
                                       for k, v in stats.items()}

    def _eval_loss(self, params, x, y):
        return self._mean_loss(self._local_loss(params, x, y))
