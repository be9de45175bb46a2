"""From a strategy's tables (logical axis -> mesh axis) to PartitionSpecs, and host arrays onto them.

Every twin places its state with these functions (through twinshard/placed.py), so a strategy's
parameter and optimizer-state layout is identical under GSPMD, shard_map and Explicit types.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
from jax.sharding import PartitionSpec as P

from twinshard.config import Config
from twinshard.parallel import mesh as mesh_lib

Rules = Mapping[str, str]


def spec(axes: tuple[str | None, ...], rules: Rules) -> P:
    """Logical axes -> PartitionSpec, e.g. ('embed', 'mlp') with {'embed': 'data'} -> P('data', None)."""
    return P(*(rules.get(a) for a in axes))


ATTENTION_Q = ("batch", "heads", "seq", None)  # q and attention's output [B, h, T, dh]
ATTENTION_KV = ("batch", "kv_heads", "seq", None)  # k, v [B, hk, T, dh]


def check_state_divisible(specs, abstract, sizes: Mapping[str, int]) -> None:
    """Every sharded dim of every state leaf splits evenly over its mesh axes (ValueError naming it)."""
    for (path, a), s in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                            jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        for dim, entry in zip(a.shape, s):
            n = math.prod(sizes[ax] for ax in sharded_axes(P(entry)))
            if dim % n:
                raise ValueError(f"train state {jax.tree_util.keystr(path)} {a.shape} placed {s}: dim {dim} "
                                 f"does not split over {n} devices; choose a mesh whose axes divide it.")


def place_global(x, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array holding the GLOBAL value -> a sharded jax.Array. Each process
    materialises only its addressable shards, so the same call is correct on one
    host and on every host of a pod (batches are a pure function of (seed, step),
    so every process can compute the global batch)."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def logical_dims(cfg: Config) -> dict[str, int]:
    """Sizes of every logical dimension a strategy may split (for divisibility checks)."""
    m = cfg.model
    return {"batch": cfg.train.batch_size, "embed": m.d_model, "heads": m.num_heads, "kv_heads": m.kv_heads,
            "mlp": m.d_ff, "vocab": m.padded_vocab_size, "layers": m.num_layers, "seq": m.context_length,
            "experts": m.num_experts}


def sharded_axes(s: P) -> tuple[str, ...]:
    """Mesh axes a PartitionSpec splits over, e.g. P('data', 'tensor') -> ('data', 'tensor')."""
    out: list[str] = []
    for entry in s:
        out.extend([entry] if isinstance(entry, str) else list(entry or ()))
    return tuple(out)


def active_axes(axes: tuple[str, ...], sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The axes of size > 1 among `axes`, in mesh order (so P('tensor','data') and
    P('data','tensor') gradients share one reduction); a reduction over none moves nothing."""
    return tuple(a for a in mesh_lib.ORDER if a in axes and sizes.get(a, 1) > 1)
