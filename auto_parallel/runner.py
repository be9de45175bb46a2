"""The GSPMD machinery shared by the four auto strategies.

A strategy is two tables (auto_parallel/<strategy>.py): PARAM_RULES and
ACTIVATION_RULES, logical axis -> mesh axis. From them this module builds
NamedShardings for the params, the optimizer state (moments sharded exactly
like their params), the batch, the residual stream and each weight where it is
used (`GSPMD.weight`: the activation rules, so FSDP's shards are gathered and
TP's kept), then jits the single-device train step (twinshard/trainer.py) with
those shardings. XLA's SPMD partitioner inserts every collective.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Mapping

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from twinshard import placement
from twinshard.config import Config
from twinshard.optim import make_optimizer
from twinshard.parallelism import Parallelism
from twinshard.placement import spec
from twinshard.trainer import loss_fn, train_step

Rules = Mapping[str, str]


class GSPMD(Parallelism):
    """Single-device math plus sharding constraints on activations."""

    def __init__(self, mesh: jax.sharding.Mesh, activation_rules: Rules):
        self.mesh, self.rules = mesh, activation_rules

    def constrain(self, x, axes):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec(axes, self.rules)))

    def weight(self, w, axes):
        """Pin the layout a weight is used in: its logical axes under the activation rules.

        Inside the layer scan `w` is one layer's slice of the stacked [L, ...] param
        (e.g. W1 [D/data, F] in FSDP's storage layout), so the pin is per layer: GSPMD
        gathers one layer's weight per loop iteration (measured: a [1, D, F] all-gather
        in the while body, multiplicity L), not the whole stack before the loop.

        FSDP's 'embed' -> 'data' split is absent from those rules, so this is the
        GSPMD form of FSDP's all-gather (and its gradient's reduce-scatter), while
        TP's heads/mlp/vocab splits are kept. Without it GSPMD planned the
        vocab-sharded embedding lookup around the weight instead (all-gathered
        token ids, all-to-all of activations, an involuntary full
        rematerialization in the backward pass; measured in fsdp_tp.py).
        """
        return self.constrain(w, axes)


class AutoRunner(placement.PlacedRunner):
    """Runs one strategy with GSPMD; the interface of trainer.SingleDevice."""

    def __init__(self, name: str, strategy: ModuleType, mesh_shape: Mapping[str, int], cfg: Config,
                 devices=None, tx: optax.GradientTransformation | None = None):
        """`tx` replaces the AdamW of `cfg.train` (tests pass SGD); its state must be a
        `GuardState` (wrap it in `optim.clip_and_guard`), as `trainer.apply_gradients` reads it."""
        self.name = name
        self.tx = make_optimizer(cfg.train) if tx is None else tx
        self._place(cfg, mesh_shape, jax.sharding.AxisType.Auto, devices,
                    strategy.PARAM_RULES, strategy.ACTIVATION_RULES)
        # a pipeline's GSPMD hooks also run the layer stack in stages (auto_parallel/pp.py)
        make_par = getattr(strategy, "parallelism", lambda mesh, _: GSPMD(mesh, strategy.ACTIVATION_RULES))
        par = make_par(self.mesh, cfg)
        step = functools.partial(train_step, cfg=cfg.model, train_cfg=cfg.train, tx=self.tx, par=par)
        replicated = self.named(P())
        self.train_step = jax.jit(
            step, in_shardings=(self.state_shardings, self.batch_sharding, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated), donate_argnums=0)
        loss = functools.partial(loss_fn, cfg=cfg.model, par=par)
        batch_in = (self.state_shardings.params, self.batch_sharding, self.batch_sharding)
        self.eval_loss = jax.jit(loss, in_shardings=batch_in, out_shardings=replicated)
        self.loss_and_grads = jax.jit(jax.value_and_grad(loss), in_shardings=batch_in,
                                      out_shardings=(replicated, self.state_shardings.params))
