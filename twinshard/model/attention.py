"""Causal self-attention (Flax NNX), mesh-free: multi-head, or grouped-query with
ModelConfig.num_kv_heads < num_heads (1: multi-query).

    attn.q_proj.weight          [D, H*dh]     (embed, heads)
    attn.{k,v}_proj.weight      [D, Hkv*dh]   (embed, kv_heads)
    attn.output_proj.weight     [H*dh, D]     (heads, embed)

Query head i attends with key/value head i // (H/Hkv) (layers.group_heads). Without GQA
(Hkv = H) the tree, the init and the program are the CS336 model's. The key/value projections
carry their own logical axis, `kv_heads`: Megatron splits it over `tensor` while the axis divides
the kv heads, and replicates each kv head over its query-head group's devices beyond that
(twinshard/parallel/strategies.py `Strategy.placed`), so a device's q heads always find their kv
head locally.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from twinshard.config import ModelConfig
from twinshard.model import layers
from twinshard.model.hooks import SINGLE_DEVICE, Parallelism
from twinshard.model.linear import Linear, use

Array = jax.Array
# The logical axis of each column-parallel output (q, k, v), for the hooks that place them.
QKV_AXES = ("heads", "kv_heads", "kv_heads")


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, hd, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.kv_dim
        self.q_proj = Linear(d, hd, ("embed", "heads"), rngs=rngs, dtype=cfg.dtype)
        self.k_proj = Linear(d, kv, ("embed", "kv_heads"), rngs=rngs, dtype=cfg.dtype)
        self.v_proj = Linear(d, kv, ("embed", "kv_heads"), rngs=rngs, dtype=cfg.dtype)
        self.output_proj = Linear(hd, d, ("heads", "embed"), rngs=rngs, dtype=cfg.dtype)
        self.head_dim, self.theta, self.max_len = cfg.head_dim, cfg.rope_theta, cfg.context_length
        self.dtype, self.attention, self.attention_block = cfg.dtype, cfg.attention, cfg.attention_block

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """x: [B, T, D] -> [B, T, D]; heads are column-parallel, output_proj row-parallel.
        (layers.causal_self_attention is the same math on one device, hook-free.)"""
        wq, wk, wv, wo = (use(m.weight, par, self.dtype)
                          for m in (self.q_proj, self.k_proj, self.v_proj, self.output_proj))
        # q [B, T, h*dh], k, v [B, T, hk*dh] (h = H/tensor under TP; hk = Hkv/tensor, or where the
        # tensor axis is larger than Hkv 1 kv head in the manual twin, all Hkv in the GSPMD twin)
        q, k, v = par.column_parallel(x, (wq, wk, wv), QKV_AXES)
        attend = functools.partial(par.attention, impl=self.attention, block=self.attention_block)
        out = layers.attend_heads(q, k, v, par.positions(q.shape[-2]), self.head_dim, self.theta, self.max_len,
                                  attend)
        return par.row_parallel(out, wo)
