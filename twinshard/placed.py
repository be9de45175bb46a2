"""What the twins' runners share: a run's train state placed on its mesh (`PlacedRunner`), the
global-array step of the GSPMD and explicit twins (`GlobalRunner`), the PartitionSpecs of the
params and optimizer state, and the splash kernel in a shard_map (`sharded_attention`).

Every twin places its state with these functions, so a strategy's parameter and optimizer-state
layout is identical under GSPMD, shard_map and Explicit types. A runner is built from a resolved
run (twinshard/parallel/resolve.py) and its strategy's hooks factory, `parallelism(mesh, run)` of
<twin>_parallel/<strategy>.py, which the twin's package hands over (its `runner_of`).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from twinshard.config import Config
from twinshard.model import layers
from twinshard.model.hooks import Parallelism
from twinshard.parallel import mesh as mesh_lib, round_robin
from twinshard.parallel.pipeline import STAGE
from twinshard.parallel.placement import (ATTENTION_KV, ATTENTION_Q, Rules, check_state_divisible, place_global,
                                          spec)
from twinshard.parallel.resolve import Run
from twinshard.train import optim, trainer
from twinshard.train.trainer import TrainState, init_state, logical_axes

# A strategy's hooks for a resolved run on its mesh: `parallelism` of <twin>_parallel/<strategy>.py
Hooks = Callable[[jax.sharding.Mesh, Run], Parallelism]


def sharded_attention(mesh: jax.sharding.Mesh, rules: Rules, q, k, v, impl: str = "auto", block: int = 0):
    """Causal attention of q [B, H, T, dh], k, v [B, Hkv, T, dh] placed by `rules` on `mesh` (the
    GSPMD and Explicit twins' `attention` hook). The splash kernel is a Pallas call that XLA's
    partitioner cannot split, so it runs in a shard_map over the mesh: each device its batch rows
    and heads as `rules` place them, as in the manual twin (MaxText does the same). Where the kv
    heads are replicated over a tensor axis larger than them (Strategy.placed) a device takes
    its query heads' one kv head. Every other kernel runs on the global arrays. The sequence must
    not be split (cp's hooks run their own attention)."""
    if layers.attention_kernel(impl, q.dtype) != "splash":
        return layers.causal_attention(q, k, v, impl, block=block)
    if rules.get("seq") is not None:
        raise ValueError(f"splash attention runs on whole sequences; the sequence is split over {rules['seq']}")
    heads_axis = rules.get("heads")
    replicated_kv = heads_axis is not None and rules.get("kv_heads") is None and mesh.shape[heads_axis] > 1

    def local(q, k, v):  # q: [B/data, H/tensor, T, dh]; k, v: [B/data, Hkv/tensor (or Hkv), T, dh]
        if replicated_kv:  # tensor = Hkv x group devices: this device's kv head is its index // group
            group = mesh.shape[heads_axis] // k.shape[1]
            at = jax.lax.axis_index(heads_axis) // group
            k, v = (jax.lax.dynamic_slice_in_dim(x, at, 1, axis=1) for x in (k, v))
        return layers.splash_attention(q, k, v, block)

    q_spec, kv_spec = spec(ATTENTION_Q, rules), spec(ATTENTION_KV, rules)
    # check_vma=False: the kernel's output shapes carry no varying axes (layers._unchecked). Its
    # transpose then sums an input's cotangent over every manual axis the input is not split over
    # (the replicated kv heads' over tensor), so the axes of size 1 stay out: a sum over each was
    # an all-reduce of one device per q, k and v per layer (measured, JAX 0.12). An Explicit mesh
    # keeps them: Pallas' interpret mode fails on arrays typed over an Explicit axis left outside. So
    # does a TPU: a Mosaic kernel under an axis left to the partitioner, even of size 1, fails to
    # lower ("Mosaic kernels cannot be automatically partitioned", measured, v5e:4x4 data:16).
    on_tpu = layers.target_backend() == "tpu"
    manual = frozenset(a for a in mesh.axis_names if mesh.shape[a] > 1 or mesh.explicit_axes or on_tpu)
    if not manual:
        return local(q, k, v)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         axis_names=manual, check_vma=False)(q, k, v)


def param_specs(cfg: Config, rules: Rules):
    """PartitionSpec for every parameter, same tree as the params."""
    return _specs(logical_axes(cfg.model), rules)


def _specs(axes, rules: Rules):
    return jax.tree.map(lambda ax: spec(ax, rules), axes, is_leaf=lambda x: isinstance(x, tuple))


def state_specs(cfg: Config, tx: optax.GradientTransformation, rules: Rules) -> TrainState:
    """PartitionSpecs of the whole train state, the same for both twins.

    Each optimizer leaf that belongs to a param keeps some of the param's dims
    (`optim.kept_dims`: AdamW's mu/nu, Lion's mu, SGD's trace and Adafactor's
    unfactored v keep all; Adafactor's v_row / v_col drop one of the two largest
    dims; its (1,) placeholders keep none) and is placed by those dims' logical
    axes: e.g. fsdp_tp's W1 [L, D, F] is P(None, 'data', 'tensor'), its v_row
    [L, D] P(None, 'data') and its v_col [L, F] P(None, 'tensor'). Counters and
    scalars are replicated.
    """
    axes = logical_axes(cfg.model)
    abstract = trainer.abstract_state(cfg.model, tx)
    shapes = jax.tree.map(lambda a: a.shape, abstract.params)
    leaves = jax.tree_util.tree_map_with_path(_StateLeaf, abstract.opt_state)
    opt = optax.tree_map_params(tx, functools.partial(_leaf_spec, rules=rules), leaves, axes, shapes,
                                transform_non_params=lambda _: P())
    return TrainState(_specs(axes, rules), opt, P())


class _StateLeaf:
    """An abstract optimizer-state leaf with its path (a pytree leaf, not a node)."""

    def __init__(self, path, leaf: jax.ShapeDtypeStruct):
        self.path, self.shape = path, tuple(leaf.shape)

    @property
    def field(self) -> str | None:
        """The innermost NamedTuple field above the leaf (e.g. 'v_row', 'mu')."""
        names = [k.name for k in self.path if isinstance(k, jax.tree_util.GetAttrKey)]
        return names[-1] if names else None


def _leaf_spec(leaf: _StateLeaf, axes: tuple[str | None, ...], param_shape: tuple[int, ...],
               rules: Rules) -> P:
    """The spec of an optimizer leaf of a param with logical `axes`: its kept dims' axes."""
    dims = optim.kept_dims(leaf.field, param_shape)
    where = jax.tree_util.keystr(leaf.path)
    if dims is None:
        if leaf.shape != (1,):
            raise ValueError(f"optimizer state {where}: expected a (1,) placeholder, got {leaf.shape}")
        return P()
    if leaf.shape != tuple(param_shape[d] for d in dims):
        raise ValueError(f"optimizer state {where} has shape {leaf.shape}, but keeps dims {dims} of its "
                         f"param {param_shape}: twinshard.train.optim.kept_dims does not know this optimizer")
    return spec(tuple(axes[d] for d in dims), rules)


class PlacedRunner:
    """What every twin's runner shares: the mesh, the placed train state and batches.

    A subclass sets `self.tx` (its optimizer) and then calls `_place` with its resolved run
    (twinshard/parallel/resolve.py); it adds the compiled `train_step`, `eval_loss` and `loss_and_grads`.
    """

    tx: optax.GradientTransformation

    def _place(self, run: Run, axis_type) -> None:
        """The mesh and the placed state and batch of `run` (a resolve.Run): its placed tables."""
        self.run, self.name, self.cfg, self.sizes = run, run.strategy, run.cfg, dict(run.mesh)
        cfg, param_rules, activation_rules = run.cfg, run.placed.params, run.placed.activations
        self.mesh = mesh_lib.make_mesh(run.mesh, axis_type, run.devices)
        self.param_specs = param_specs(cfg, param_rules)
        self.state_specs = state_specs(cfg, self.tx, param_rules)
        check_state_divisible(self.state_specs, trainer.abstract_state(cfg.model, self.tx), self.sizes)
        # a size-1 axis splits nothing: tp_sp's batch rule (batch -> data) on a tensor-only mesh
        # would make shard_map's tokens, and so the loss, "varying" over a data axis of 1
        used = {k: a for k, a in ((k, self._split(a)) for k, a in activation_rules.items()) if a is not None}
        self.batch_spec = spec(("batch", "seq"), used)
        self.state_shardings = jax.tree.map(self.named, self.state_specs, is_leaf=lambda x: isinstance(x, P))
        self.batch_sharding = self.named(self.batch_spec)

    def _split(self, axis: str | tuple[str, ...]) -> str | tuple[str, ...] | None:
        """A table's mesh axis (or tuple of axes: ep's batch over data x expert) without the axes
        of size 1; None if nothing is left."""
        kept = tuple(a for a in ((axis,) if isinstance(axis, str) else axis) if self.sizes.get(a, 1) > 1)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    def named(self, s: P) -> NamedSharding:
        return NamedSharding(self.mesh, s)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs carrying this strategy's shardings (checkpoint restore target)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            trainer.abstract_state(self.cfg.model, self.tx), self.state_shardings)

    def init_state(self, seed: int) -> TrainState:
        """Created sharded: each device computes only its own shards (no full copy
        anywhere), with the same init function and seed as the single-device run; the layer
        stacks in this runner's stored order (`to_stored`: an interleaved pipeline's round-robin)."""
        init = lambda key: self.to_stored(init_state(self.cfg.model, self.tx, key))  # noqa: E731
        return jax.jit(init, out_shardings=self.state_shardings)(trainer.init_key(seed))

    def place_batch(self, x, y):
        return place_global(x, self.batch_sharding), place_global(y, self.batch_sharding)

    def layer_order(self) -> tuple[int, int, int]:
        """(L, S, V) of round_robin's placement: an interleaved pipeline (both twins) stores its
        [L, ...] stacks device-major; every other run (S = 1 or V = 1) in the model's order."""
        stages = self.sizes.get(STAGE, 1)
        return self.cfg.model.num_layers, stages, self.cfg.train.virtual_stages if stages > 1 else 1

    def to_model(self, tree):
        """A tree of this runner's (the state, params or their gradients) -> the model's layer order:
        what a checkpoint holds and single device reads (V = 1: `tree` itself)."""
        return round_robin.to_model(tree, *self.layer_order())

    def to_stored(self, tree):
        """A tree in the model's layer order (a restored checkpoint) -> this runner's (`to_model`'s inverse)."""
        return round_robin.to_stored(tree, *self.layer_order())


class GlobalRunner(PlacedRunner):
    """What the GSPMD and explicit runners share: the single-device step on global arrays, jitted
    with the placed shardings. A subclass names its mesh's `AXIS_TYPE`, may replace `optimizer`,
    and writes `_loss_and_grads` (the step's gradient)."""

    AXIS_TYPE: jax.sharding.AxisType

    def __init__(self, run: Run, parallelism: Hooks, tx: optax.GradientTransformation | None = None):
        """`parallelism`: the strategy's hooks factory. `tx` replaces the optimizer of `cfg.train` (tests
        pass SGD); its state must be a `GuardState` (wrap it in `optim.clip_and_guard`), as
        `trainer.apply_gradients` reads it."""
        cfg = run.cfg
        self.tx = self.optimizer(cfg.train) if tx is None else tx
        self._place(run, self.AXIS_TYPE)
        trainer.check_grad_accum(cfg.train, self.sizes.get("data", 1))
        self.par = par = parallelism(self.mesh, run)
        self.loss = functools.partial(trainer.loss_fn, cfg=cfg.model, par=par)
        step = functools.partial(trainer.train_step, cfg=cfg.model, train_cfg=cfg.train, tx=self.tx, par=par,
                                 value_and_grad=self._loss_and_grads)
        replicated = self.named(P())
        batch_in = (self.state_shardings.params, self.batch_sharding, self.batch_sharding)
        self.train_step = jax.jit(
            step, in_shardings=(self.state_shardings, self.batch_sharding, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated), donate_argnums=0,
            compiler_options=trainer.compiler_options(cfg.model, self.mesh.devices.flat[0].platform,
                                                     self.mesh.devices.size))
        self.eval_loss = jax.jit(self.loss, in_shardings=batch_in, out_shardings=replicated)
        self.router_stats = jax.jit(functools.partial(trainer.stats_fn, cfg=cfg.model, par=par),
                                    in_shardings=batch_in, out_shardings=replicated)
        self.loss_and_grads = jax.jit(self._loss_and_grads, in_shardings=batch_in,
                                      out_shardings=(replicated, self.state_shardings.params))

    def optimizer(self, train_cfg) -> optax.GradientTransformation:
        return optim.make_optimizer(train_cfg)

    def _loss_and_grads(self, params, x, y):
        raise NotImplementedError
