"""The parameter tree as the cost model sees it, and how each strategy splits it.

`weights(cfg)` lists the weights of `TransformerLM` (leaf names as in
twinshard/model/transformer.py), in the notation of the package docstring
(twinshard/cost/__init__.py). The blocks are one stack scanned over L
(model.scan_layers): each block weight is a leaf [L, ...] with logical axes
('layers', ...), and the scan body uses one layer's slice (the shape below):

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

so there are 7L + 2 matrices and 2L + 1 norm vectors in 12 leaves,
N = 2VD + L(2D^2 + 2D Hkv dh + 3DF + 2D) + D parameters (= `ModelConfig.num_params()`; Hkv the
key/value heads, = H and so 4D^2 without grouped-query attention).
A mixture of experts (E experts of width F_e) has, in place of the three ffn matrices:

    matrix  ffn.router               [D, E]         (embed, router)          L   1 x [L, D, E] (f32)
    matrix  ffn.{w1,w3}              [E, D, F_e]    (experts, embed, mlp)    2L  2 x [L, E, D, F_e]
    matrix  ffn.w2                   [E, F_e, D]    (experts, mlp, embed)    L   1 x [L, E, F_e, D]
With K = first_dense_layers > 0 every block weight is two groups, one per stack
(ModelConfig.stacks): `dense_layers.*` of K layers (the dense ffn) and the L - K MoE layers'.
`RULES` maps each logical axis to the mesh axis a strategy splits it over (`rules`: for one model on
one mesh, grouped-query attention's kv heads replicated where the tensor axis is larger); `shard_count`,
`layers_held`, `local_bytes` and the shape labels size a weight's piece on one device.
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
    """RULES[strategy] for this model on this mesh: without kv_heads where the tensor axis is larger
    than the key/value heads, which are then replicated over it (strategies.Strategy.placed)."""
    return strategies.get(strategy).placed(cfg.kv_heads, mesh).split_rules


def used_shards(cfg: ModelConfig, w: Weight, t: int) -> int:
    """Into how many column pieces Megatron over t tensor devices cuts w where it is used: t for
    a head / mlp / vocab-split weight; min(t, Hkv) for grouped-query attention's k and v (Hkv/t
    kv heads per device, or one kv head where the tensor axis is larger: each device slices its
    own from the replicated weight, manual_parallel/tp.py)."""
    return min(t, cfg.kv_heads) if KV_HEADS in w.axes else t


def local_bytes(cfg: ModelConfig, w: Weight, mesh: Mapping[str, int], t: int, s: int) -> int:
    """Bytes of one device's piece of one layer's weight w where it is used (FSDP's gathered value):
    a matrix cut into `used_shards` column pieces over t tensor devices and, for the experts, into
    the `expert` axis's E/ep; a norm gain whole. `s` bytes per element, the router's float32."""
    if not w.is_matrix:
        return w.size * s
    experts = mesh.get("expert", 1) if w.is_experts else 1
    return w.size * (F32 if w.float32 else s) // (used_shards(cfg, w, t) * experts)


def kv_replicated(cfg: ModelConfig, mesh: Mapping[str, int]) -> bool:
    """The k/v weights are replicated over `tensor` by the strategies that split heads over it:
    a tensor axis larger than (a multiple of) the kv heads."""
    return cfg.kv_heads % mesh.get("tensor", 1) != 0


@dataclass(frozen=True)
class Weight:
    """A group of identical per-layer weights (e.g. the 2L k/v projections).

    `count` weights of `shape` are used per forward pass. A `stacked` group
    lives in `count // layers` parameter leaves of shape [layers, *shape] (the
    scanned block stack: e.g. k and v are 2 leaves [L, D, Hkv*dh], q is its
    own group, 1 leaf [L, D, H*dh]); collectives inside the scan body act on
    one layer's weight (`count` of them per step), those on whole gradients on
    one leaf (`leaves` of them).
    """

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
    """The weights of `TransformerLM`, grouped by shape and role (block weights stacked [n, ...],
    one group per stack of ModelConfig.stacks: the first dense layers' named `dense_layers.*`)."""
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
    """How many of w's layers one device holds: L/S of a stacked block weight split over `stages`
    pipeline stages (L without a pipeline), 1 otherwise."""
    return w.layers // stages if w.stacked else 1


def leaf_label(w: Weight, stages: int = 1) -> str:
    """w's parameter leaf, "[L, D, F]"; on one of `stages` pipeline stages "[L/S, D, F]"."""
    return "[" + ",".join(str(n) for n in ((layers_held(w, stages), *w.shape) if w.stacked else w.shape)) + "]"


def shape_label(w: Weight, tensor_shards: int) -> str:
    return "[" + ",".join(str(n) for n in w.shape) + "]" + (f"/{tensor_shards}" if tensor_shards > 1 else "")
