"""The decoder-only Transformer LM (Flax NNX), mesh-free: every parameter carries logical axes,
the L blocks are ONE stacked [L, ...] `Block` under jax.lax.scan, and a strategy acts through the
`Parallelism` hooks passed to `__call__`. The parameter tree and its init: docs/design.md.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from twinshard.model import layers, moe, quantize
from twinshard.config import ModelConfig
from twinshard.model.attention import CausalSelfAttention
from twinshard.model.hooks import SINGLE_DEVICE, Parallelism
from twinshard.model.layers import MLP_IN, MLP_OUT
from twinshard.model.loss import chunks_of
from twinshard.model.remat import remat_policy
from twinshard.model.linear import Linear, param as _param, truncated_normal as _truncated_normal, use as _use

Array = jax.Array
ACTIVATION = ("batch", "seq", "embed")  # logical axes of the residual stream [B, T, D]
LOGITS = ("batch", "seq", "vocab")  # [B, T, V_pad]


class Embedding(nnx.Module):
    """Lookup table [V_pad, D], N(0, 1) truncated at +-3; padded rows are zero."""

    def __init__(self, vocab_size: int, padded_vocab: int, d_model: int, *, rngs: nnx.Rngs,
                 dtype: str = "float32"):
        w = jax.random.truncated_normal(rngs.params(), -3.0, 3.0, (padded_vocab, d_model), jnp.float32)
        w = jnp.where(jnp.arange(padded_vocab)[:, None] < vocab_size, w, 0.0)
        self.weight = _param(w, ("vocab", "embed"))
        self.dtype = dtype

    def __call__(self, ids: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """ids: [B, T] -> [B, T, D] in the compute dtype (the residual stream's dtype)."""
        return par.embed(ids, _use(self.weight, par, self.dtype))


class RMSNorm(nnx.Module):
    def __init__(self, d_model: int, eps: float, compute: bool = False):
        self.weight = _param(jnp.ones((d_model,), jnp.float32), ("norm",))
        self.eps, self.compute = eps, compute  # compute: in the compute dtype (ModelConfig.norm_dtype)

    def weights(self, par: Parallelism = SINGLE_DEVICE) -> Array:
        """The gain [D] as the strategy hands it to the math."""
        return _use(self.weight, par)

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE, gain: Array | None = None) -> Array:
        """x: [..., D] -> [..., D]; gain: `weights(par)` fetched once for several calls (None: fetched here)."""
        return layers.rms_norm(x, self.weights(par) if gain is None else gain, self.eps, self.compute)


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype: str = "float32"):
        self.w1 = Linear(d_model, d_ff, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, ("mlp", "embed"), rngs=rngs, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.dtype = dtype

    def weights(self, par: Parallelism = SINGLE_DEVICE) -> tuple[Array, Array, Array]:
        """(w1 [D, F], w2 [F, D], w3 [D, F]) as the strategy hands them to the math (F/tensor under TP)."""
        return tuple(_use(m.weight, par, self.dtype) for m in (self.w1, self.w2, self.w3))

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE,
                 ws: tuple[Array, Array, Array] | None = None) -> Array:
        """x: [B, T, D] -> [B, T, D]; w1/w3 column-parallel, w2 row-parallel; ws: `weights(par)`
        fetched once for several calls (None: fetched here)."""
        w1, w2, w3 = self.weights(par) if ws is None else ws
        h1, h3 = (checkpoint_name(h, n) for h, n in zip(par.column_parallel(x, (w1, w3)), MLP_IN))  # [B, T, F] each
        return checkpoint_name(par.row_parallel(layers.swiglu_gate(h1, h3), w2), MLP_OUT)  # F/tensor under TP


class Experts(nnx.Module):
    """E bias-free linear maps stacked [E, d_in, d_out], each initialised as Linear(d_in, d_out)
    (std sqrt(2 / (d_in + d_out)), truncated at +-3 std), drawn with ONE random call for all E."""

    def __init__(self, num_experts: int, d_in: int, d_out: int, axes: tuple[str, str, str], *,
                 rngs: nnx.Rngs):
        std = math.sqrt(2.0 / (d_in + d_out))
        self.weight = _param(_truncated_normal(rngs.params(), (num_experts, d_in, d_out), std), axes)


class MoEFeedForward(nnx.Module):
    """The mixture-of-experts feed-forward (twinshard/model/moe.py): a float32 router [D, E] and
    E SwiGLU experts; every layer of a model with ModelConfig.num_experts > 0 has one."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, e, f = cfg.d_model, cfg.num_experts, cfg.expert_ff
        self.router = Linear(d, e, ("embed", "router"), rngs=rngs)  # float32: routing on f32 logits
        self.w1 = Experts(e, d, f, ("experts", "embed", "mlp"), rngs=rngs)
        self.w2 = Experts(e, f, d, ("experts", "mlp", "embed"), rngs=rngs)
        self.w3 = Experts(e, d, f, ("experts", "embed", "mlp"), rngs=rngs)
        self.dtype = cfg.dtype
        self.k, self.capacity, self.group = cfg.experts_per_token, cfg.expert_capacity, cfg.moe_group
        self.ragged = cfg.moe_dispatch == "ragged"

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> tuple[Array, moe.Stats]:
        """x: [B, T, D] -> (y [B, T, D], this layer's router stats: moe.moe_ffn, or
        moe.moe_ffn_ragged under ModelConfig.moe_dispatch='ragged')."""
        router = _use(self.router.weight, par)  # [D, E] float32
        # [E', D, F], [E', F, D]: FSDP gathers `embed`; expert parallelism leaves E/ep local experts
        w1, w2, w3 = (_use(m.weight, par, self.dtype) for m in (self.w1, self.w2, self.w3))
        if self.ragged:
            return moe.moe_ffn_ragged(x, router, w1, w2, w3, experts_per_token=self.k, group_size=self.group,
                                      dispatch_rows=par.dispatch_rows, combine_rows=par.combine_rows)
        return moe.moe_ffn(x, router, w1, w2, w3, experts_per_token=self.k, capacity=self.capacity,
                           group_size=self.group, dispatch=par.dispatch, combine=par.combine)


class BlockWeights(NamedTuple):
    """One dense block's weights as the strategy hands them to the math (FSDP: gathered), fetched
    once when the block runs its batch in chunks (ModelConfig.tp_overlap_chunks); None: fetched at use."""
    ln1: Array | None = None
    attn: tuple[Array, ...] | None = None
    ln2: Array | None = None
    ffn: tuple[Array, ...] | None = None


class Block(nnx.Module):
    """Pre-norm block: x + attn(ln1(x)), then + ffn(ln2(.)). With experts (cfg.num_experts > 0)
    the ffn is MoEFeedForward and the block returns (x, its router stats)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        compute = cfg.norm_dtype == "compute"
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps, compute)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps, compute)
        if cfg.num_experts:
            self.ffn = MoEFeedForward(cfg, rngs=rngs)
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.d_ff, rngs=rngs, dtype=cfg.dtype)
        self.quantization = cfg.quantization  # the projections' (twinshard/model/quantize.py)

    def quantized(self):
        """The projections' quantization for the block's matmuls (twinshard/model/quantize.py)."""
        return quantize.quantizing(self.quantization)

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array | tuple[Array, moe.Stats]:
        with self.quantized():
            if isinstance(self.ffn, MoEFeedForward):
                x = self.attend(x, par)
                y, stats = self.ffn(self.ln2(x, par), par)
                return par.constrain(x + y, ACTIVATION), stats
            return self.dense(x, par)

    def chunks(self, xs: tuple[Array, ...], par: Parallelism = SINGLE_DEVICE) -> tuple[Array, ...]:
        """The dense block on each of N chunks of the batch, xs: N x [B/N, T, D] -> N x [B/N, T, D], its
        weights fetched once (ModelConfig.tp_overlap_chunks; `scan_stacked` says why)."""
        with self.quantized():
            ws = BlockWeights(self.ln1.weights(par), self.attn.weights(par), self.ln2.weights(par), self.ffn.weights(par))
            return tuple(self.dense(x, par, ws) for x in xs)

    def dense(self, x: Array, par: Parallelism = SINGLE_DEVICE, ws: BlockWeights = BlockWeights()) -> Array:
        """The dense block on x [B, T, D] -> [B, T, D]; ws: its weights fetched once (default: at use)."""
        x = self.attend(x, par, ws)
        return par.constrain(x + self.ffn(self.ln2(x, par, ws.ln2), par, ws.ffn), ACTIVATION)

    def attend(self, x: Array, par: Parallelism = SINGLE_DEVICE, ws: BlockWeights = BlockWeights()) -> Array:
        """x + attn(ln1(x)): [B, T, D] -> [B, T, D]."""
        return par.constrain(x + self.attn(self.ln1(x, par, ws.ln1), par, ws.attn), ACTIVATION)


LAYERS = "layers"  # logical axis of the stacked blocks' leading [n] dimension (and the stack's name)


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """L blocks as ONE `Block` whose params are [L, ...]: one random call per weight kind (nnx.vmap)."""
    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, axis_size=cfg.num_layers,
              transform_metadata={nnx.PARTITION_NAME: LAYERS, "logical_axes": LAYERS})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs)

    return make(rngs)


@functools.lru_cache(maxsize=None)
def layer_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    """One layer's `Block` structure: per-layer logical axes (no 'layers'), no arrays."""
    return nnx.graphdef(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))


def scan_layers(blocks: Block, cfg: ModelConfig, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
    """x: [B, T, D] through the L stacked blocks with `jax.lax.scan`, one layer's params per iteration,
    checkpointed with `par.layer_policy(remat_policy(cfg))` (docs/design.md: the model's parameters)."""
    return par.layer_stack(nnx.to_pure_dict(nnx.state(blocks, nnx.Param)), cfg, x, scan_stacked)


def scan_stacked(stacked: dict, cfg: ModelConfig, x: Array,
                 par: Parallelism = SINGLE_DEVICE) -> Array | tuple[Array, moe.Stats]:
    """`scan_layers` on a pure dict of [n, ...] leaves -> x [B, T, D], or (x, router stats stacked [n, ...])."""
    layer_def = layer_graphdef(cfg)
    n = cfg.tp_overlap_chunks

    if cfg.num_experts:
        def body(x: Array, layer) -> tuple[Array, moe.Stats]:  # the layer's stats: the scan's ys
            return nnx.merge(layer_def, layer)(x, par)
    elif n > 1:
        # Batch-split overlap (--tp_overlap_chunks=N): the residual stream travels the scan as N chunks
        # of the batch, [B, T, D] -> N x [B/N, T, D], split before the first layer and merged after
        # the last. Under Megatron TP each chunk runs its own collectives over `tensor`: forward, g's
        # psum of [B/N, T, D] after output_proj and after w2; backward, f's psum of its cotangent
        # before the q/k/v and w1/w3 matmuls: 2N all-reduces per layer each way, 1/N the bytes each.
        # The chunks share no data but the weights, so the scheduler can run one chunk's all-reduce
        # beside another chunk's matmuls, which a lone chunk's residual add would wait for. Measured
        # (llama_v5e, fsdp_tp, v5e:4x4, 2 chunks): XLA:TPU hides about half of what was exposed and
        # leaves the last chunk's all-reduce and one more per layer synchronous (BENCHMARKS.md).
        def body(xs: tuple[Array, ...], layer) -> tuple[tuple[Array, ...], None]:
            return nnx.merge(layer_def, layer).chunks(xs, par), None
    else:
        def body(x: Array, layer) -> tuple[Array, None]:  # x: [B, T, D]; layer: one layer's params
            return nnx.merge(layer_def, layer)(x, par), None

    policy = par.layer_policy(remat_policy(cfg))
    if policy is not None:
        # prevent_cse when unrolled (or ONE layer: XLA removes a trip-count-1 loop): XLA otherwise
        # merged the recomputation with the original (measured: manual FSDP kept its gathered weights).
        depth = jax.tree.leaves(stacked)[0].shape[0]
        body = jax.checkpoint(body, policy=policy, prevent_cse=cfg.scan_unroll > 1 or depth == 1)
    if n > 1:  # dense blocks only (ModelConfig refuses chunks with experts)
        xs, _ = jax.lax.scan(body, tuple(par.constrain(c, ACTIVATION) for c in layers.batch_chunks(x, n)), stacked,
                             unroll=cfg.scan_unroll)
        return par.constrain(layers.merge_chunks(xs), ACTIVATION)
    x, stats = jax.lax.scan(body, x, stacked, unroll=cfg.scan_unroll)
    return (x, stats) if cfg.num_experts else x


class TransformerLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        v, vp, d = cfg.vocab_size, cfg.padded_vocab_size, cfg.d_model
        self.token_embeddings = Embedding(v, vp, d, rngs=rngs, dtype=cfg.dtype)
        for name, stack in cfg.stacks:  # `layers` [L, ...]; or `dense_layers` [K, ...], `layers` [L-K, ...]
            setattr(self, name, stacked_blocks(stack, rngs))
        self.ln_final = RMSNorm(d, cfg.norm_eps, cfg.norm_dtype == "compute")
        self.lm_head = Linear(d, vp, ("embed", "vocab"), rngs=rngs, fan_out=v, valid_out=v, dtype=cfg.dtype)

    def __call__(self, tokens: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """tokens: [B, T] int -> logits [B, T, V_pad], padded logits unmasked (the loss and sampler mask them)."""
        x, _ = self.blocks(tokens, par)
        return self.head(x, par)

    def blocks(self, tokens: Array, par: Parallelism = SINGLE_DEVICE) -> tuple[Array, moe.Stats | None]:
        """tokens [B, T] -> (the residual stream after the blocks [B, T, D], router stats or None)."""
        x, stats = self.embed(tokens, par), None
        for name, stack in self.cfg.stacks:
            out = scan_layers(getattr(self, name), stack, x, par)
            x, stats = out if stack.num_experts else (out, stats)
        return x, stats

    # The three pieces of __call__, which pipeline parallelism runs on different stages.

    def embed(self, tokens: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """tokens [B, T] -> the residual stream [B, T, D] (first stage)."""
        return par.constrain(self.token_embeddings(tokens, par), ACTIVATION)

    def head(self, x: Array, par: Parallelism = SINGLE_DEVICE, compute_logits: bool = False) -> Array:
        """The residual stream after the blocks [B, T, D] -> logits [B, T, V_pad] (last stage), float32
        or (compute_logits) the compute dtype."""
        x = self.ln_final(x, par)
        # Logits in the compute dtype (so the lm_head's backward matmuls stay bf16 too: with
        # float32 logits JAX ran both of them in f32, measured), then float32 unless compute_logits.
        logits = par.head(lambda h: self.lm_head(h, par), par.enter_tensor_parallel(x))
        return par.constrain(logits if compute_logits else logits.astype(jnp.float32), LOGITS)

    def head_loss(self, x: Array, targets: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """Mean next-token cross-entropy of the residual stream x [B, T, D] after the blocks."""
        return jnp.mean(self.token_losses(x, targets, par))

    def token_losses(self, x: Array, targets: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """Per-token cross-entropy [B, T] of x [B, T, D]: from the logits, or chunk by chunk (loss_chunks)
        with the lm_head weight used inside `par.head`, so FSDP's checkpoint re-gathers it."""
        cfg = self.cfg
        if not cfg.loss_chunks:
            return par.token_loss(self.head(x, par, cfg.logits_dtype == "compute"), targets, cfg.vocab_size)

        def lm_loss(h: Array) -> Array:  # h [B, T, D] -> [B, T]
            w = _use(self.lm_head.weight, par, cfg.dtype)  # [D, V_pad(/tensor)]
            return par.chunked_token_loss(h, w, targets, cfg.vocab_size, chunks_of(cfg))

        return par.head(lm_loss, par.enter_tensor_parallel(self.ln_final(x, par)))

    def loss(self, tokens: Array, targets: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """Mean next-token cross-entropy over this program's tokens (with experts: plus the router losses)."""
        if self.cfg.num_experts:
            return self.loss_and_stats(tokens, targets, par)[0]
        return self.head_loss(self.blocks(tokens, par)[0], targets, par)

    def loss_and_stats(self, tokens: Array, targets: Array,
                       par: Parallelism = SINGLE_DEVICE) -> tuple[Array, dict[str, Array]]:
        """(loss, stats): loss = ce + router_aux_loss * mean_l aux_l + router_z_loss * mean_l z_l; stats:
        ce [], aux and z [Lm], tokens_per_expert [Lm, E], dropped [Lm], assignments [] (ce alone if dense)."""
        cfg = self.cfg
        x, layer_stats = self.blocks(tokens, par)
        ce = self.head_loss(x, targets, par)
        if layer_stats is None:
            return ce, {"ce": ce}
        loss = ce
        for name, coefficient in (("aux", cfg.router_aux_loss), ("z", cfg.router_z_loss)):
            if coefficient:  # 0: the term is left out of the program, not multiplied by 0
                loss = loss + coefficient * jnp.mean(layer_stats[name])
        assignments = jnp.asarray(cfg.experts_per_token * tokens.size, jnp.int32)
        return loss, {"ce": ce, **layer_stats, "assignments": assignments}
