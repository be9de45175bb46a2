"""From a strategy's tables (logical axis -> mesh axis) to PartitionSpecs.

Both twins place the state with these functions, so a strategy's parameter
and optimizer-state layout is identical under GSPMD and shard_map.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import optax
from jax.sharding import PartitionSpec as P

from jax.sharding import NamedSharding

from twinshard import mesh as mesh_lib
from twinshard.config import Config
from twinshard import trainer
from twinshard.trainer import TrainState, init_state, logical_axes

Rules = Mapping[str, str]


def spec(axes: tuple[str | None, ...], rules: Rules) -> P:
    """Logical axes -> PartitionSpec, e.g. ('embed', 'mlp') with {'embed': 'data'} -> P('data', None)."""
    return P(*(rules.get(a) for a in axes))


def param_specs(cfg: Config, rules: Rules):
    """PartitionSpec for every parameter, same tree as the params."""
    return jax.tree.map(lambda ax: spec(ax, rules), logical_axes(cfg.model),
                        is_leaf=lambda x: isinstance(x, tuple))


def state_specs(cfg: Config, tx: optax.GradientTransformation, rules: Rules) -> TrainState:
    """PartitionSpecs of the whole train state: optimizer moments mirror their
    params; counters and scalars are replicated."""
    params = param_specs(cfg, rules)
    opt = optax.tree_map_params(tx, lambda _, s: s, trainer.abstract_state(cfg.model, tx).opt_state, params,
                                transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
    return TrainState(params, opt, P())


def place_global(x, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array holding the GLOBAL value -> a sharded jax.Array. Each process
    materialises only its addressable shards, so the same call is correct on one
    host and on every host of a pod (batches are a pure function of (seed, step),
    so every process can compute the global batch)."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def logical_dims(cfg: Config) -> dict[str, int]:
    """Sizes of every logical dimension a strategy may split (for divisibility checks)."""
    m = cfg.model
    return {"batch": cfg.train.batch_size, "embed": m.d_model, "heads": m.num_heads,
            "mlp": m.d_ff, "vocab": m.padded_vocab_size, "layers": m.num_layers}


def sharded_axes(s: P) -> tuple[str, ...]:
    """Mesh axes a PartitionSpec splits over, e.g. P('data', 'tensor') -> ('data', 'tensor')."""
    out: list[str] = []
    for entry in s:
        out.extend([entry] if isinstance(entry, str) else list(entry or ()))
    return tuple(out)


class PlacedRunner:
    """What both twins' runners share: the mesh, the placed train state and batches.

    A subclass sets `self.tx` (its optimizer) and then calls `_place`; it adds
    the compiled `train_step`, `eval_loss` and `loss_and_grads`.
    """

    tx: optax.GradientTransformation

    def _place(self, cfg: Config, mesh_shape: Mapping[str, int], axis_type, devices,
               param_rules: Rules, activation_rules: Rules) -> None:
        self.cfg, self.sizes = cfg, dict(mesh_shape)
        self.mesh = mesh_lib.make_mesh(mesh_shape, axis_type, devices)
        self.param_specs = param_specs(cfg, param_rules)
        self.state_specs = state_specs(cfg, self.tx, param_rules)
        self.batch_spec = spec(("batch", "seq"), activation_rules)
        self.state_shardings = jax.tree.map(self.named, self.state_specs, is_leaf=lambda x: isinstance(x, P))
        self.batch_sharding = self.named(self.batch_spec)

    def named(self, s: P) -> NamedSharding:
        return NamedSharding(self.mesh, s)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs carrying this strategy's shardings (checkpoint restore target)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            trainer.abstract_state(self.cfg.model, self.tx), self.state_shardings)

    def init_state(self, seed: int) -> TrainState:
        """Created sharded: each device computes only its own shards (no full copy
        anywhere), with the same init function and seed as the single-device run."""
        init = functools.partial(init_state, self.cfg.model, self.tx, seed)
        return jax.jit(init, out_shardings=self.state_shardings)()

    def place_batch(self, x, y):
        return place_global(x, self.batch_sharding), place_global(y, self.batch_sharding)
