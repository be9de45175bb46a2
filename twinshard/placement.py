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

from twinshard.config import Config
from twinshard.trainer import TrainState, init_state, logical_axes

Rules = Mapping[str, str]


def spec(axes: tuple[str | None, ...], rules: Rules) -> P:
    """Logical axes -> PartitionSpec, e.g. ('embed', 'mlp') with {'embed': 'data'} -> P('data', None)."""
    return P(*(rules.get(a) for a in axes))


def param_specs(cfg: Config, rules: Rules):
    """PartitionSpec for every parameter, same tree as the params."""
    return jax.tree.map(lambda ax: spec(ax, rules), logical_axes(cfg.model),
                        is_leaf=lambda x: isinstance(x, tuple))


def abstract_state(cfg: Config, tx: optax.GradientTransformation) -> TrainState:
    """Shapes and dtypes of the train state (nothing is allocated)."""
    return jax.eval_shape(functools.partial(init_state, cfg.model, tx, 0))


def state_specs(cfg: Config, tx: optax.GradientTransformation, rules: Rules) -> TrainState:
    """PartitionSpecs of the whole train state: optimizer moments mirror their
    params; counters and scalars are replicated."""
    params = param_specs(cfg, rules)
    opt = optax.tree_map_params(tx, lambda _, s: s, abstract_state(cfg, tx).opt_state, params,
                                transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
    return TrainState(params, opt, P())


def logical_dims(cfg: Config) -> dict[str, int]:
    """Sizes of every logical dimension a strategy may split (for divisibility checks)."""
    m = cfg.model
    return {"batch": cfg.train.batch_size, "embed": m.d_model, "heads": m.num_heads,
            "mlp": m.d_ff, "vocab": m.padded_vocab_size}


def sharded_axes(s: P) -> tuple[str, ...]:
    """Mesh axes a PartitionSpec splits over, e.g. P('data', 'tensor') -> ('data', 'tensor')."""
    out: list[str] = []
    for entry in s:
        out.extend([entry] if isinstance(entry, str) else list(entry or ()))
    return tuple(out)
