"""Causal self-attention (Flax NNX), mesh-free: multi-head, or grouped-query with
ModelConfig.num_kv_heads < num_heads. k and v carry their own logical axis `kv_heads`, which
Megatron splits over `tensor` while it divides the kv heads and replicates beyond that
(docs/design.md, grouped-query attention)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from twinshard.config import ModelConfig, rope_on_halves
from twinshard.model import layers, matmuls
from twinshard.model.hooks import SINGLE_DEVICE, Parallelism
from twinshard.model.linear import Linear, use

Array = jax.Array
# The logical axis of each column-parallel output (q, k, v), for the hooks that place them.
QKV_AXES = ("heads", "kv_heads", "kv_heads")
# checkpoint_name of the projections (MaxText's names), for the remat policies that save them
QKV_NAMES = ("query_proj", "key_proj", "value_proj")  # q, k, v after projection, before RoPE
CONTEXT = "context"  # the attention output, heads merged, before output_proj [B, T, h*dh]
OUT_PROJ = "out_proj"  # output_proj's output (after Megatron g under TP) [B, T, D]


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, hd, kv = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.kv_dim
        self.q_proj = Linear(d, hd, ("embed", "heads"), rngs=rngs, dtype=cfg.dtype)
        self.k_proj = Linear(d, kv, ("embed", "kv_heads"), rngs=rngs, dtype=cfg.dtype)
        self.v_proj = Linear(d, kv, ("embed", "kv_heads"), rngs=rngs, dtype=cfg.dtype)
        self.output_proj = Linear(hd, d, ("heads", "embed"), rngs=rngs, dtype=cfg.dtype)
        self.head_dim, self.theta, self.max_len = cfg.head_dim, cfg.rope_theta, cfg.context_length
        self.dtype, self.attention = cfg.dtype, cfg.attention
        self.splash = layers.Splash(cfg.splash_block, cfg.splash_fused_bwd)  # handed down as `block`
        self.heads_layout = cfg.qkv_layout == "heads"

    def weights(self, par: Parallelism = SINGLE_DEVICE) -> tuple[Array, Array, Array, Array]:
        """(wq [D, h*dh], wk, wv [D, hk*dh], wo [h*dh, D]) as the strategy hands them to the math."""
        return tuple(use(m.weight, par, self.dtype) for m in (self.q_proj, self.k_proj, self.v_proj, self.output_proj))

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE,
                 ws: tuple[Array, Array, Array, Array] | None = None) -> Array:
        """x: [B, T, D] -> [B, T, D]; heads are column-parallel, output_proj row-parallel; ws:
        `weights(par)` fetched once for several calls (None: fetched here)."""
        wq, wk, wv, wo = self.weights(par) if ws is None else ws
        attend = functools.partial(par.attention, impl=self.attention, block=self.splash)
        if self.heads_layout:
            return self._in_heads_layout(x, (wq, wk, wv), wo, par, attend)
        # q [B, T, h*dh], k, v [B, T, hk*dh] (h = H/tensor under TP)
        q, k, v = (checkpoint_name(p, n) for p, n in zip(par.column_parallel(x, (wq, wk, wv), QKV_AXES), QKV_NAMES))
        out = layers.attend_heads(q, k, v, par.positions(q.shape[-2]), self.head_dim, self.theta, self.max_len,
                                  attend)  # [B, T, h*dh]
        return checkpoint_name(par.row_parallel(checkpoint_name(out, CONTEXT), wo), OUT_PROJ)

    def _in_heads_layout(self, x: Array, ws: tuple[Array, Array, Array], wo: Array, par: Parallelism, attend) -> Array:
        """ModelConfig.qkv_layout="heads": x [B, T, D] einsummed straight into q [B, h, T, dh], k, v
        [B, hk, T, dh] and the kernel's output straight into out_proj: no transposes around attention.
        Megatron's f and g are the strategy's; its own column / row-parallel matmuls are not run."""
        if type(par).column_parallel is not Parallelism.column_parallel or \
                type(par).row_parallel is not Parallelism.row_parallel:
            raise ValueError(f"ModelConfig.qkv_layout='heads' (--qkv_layout=heads) bypasses the column- and "
                             f"row-parallel matmuls this strategy places itself ({type(par).__name__}); "
                             "pass --qkv_layout=tokens.")
        x = par.enter_tensor_parallel(x)
        # q and k with each head's features as (evens, odds) where rope_on_halves: the same permutation of
        # both leaves every score q.k as it was, and RoPE rotates two contiguous halves; v as is.
        halves = rope_on_halves(self.head_dim)
        permuted = (halves, halves, False)  # q, k, v
        q, k, v = (checkpoint_name(project_heads(x, w, self.head_dim, p), n) for w, n, p in zip(ws, QKV_NAMES, permuted))
        out = layers.attend_rotated(q, k, v, par.positions(x.shape[-2]), self.theta, self.max_len, attend, halves)
        return checkpoint_name(par.exit_tensor_parallel(merge_project(checkpoint_name(out, CONTEXT), wo)),
                               OUT_PROJ)


def project_heads(x: jax.Array, w: jax.Array, head_dim: int, halves: bool = False) -> jax.Array:
    """x [B, T, D] @ w [D, h*dh] straight into the attention kernel's layout [B, h, T, dh] (no transpose
    after the matmul: ModelConfig.qkv_layout="heads"); halves: each head's features in the order
    layers.evens_then_odds, by permuting w's columns ([D, h, dh/2, 2] -> [D, h, 2, dh/2], a weight-sized
    transpose) rather than the [B, h, T, dh] output."""
    d, dh = w.shape[0], head_dim
    w = w.reshape(d, -1, dh)  # [D, h, dh]
    if halves:
        w = w.reshape(d, -1, dh // 2, 2).swapaxes(-1, -2).reshape(d, -1, dh)
    spec = "btd,dhk->bhtk"
    return jnp.einsum(spec, x, w, out_sharding=matmuls.partial_sums(spec, x, w))


def merge_project(o: jax.Array, w: jax.Array) -> jax.Array:
    """o [B, h, T, dh] @ w [h*dh, D] -> [B, T, D], contracting h and dh in one einsum (no transpose before it)."""
    spec, w = "bhtk,hkd->btd", w.reshape(o.shape[1], o.shape[3], w.shape[-1])  # [h, dh, D]
    return jnp.einsum(spec, o, w, out_sharding=matmuls.partial_sums(spec, o, w))
