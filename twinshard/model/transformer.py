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

Inside the scan body a layer's params are one slice (`[D, H*dh]`, logical axes
without `layers`), so the strategy hooks (`Parallelism.weight`: FSDP's gather,
GSPMD's pin) act per weight and per layer, exactly as in an unrolled model.
The CS336 state dict keeps `layers.{i}.*` names: `state_dict` unstacks,
`load_state_dict` stacks.

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
import numpy as np
from flax import nnx

from twinshard.model import layers, moe
from twinshard.config import ModelConfig
from twinshard.model.attention import CausalSelfAttention
from twinshard.model.hooks import SINGLE_DEVICE, Parallelism, Policy
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
        h1, h3 = par.column_parallel(x, (w1, w3))  # [B, T, F] each (F/tensor under TP)
        return par.row_parallel(layers.swiglu_gate(h1, h3), w2)


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


LAYERS = "layers"  # logical axis of the stacked blocks' leading [L] dimension


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


# ----------------------------------------------------------------------------
# Rematerialization of the scanned block (ModelConfig.remat).
# ----------------------------------------------------------------------------

_POLICIES = jax.checkpoint_policies

# ModelConfig.remat -> the jax.checkpoint policy of ONE layer (the scan body). A policy is
# asked, for each primitive of the layer, whether its output may be saved for the backward
# pass; what it refuses is recomputed from what it saved, inside the backward loop.
REMAT_POLICIES: dict[str, Policy | None] = {
    # No checkpoint: autodiff saves whatever the backward pass reads: per layer the norm
    # outputs and statistics, q and k after RoPE, v, the attention output and its rows'
    # log-sum-exp (layers.recompute_attention, the default off-GPU, saves no [b,H,T,T]
    # array), SwiGLU's three [b,T,F] (h1, h3 and W2's input: layers.swiglu_gate recomputes the
    # sigmoid in its backward); twinshard/cost/memory.py lists them exactly.
    "none": None,
    # Save nothing inside the layer: the forward loop keeps each layer's input [b,T,D] (the
    # checkpoint's argument), the backward loop re-runs the layer's forward first.
    "full": _POLICIES.nothing_saveable,
    # Save every dot_general output: the 7 projections AND attention's QK^T scores
    # [b,H,T,T] and AV output; recompute norms, RoPE, softmax, SiLU (elementwise work).
    "dots": _POLICIES.dots_saveable,
    # Save the dot_generals without batch dimensions. `layers.linear` is a 2-D dot on
    # [B*T, in] rows (or einsum('...i,io->...o'): B and T free dimensions either way), so the
    # 7 projections ARE saved; attention's two einsums batch over (B, h) and are recomputed
    # (no [b,H,T,T] residual; Korthikanti et al. 2022's "selective recomputation" of the
    # attention core).
    "dots_no_batch": _POLICIES.dots_with_no_batch_dims_saveable,
}
# Not offered (JAX 0.12's jax.checkpoint_policies): the offload policies
# (`offload_dot_with_no_batch_dims`, `save_and_offload_only_these_names`) move residuals to
# pinned host memory, which XLA:CPU does not separate from device memory (nothing the tests
# could measure); the name policies (`save_only_these_names` with `checkpoint_name`) would
# need names in the layer math, and with one policy per layer "full" already keeps just the
# layer input; `save_anything_except_these_names` is a stub in 0.12 (it saves everything).


def remat_policy(cfg: ModelConfig) -> Policy | None:
    """The jax.checkpoint policy of one scanned layer for `cfg.remat` (None: no checkpoint)."""
    return REMAT_POLICIES[cfg.remat]


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
        # manual FSDP at scan_unroll=L gathered each weight once and kept it for backward).
        body = jax.checkpoint(body, policy=policy, prevent_cse=cfg.scan_unroll > 1)
    x, stats = jax.lax.scan(body, x, stacked, unroll=cfg.scan_unroll)
    return (x, stats) if cfg.num_experts else x


class TransformerLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        v, vp, d = cfg.vocab_size, cfg.padded_vocab_size, cfg.d_model
        self.token_embeddings = Embedding(v, vp, d, rngs=rngs, dtype=cfg.dtype)
        self.layers = stacked_blocks(cfg, rngs)  # params [L, ...]
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
        stacked over layers: scan_stacked; None for a dense model)."""
        out = scan_layers(self.layers, self.cfg, self.embed(tokens, par), par)
        return out if self.cfg.num_experts else (out, None)

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
        return jnp.mean(par.token_loss(self.head(x, par), targets, self.cfg.vocab_size))

    def loss(self, tokens: Array, targets: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """Mean next-token cross-entropy over this program's (local) tokens; with experts, plus
        the router losses (loss_and_stats)."""
        if self.cfg.num_experts:
            return self.loss_and_stats(tokens, targets, par)[0]
        return jnp.mean(par.token_loss(self(tokens, par), targets, self.cfg.vocab_size))

    def loss_and_stats(self, tokens: Array, targets: Array,
                       par: Parallelism = SINGLE_DEVICE) -> tuple[Array, dict[str, Array]]:
        """(loss, stats) for the training log. loss = ce + router_aux_loss * mean_l aux_l +
        router_z_loss * mean_l z_l (ce alone for a dense model). stats:

            ce                 float32 []      mean next-token cross-entropy
            aux, z             float32 [L]     each layer's load-balancing and z loss (moe.moe_ffn)
            tokens_per_expert  int32 [L, E]    kept assignments per layer and expert
            dropped            int32 [L]       assignments over capacity, per layer
            assignments        int32 []        k * B * T: each layer's assignments (kept + dropped)

        A dense model's stats hold ce alone. Values are this program's (local) tokens'."""
        cfg = self.cfg
        x, layer_stats = self.blocks(tokens, par)
        ce = jnp.mean(par.token_loss(self.head(x, par), targets, cfg.vocab_size))
        if layer_stats is None:
            return ce, {"ce": ce}
        loss = ce
        for name, coefficient in (("aux", cfg.router_aux_loss), ("z", cfg.router_z_loss)):
            if coefficient:  # 0: the term is left out of the program, not multiplied by 0
                loss = loss + coefficient * jnp.mean(layer_stats[name])
        assignments = jnp.asarray(cfg.experts_per_token * tokens.size, jnp.int32)
        return loss, {"ce": ce, **layer_stats, "assignments": assignments}


# ----------------------------------------------------------------------------
# Weight interop with the CS336 PyTorch model: names, [out, in] layout, unpadded vocab.
# A mixture-of-experts layer's experts keep their stack: layers.{i}.ffn.experts.w1.weight is
# [E, out, in] (each expert in torch layout); its router layers.{i}.ffn.router.weight is [E, D].
# ----------------------------------------------------------------------------

def _cs336_layout(path: str, w: np.ndarray, vocab_size: int) -> np.ndarray:
    if path == "token_embeddings.weight":
        return w[:vocab_size]  # [V, D]
    if path == "lm_head.weight":
        return w[:, :vocab_size].T  # [D, V_pad] -> [V, D]
    return np.swapaxes(w, -1, -2) if w.ndim >= 2 else w  # Linear [(E,) in, out] -> torch [(E,) out, in]


def _from_cs336_layout(path: str, w: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Inverse of `_cs336_layout`; `old` (our layout) supplies the padded vocab rows/columns."""
    if path == "token_embeddings.weight":
        return np.concatenate([w, old[w.shape[0]:]], axis=0)
    if path == "lm_head.weight":
        return np.concatenate([w.T, old[:, w.shape[0]:]], axis=1)
    return np.swapaxes(w, -1, -2) if w.ndim >= 2 else w


def _is_stacked(path: str) -> bool:
    return path.startswith(LAYERS + ".")


_EXPERT_NAMES = {f"ffn.{w}.weight": f"ffn.experts.{w}.weight" for w in ("w1", "w2", "w3")}


def _layer_names(path: str, cfg: ModelConfig) -> list[str]:
    """'layers.ffn.w1.weight' (stacked) -> ['layers.0.ffn.w1.weight', ...] (with experts:
    'layers.0.ffn.experts.w1.weight', ...); other paths: [path]."""
    if not _is_stacked(path):
        return [path]
    rest = path[len(LAYERS) + 1:]
    rest = _EXPERT_NAMES.get(rest, rest) if cfg.num_experts else rest
    return [f"{LAYERS}.{i}.{rest}" for i in range(cfg.num_layers)]


def _flat_params(model: TransformerLM) -> list[tuple[str, nnx.Variable]]:
    return [(".".join(str(p) for p in path), var)
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def state_dict(model: TransformerLM) -> dict[str, np.ndarray]:
    """CS336 / PyTorch-named float32 numpy weights (unpadded vocab, Linear as [out, in]);
    the stacked [L, ...] blocks unstacked into `layers.{i}.*`."""
    out = {}
    for path, var in _flat_params(model):
        w = np.asarray(var[...])
        for name, wi in zip(_layer_names(path, model.cfg), w if _is_stacked(path) else [w]):
            out[name] = _cs336_layout(name, wi, model.cfg.vocab_size)
    return out


def _checked_weight(name: str, value: object) -> np.ndarray:
    """`value` as a numpy array if it is a finite floating-point numpy/jax array, else ValueError.

    Python lists, strings, scalars and torch tensors are refused rather than
    converted: a list may hold anything, and `np.asarray(torch_tensor)` silently
    copies through the CPU; the caller converts knowingly (`t.float().numpy()`).
    """
    if not isinstance(value, (np.ndarray, jax.Array)):
        raise ValueError(f"state dict entry {name!r} is a {type(value).__name__}, not an array; pass a "
                         "numpy or jax array (np.asarray(x, np.float32); a torch tensor: t.float().numpy()).")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise ValueError(f"state dict entry {name!r} has dtype {value.dtype}; weights must be floating "
                         "point (float32, bfloat16, float16, float64): cast with .astype(np.float32).")
    w = np.asarray(value)
    bad = w.size - int(np.count_nonzero(np.isfinite(w)))
    if bad:
        raise ValueError(f"state dict entry {name!r} has {bad} non-finite values (nan or inf) out of "
                         f"{w.size}; a model cannot train or sample from them.")
    return w


def load_state_dict(model: TransformerLM, sd: dict[str, np.ndarray]) -> None:
    """Load CS336-named weights in place. Raises ValueError, before any weight changes, on
    missing/extra names, a value that is not a finite floating-point numpy/jax array, or a shape."""
    if not hasattr(sd, "keys"):
        raise ValueError(f"the state dict is a {type(sd).__name__}; pass a dict of name -> array "
                         "(as twinshard.model.state_dict returns).")
    current = state_dict(model)
    missing, extra = sorted(set(current) - set(sd)), sorted(set(sd) - set(current))
    if missing or extra:
        raise ValueError(f"state dict does not match the model: missing {missing[:5]}, unexpected {extra[:5]}.")
    for name, want in current.items():
        got = _checked_weight(name, sd[name])
        if got.shape != want.shape:
            raise ValueError(f"{name}: shape {got.shape} in the state dict, the model needs {want.shape}.")
    for path, var in _flat_params(model):
        old = np.asarray(var[...])
        if _is_stacked(path):  # stack layers.{i}.* into [L, ...]
            w = np.stack([_from_cs336_layout(n, np.asarray(sd[n], np.float32), o)
                          for n, o in zip(_layer_names(path, model.cfg), old)])
        else:
            w = _from_cs336_layout(path, np.asarray(sd[path], np.float32), old)
        var[...] = jnp.asarray(w)
