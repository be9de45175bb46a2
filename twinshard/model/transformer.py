"""The decoder-only Transformer LM (Flax NNX), mesh-free.

Every parameter carries `logical_axes` metadata (vocab, embed, heads, kv_heads,
mlp, norm); a strategy maps those names to mesh axes. The modules' weights are
declared and used through twinshard/model/linear.py; attention is
twinshard/model/attention.py. The model never mentions a
mesh: strategy-specific behaviour comes in through a `Parallelism` object
(twinshard/model/hooks.py) passed to `__call__`.

Parameter tree (paths mirror the CS336 state-dict names; Linear weights are
stored [in, out]). The L blocks are ONE stacked `Block` whose every param has
a leading [L] axis with logical name `layers` (the pipeline strategies map it to
`stage`; the others leave it whole), run by `jax.lax.scan`:

    token_embeddings.weight          [V_pad, D]      (vocab, embed)
    layers.ln1.weight                [L, D]          (layers, norm)
    layers.attn.q_proj.weight        [L, D, H*dh]    (layers, embed, heads)
    layers.attn.{k,v}_proj.weight    [L, D, Hkv*dh]  (layers, embed, kv_heads)  Hkv = H without GQA
    layers.attn.output_proj.weight   [L, H*dh, D]    (layers, heads, embed)
    layers.ln2.weight                [L, D]          (layers, norm)
    layers.ffn.{w1,w3}.weight        [L, D, F]       (layers, embed, mlp)
    layers.ffn.w2.weight             [L, F, D]       (layers, mlp, embed)
    ln_final.weight                  [D]             (norm,)
    lm_head.weight                   [D, V_pad]      (embed, vocab)

A mixture-of-experts model (ModelConfig.num_experts = E > 0; twinshard/model/moe.py) has, in
place of every layer's ffn above (F_e = ModelConfig.expert_ff):

    layers.ffn.router.weight         [L, D, E]       (layers, embed, router)
    layers.ffn.{w1,w3}.weight        [L, E, D, F_e]  (layers, experts, embed, mlp)
    layers.ffn.w2.weight             [L, E, F_e, D]  (layers, experts, mlp, embed)

and with K = ModelConfig.first_dense_layers > 0 two stacks (ModelConfig.stacks), scanned one
after the other: `dense_layers.*` [K, ...], the first K layers as in the dense tree above, then
`layers.*` [L - K, ...], the mixture-of-experts layers.

Inside the scan body a layer's params are one slice (`[D, H*dh]`, logical axes
without `layers`), so the strategy hooks (`Parallelism.weight`: FSDP's gather,
GSPMD's pin) act per weight and per layer, exactly as in an unrolled model.
The CS336 state dict keeps `layers.{i}.*` names: twinshard/model/state_dict.py unstacks and
stacks.

Initialisation draws each stacked weight kind with ONE random call of shape
[L, ...] (`nnx.vmap` over L split keys), not L calls: each truncated normal costs
a fixed slice of compile time whatever its size, so the compiled init does not
grow with depth. Every strategy draws the same bits from the same seed (the init
is jitted with out_shardings, each device computing only its shards).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from twinshard.model import layers, moe
from twinshard.config import ModelConfig
from twinshard.model.attention import CausalSelfAttention
from twinshard.model.hooks import SINGLE_DEVICE, Parallelism
from twinshard.model.layers import MLP_IN, MLP_OUT
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
    def __init__(self, d_model: int, eps: float):
        self.weight = _param(jnp.ones((d_model,), jnp.float32), ("norm",))
        self.eps = eps

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        return layers.rms_norm(x, _use(self.weight, par), self.eps)


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype: str = "float32"):
        self.w1 = Linear(d_model, d_ff, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, ("mlp", "embed"), rngs=rngs, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.dtype = dtype

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """x: [B, T, D] -> [B, T, D]; w1/w3 column-parallel, w2 row-parallel."""
        w1, w2, w3 = (_use(m.weight, par, self.dtype) for m in (self.w1, self.w2, self.w3))
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


class Block(nnx.Module):
    """Pre-norm block: x + attn(ln1(x)), then + ffn(ln2(.)). With experts (cfg.num_experts > 0)
    the ffn is MoEFeedForward and the block returns (x, its router stats)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.num_experts:
            self.ffn = MoEFeedForward(cfg, rngs=rngs)
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.d_ff, rngs=rngs, dtype=cfg.dtype)

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array | tuple[Array, moe.Stats]:
        x = par.constrain(x + self.attn(self.ln1(x, par), par), ACTIVATION)
        if isinstance(self.ffn, MoEFeedForward):
            y, stats = self.ffn(self.ln2(x, par), par)
            return par.constrain(x + y, ACTIVATION), stats
        return par.constrain(x + self.ffn(self.ln2(x, par), par), ACTIVATION)


LAYERS = "layers"  # logical axis of the stacked blocks' leading [n] dimension (and the stack's name)


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """L blocks as ONE `Block` whose params are [L, ...] with logical axes ('layers', ...).

    `nnx.vmap` over L keys split from the params stream: each weight kind is
    one random call of shape [L, ...] in the compiled init (not L calls).
    """
    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, axis_size=cfg.num_layers,
              transform_metadata={nnx.PARTITION_NAME: LAYERS, "logical_axes": LAYERS})
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs)

    return make(rngs)


@functools.lru_cache(maxsize=None)
def _layer_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    """One layer's `Block` structure: per-layer logical axes (no 'layers'), no arrays."""
    return nnx.graphdef(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))


def scan_layers(blocks: Block, cfg: ModelConfig, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
    """x: [B, T, D] through the L stacked blocks with `jax.lax.scan` (one compiled body).

    Each iteration merges one layer's params (a [L, ...] -> [...] slice) into a
    per-layer `Block`, so the strategy hooks see per-layer weights and logical
    axes: the manual FSDP twin all-gathers ONE layer's weights per iteration,
    and the backward scan re-gathers them (remat) and reduce-scatters their
    gradients, one layer at a time. Collectives in the body appear once in the
    HLO, inside a `while` of trip count L (twinshard/hlo/loops.py multiplies).

    The compiled step does not grow with L; the loop costs run time on XLA:CPU
    (an unrolled or `unroll=4` scan ran faster than a rolled one, measured, JAX 0.12), so
    `cfg.scan_unroll` (default 1) lets a CPU run trade compile time for speed.

    `cfg.remat` checkpoints the body (ONE layer) with the policy of REMAT_POLICIES, as the
    strategy adapts it (`par.layer_policy`: manual TP also saves Megatron g's outputs,
    manual FSDP never saves a gathered weight and checkpoints even under "none"). The
    forward loop then saves, per layer, what the policy allows (stacked [L, ...]); the
    backward loop recomputes the rest of layer i in iteration i. The checkpoint must sit
    here, on the body: jax.checkpoint policies do not nest: an outer policy overrides the
    layer's (measured, JAX 0.12).
    """
    return par.layer_stack(nnx.to_pure_dict(nnx.state(blocks, nnx.Param)), cfg, x, scan_stacked)


def scan_stacked(stacked: dict, cfg: ModelConfig, x: Array,
                 par: Parallelism = SINGLE_DEVICE) -> Array | tuple[Array, moe.Stats]:
    """`scan_layers` on the blocks' params as a pure dict, every leaf [n, ...] for any n layers
    (pipeline stages run their own n = L/S slice of the stack).

    Dense: x [B, T, D]. Mixture of experts (cfg.num_experts > 0): (x, stats), each layer's
    router stats (moe.moe_ffn) stacked by the scan: aux [n], z [n], tokens_per_expert [n, E],
    dropped [n]."""
    layer_def = _layer_graphdef(cfg)

    if cfg.num_experts:
        def body(x: Array, layer) -> tuple[Array, moe.Stats]:  # the layer's stats: the scan's ys
            return nnx.merge(layer_def, layer)(x, par)
    else:
        def body(x: Array, layer) -> tuple[Array, None]:  # x: [B, T, D]; layer: one layer's params
            return nnx.merge(layer_def, layer)(x, par), None

    policy = par.layer_policy(remat_policy(cfg))
    if policy is not None:
        # prevent_cse: in a rolled scan the forward and backward loops keep the original and
        # its recomputation apart (jax.checkpoint's docstring: unnecessary inside lax.scan),
        # but an unrolled one puts both in one computation, where XLA merged them (measured:
        # manual FSDP at scan_unroll=L gathered each weight once and kept it for backward). A
        # stack of ONE layer is unrolled too: XLA removes a while loop of trip count 1 (measured:
        # a first_dense_layers=1 stack's 7 weights gathered once, not re-gathered for backward).
        depth = jax.tree.leaves(stacked)[0].shape[0]
        body = jax.checkpoint(body, policy=policy, prevent_cse=cfg.scan_unroll > 1 or depth == 1)
    x, stats = jax.lax.scan(body, x, stacked, unroll=cfg.scan_unroll)
    return (x, stats) if cfg.num_experts else x


class TransformerLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        v, vp, d = cfg.vocab_size, cfg.padded_vocab_size, cfg.d_model
        self.token_embeddings = Embedding(v, vp, d, rngs=rngs, dtype=cfg.dtype)
        for name, stack in cfg.stacks:  # `layers` [L, ...]; or `dense_layers` [K, ...], `layers` [L-K, ...]
            setattr(self, name, stacked_blocks(stack, rngs))
        self.ln_final = RMSNorm(d, cfg.norm_eps)
        self.lm_head = Linear(d, vp, ("embed", "vocab"), rngs=rngs, fan_out=v, valid_out=v, dtype=cfg.dtype)

    def __call__(self, tokens: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """tokens: [B, T] int -> logits [B, T, V_pad] (V_pad/tensor under vocab parallelism).

        Padded logits are not masked here; the loss and the sampler mask them. A mixture-of-
        experts model's router stats are dropped (loss_and_stats keeps them).
        """
        x, _ = self.blocks(tokens, par)
        return self.head(x, par)

    def blocks(self, tokens: Array, par: Parallelism = SINGLE_DEVICE) -> tuple[Array, moe.Stats | None]:
        """tokens [B, T] -> (the residual stream after the L blocks [B, T, D], the router stats
        stacked over the MoE layers: scan_stacked; None for a dense model). Each stack of
        ModelConfig.stacks is one scan, in order (the first dense layers, then the MoE layers)."""
        x, stats = self.embed(tokens, par), None
        for name, stack in self.cfg.stacks:
            out = scan_layers(getattr(self, name), stack, x, par)
            x, stats = out if stack.num_experts else (out, stats)
        return x, stats

    # The three pieces of __call__, which pipeline parallelism runs on different stages.

    def embed(self, tokens: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """tokens [B, T] -> the residual stream [B, T, D] (first stage)."""
        return par.constrain(self.token_embeddings(tokens, par), ACTIVATION)

    def head(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """The residual stream after the blocks [B, T, D] -> logits [B, T, V_pad] (last stage)."""
        x = self.ln_final(x, par)
        # Logits in the compute dtype (so the lm_head's backward matmuls stay bf16 too: with
        # float32 logits JAX ran both of them in f32, measured), then float32 for the loss.
        logits = par.head(lambda h: self.lm_head(h, par), par.enter_tensor_parallel(x)).astype(jnp.float32)
        return par.constrain(logits, LOGITS)

    def head_loss(self, x: Array, targets: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """Mean next-token cross-entropy of the residual stream x [B, T, D] after the blocks."""
        return jnp.mean(self.token_losses(x, targets, par))

    def token_losses(self, x: Array, targets: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """Per-token cross-entropy [B, T] of the residual stream x [B, T, D] after the blocks: from
        the logits (`head`), or with ModelConfig.loss_chunks > 0 from the lm_head's input, chunk by
        chunk (`par.chunked_token_loss`: no [B, T, V] array). The lm_head weight is used inside the
        function `par.head` wraps, so FSDP's checkpoint re-gathers it for the backward pass."""
        cfg = self.cfg
        if not cfg.loss_chunks:
            return par.token_loss(self.head(x, par), targets, cfg.vocab_size)

        def lm_loss(h: Array) -> Array:  # h [B, T, D] -> [B, T]
            w = _use(self.lm_head.weight, par, cfg.dtype)  # [D, V_pad(/tensor)]
            return par.chunked_token_loss(h, w, targets, cfg.vocab_size, cfg.loss_chunks)

        return par.head(lm_loss, par.enter_tensor_parallel(self.ln_final(x, par)))

    def loss(self, tokens: Array, targets: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """Mean next-token cross-entropy over this program's (local) tokens; with experts, plus
        the router losses (loss_and_stats)."""
        if self.cfg.num_experts:
            return self.loss_and_stats(tokens, targets, par)[0]
        return self.head_loss(self.blocks(tokens, par)[0], targets, par)

    def loss_and_stats(self, tokens: Array, targets: Array,
                       par: Parallelism = SINGLE_DEVICE) -> tuple[Array, dict[str, Array]]:
        """(loss, stats) for the training log. loss = ce + router_aux_loss * mean_l aux_l +
        router_z_loss * mean_l z_l (ce alone for a dense model). stats:

            ce                 float32 []      mean next-token cross-entropy
            aux, z             float32 [Lm]    each MoE layer's load-balancing and z loss (moe.moe_ffn)
            tokens_per_expert  int32 [Lm, E]   kept assignments per MoE layer and expert
            dropped            int32 [Lm]      assignments over capacity, per MoE layer
            assignments        int32 []        k * B * T: each layer's assignments (kept + dropped)

        Lm = ModelConfig.moe_layers. A dense model's stats hold ce alone. Values are this
        program's (local) tokens'."""
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
