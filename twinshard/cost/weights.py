"""The parameter tree as the cost model sees it, and how each strategy splits it.

`weights(cfg)` lists the weights of `TransformerLM` (notation: twinshard/cost/__init__.py); each
block weight is a scanned leaf [L, ...] whose one-layer slice is:

    kind    weight                   shape        logical axes     count   leaves
    matrix  token_embeddings         [V, D]       (vocab, embed)   1       1
    matrix  attn.q_proj              [D, H*dh]    (embed, heads)   L       1 x [L, D, H*dh]
    matrix  attn.{k,v}_proj          [D, Hkv*dh]  (embed, kv_heads) 2L     2 x [L, D, Hkv*dh]
    matrix  attn.output_proj         [H*dh, D]    (heads, embed)   L       1 x [L, H*dh, D]
    matrix  ffn.{w1,w3}              [D, F]       (embed, mlp)     2L      2 x [L, D, F]
    matrix  ffn.w2                   [F, D]       (mlp, embed)     L       1 x [L, F, D]
    matrix  lm_head                  [D, V]       (embed, vocab)   1       1
    norm    ln1, ln2                 [D]          (norm,)          2L      2 x [L, D]
    norm    ln_final                 [D]          (norm,)          1       1

so 7L + 2 matrices and 2L + 1 norm vectors in 12 leaves (= `ModelConfig.num_params()`).
A mixture of experts (E experts of width F_e) has, in place of the three ffn matrices:

    matrix  ffn.router               [D, E]         (embed, router)          L   1 x [L, D, E] (f32)
    matrix  ffn.{w1,w3}              [E, D, F_e]    (experts, embed, mlp)    2L  2 x [L, E, D, F_e]
    matrix  ffn.w2                   [E, F_e, D]    (experts, mlp, embed)    L   1 x [L, E, F_e, D]
With first_dense_layers > 0 each block weight is two groups, one per stack (ModelConfig.stacks).
`RULES` maps each logical axis to the mesh axis a strategy splits it over.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from twinshard.config import ModelConfig
from twinshard.parallel import strategies
from twinshard.parallel.mesh import axis_size
from twinshard.parallel.strategies import KV_HEADS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # ModelConfig.dtype -> bytes per element
F32 = 4  # bytes of the loss, the squared-norm scalar and the cross-entropy statistics

# logical axis -> mesh axis of everything each strategy splits (its declaration's tables).
RULES: dict[str, dict[str, str]] = {s.name: s.split_rules for s in strategies.DECLARATIONS}


def rules(strategy: str, cfg: ModelConfig, mesh: Mapping[str, int]) -> dict[str, str]:
    """RULES[strategy] for this model on this mesh, without kv_heads where tensor exceeds the kv heads."""
    return strategies.get(strategy).placed(cfg.kv_heads, mesh).split_rules


def used_shards(cfg: ModelConfig, w: Weight, t: int) -> int:
    """Column pieces Megatron over t devices cuts w into where used: t, or min(t, Hkv) for k and v."""
    return min(t, cfg.kv_heads) if KV_HEADS in w.axes else t


def local_bytes(cfg: ModelConfig, w: Weight, mesh: Mapping[str, int], t: int, s: int) -> int:
    """Bytes of one device's piece of one layer's weight w where it is used (FSDP's gathered value)."""
    if not w.is_matrix:
        return w.size * s
    experts = mesh.get("expert", 1) if w.is_experts else 1
    return w.size * (F32 if w.float32 else s) // (used_shards(cfg, w, t) * experts)


def kv_replicated(cfg: ModelConfig, mesh: Mapping[str, int]) -> bool:
    """The k/v weights are replicated over a `tensor` axis larger than the kv heads."""
    return cfg.kv_heads % mesh.get("tensor", 1) != 0


@dataclass(frozen=True)
class Weight:
    """A group of identical per-layer weights (e.g. the 2L k/v projections): `count` per forward
    pass; a `stacked` group lives in `leaves` parameter leaves [layers, *shape]."""

    name: str
    shape: tuple[int, ...]  # one layer's weight
    axes: tuple[str, ...]  # its logical axes
    count: int
    layers: int = 1  # n, the depth of its stack, for the stacked block params; 1 otherwise
    stacked: bool = False  # a block weight: `leaves` leaves [n, *shape] (a stack of one is [1, ...])
    float32: bool = False  # used in float32 whatever the compute dtype (the router)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def leaves(self) -> int:
        """Number of parameter arrays (a stacked leaf holds `layers` weights)."""
        return self.count // self.layers

    @property
    def leaf_shape(self) -> tuple[int, ...]:
        return (self.layers, *self.shape) if self.stacked else self.shape

    @property
    def leaf_axes(self) -> tuple[str, ...]:
        return ("layers", *self.axes) if self.stacked else self.axes

    @property
    def is_matrix(self) -> bool:
        """A matrix (or a stack of E experts' matrices), as opposed to a norm gain vector."""
        return len(self.shape) >= 2

    @property
    def is_experts(self) -> bool:
        return "experts" in self.axes


def weights(cfg: ModelConfig) -> list[Weight]:
    """The weights of `TransformerLM`, one group per stack of ModelConfig.stacks."""
    v, d = cfg.padded_vocab_size, cfg.d_model
    blocks = [_block_weights(stack, "" if name == "layers" else f"{name}.") for name, stack in cfg.stacks]
    return [
        Weight("token_embeddings", (v, d), ("vocab", "embed"), 1),
        *(w for stack in blocks for w in stack if w.is_matrix),
        Weight("lm_head", (d, v), ("embed", "vocab"), 1),
        *(w for stack in blocks for w in stack if not w.is_matrix),
        Weight("ln_final", (d,), ("norm",), 1),
    ]


def _block_weights(stack: ModelConfig, prefix: str) -> list[Weight]:
    """One stack's weights (stack.num_layers of its identical layers), names after `prefix`."""
    d, f, hd, n = stack.d_model, stack.d_ff, stack.num_heads * stack.head_dim, stack.num_layers
    attn = [Weight("attn.q_proj", (d, hd), ("embed", "heads"), n, layers=n),
            Weight("attn.{k,v}_proj", (d, stack.kv_dim), ("embed", KV_HEADS), 2 * n, layers=n),
            Weight("attn.output_proj", (hd, d), ("heads", "embed"), n, layers=n)]
    if stack.num_experts:
        e, fe = stack.num_experts, stack.expert_ff
        ffn = [Weight("ffn.router", (d, e), ("embed", "router"), n, layers=n, float32=True),
               Weight("ffn.{w1,w3}", (e, d, fe), ("experts", "embed", "mlp"), 2 * n, layers=n),
               Weight("ffn.w2", (e, fe, d), ("experts", "mlp", "embed"), n, layers=n)]
    else:
        ffn = [Weight("ffn.{w1,w3}", (d, f), ("embed", "mlp"), 2 * n, layers=n),
               Weight("ffn.w2", (f, d), ("mlp", "embed"), n, layers=n)]
    norms = [Weight("ln1, ln2", (d,), ("norm",), 2 * n, layers=n)]
    return [dataclasses.replace(w, name=prefix + w.name, stacked=True) for w in attn + ffn + norms]


def shard_count(w: Weight, rules: Mapping[str, str], mesh: Mapping[str, int]) -> int:
    return math.prod(axis_size(mesh, rules[a]) for a in w.leaf_axes if a in rules)


def layers_held(w: Weight, stages: int = 1) -> int:
    """How many of w's layers one device holds: L/S under `stages` pipeline stages, 1 if not stacked."""
    return w.layers // stages if w.stacked else 1


def leaf_label(w: Weight, stages: int = 1) -> str:
    """w's parameter leaf, "[L, D, F]"; on one of `stages` pipeline stages "[L/S, D, F]"."""
    return "[" + ",".join(str(n) for n in ((layers_held(w, stages), *w.shape) if w.stacked else w.shape)) + "]"


def shape_label(w: Weight, tensor_shards: int) -> str:
    return "[" + ",".join(str(n) for n in w.shape) + "]" + (f"/{tensor_shards}" if tensor_shards > 1 else "")
