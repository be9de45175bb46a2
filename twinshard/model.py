"""The decoder-only Transformer LM (Flax NNX), mesh-free.

Every parameter carries `logical_axes` metadata (vocab, embed, heads, mlp,
norm); a strategy maps those names to mesh axes. The model never mentions a
mesh: strategy-specific behaviour comes in through a `Parallelism` object
(twinshard/parallelism.py) passed to `__call__`.

Parameter tree (paths mirror the CS336 state-dict names; Linear weights are
stored [in, out]):

    token_embeddings.weight            [V_pad, D]   (vocab, embed)
    layers.{i}.ln1.weight              [D]          (norm,)
    layers.{i}.attn.{q,k,v}_proj.weight [D, H*dh]   (embed, heads)
    layers.{i}.attn.output_proj.weight [H*dh, D]    (heads, embed)
    layers.{i}.ln2.weight              [D]          (norm,)
    layers.{i}.ffn.{w1,w3}.weight      [D, F]       (embed, mlp)
    layers.{i}.ffn.w2.weight           [F, D]       (mlp, embed)
    ln_final.weight                    [D]          (norm,)
    lm_head.weight                     [D, V_pad]   (embed, vocab)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twinshard import layers
from twinshard.config import ModelConfig
from twinshard.parallelism import SINGLE_DEVICE, Parallelism

Array = jax.Array
ACTIVATION = ("batch", "seq", "embed")  # logical axes of the residual stream [B, T, D]
LOGITS = ("batch", "seq", "vocab")  # [B, T, V_pad]


def _param(value: Array, axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(value, logical_axes=axes)


def _use(var: nnx.Param, par: Parallelism, dtype: str = "float32") -> Array:
    """A weight as the strategy hands it to the math (FSDP: gathered), keyed by its logical axes.

    Cast to the compute dtype BEFORE the hook, so FSDP gathers the bf16 copy (half the bytes)
    and its gradient comes back through the cast as float32 for the float32 master weight."""
    return par.weight(var[...].astype(dtype), var.logical_axes)


def _truncated_normal(key: Array, shape: tuple[int, ...], std: float) -> Array:
    """N(0, std^2) truncated at +-3 std."""
    return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)


class Linear(nnx.Module):
    """y = x W, W: [d_in, d_out], std sqrt(2 / (d_in + d_out)).

    `fan_out` overrides d_out in the std (the lm_head uses the unpadded vocab,
    as the CS336 model does); `valid_out` zeroes the padded output columns.
    """

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, rngs: nnx.Rngs,
                 fan_out: int | None = None, valid_out: int | None = None, dtype: str = "float32"):
        std = math.sqrt(2.0 / (d_in + (fan_out or d_out)))
        w = _truncated_normal(rngs.params(), (d_in, d_out), std)
        if valid_out is not None:
            w = jnp.where(jnp.arange(d_out) < valid_out, w, 0.0)
        self.weight = _param(w, axes)
        self.dtype = dtype

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        return layers.linear(x, _use(self.weight, par, self.dtype))


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


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, hd = cfg.d_model, cfg.num_heads * cfg.head_dim
        self.q_proj = Linear(d, hd, ("embed", "heads"), rngs=rngs, dtype=cfg.dtype)
        self.k_proj = Linear(d, hd, ("embed", "heads"), rngs=rngs, dtype=cfg.dtype)
        self.v_proj = Linear(d, hd, ("embed", "heads"), rngs=rngs, dtype=cfg.dtype)
        self.output_proj = Linear(hd, d, ("heads", "embed"), rngs=rngs, dtype=cfg.dtype)
        self.head_dim, self.theta, self.max_len = cfg.head_dim, cfg.rope_theta, cfg.context_length
        self.dtype, self.attention = cfg.dtype, cfg.attention

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """x: [B, T, D] -> [B, T, D]; heads are column-parallel, output_proj row-parallel."""
        x = par.enter_tensor_parallel(x)
        w = [_use(m.weight, par, self.dtype) for m in (self.q_proj, self.k_proj, self.v_proj, self.output_proj)]
        out = layers.causal_self_attention(x, *w, self.head_dim, self.theta, self.max_len, self.attention)
        return par.exit_tensor_parallel(out)


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype: str = "float32"):
        self.w1 = Linear(d_model, d_ff, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, ("mlp", "embed"), rngs=rngs, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.dtype = dtype

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """x: [B, T, D] -> [B, T, D]; w1/w3 column-parallel, w2 row-parallel."""
        x = par.enter_tensor_parallel(x)
        w1, w2, w3 = (_use(m.weight, par, self.dtype) for m in (self.w1, self.w2, self.w3))
        return par.exit_tensor_parallel(layers.swiglu(x, w1, w2, w3))


class Block(nnx.Module):
    """Pre-norm block: x + attn(ln1(x)), then + ffn(ln2(.))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff, rngs=rngs, dtype=cfg.dtype)

    def __call__(self, x: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        x = par.constrain(x + self.attn(self.ln1(x, par), par), ACTIVATION)
        return par.constrain(x + self.ffn(self.ln2(x, par), par), ACTIVATION)


class TransformerLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        v, vp, d = cfg.vocab_size, cfg.padded_vocab_size, cfg.d_model
        self.token_embeddings = Embedding(v, vp, d, rngs=rngs, dtype=cfg.dtype)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.ln_final = RMSNorm(d, cfg.norm_eps)
        self.lm_head = Linear(d, vp, ("embed", "vocab"), rngs=rngs, fan_out=v, valid_out=v, dtype=cfg.dtype)

    def __call__(self, tokens: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """tokens: [B, T] int -> logits [B, T, V_pad] (V_pad/tensor under vocab parallelism).

        Padded logits are not masked here; the loss and the sampler mask them.
        """
        x = par.constrain(self.token_embeddings(tokens, par), ACTIVATION)
        for block in self.layers:
            x = block(x, par)
        x = self.ln_final(x, par)
        # Logits in the compute dtype (so the lm_head's backward matmuls stay bf16 too: with
        # float32 logits JAX ran both of them in f32, measured), then float32 for the loss.
        logits = self.lm_head(par.enter_tensor_parallel(x), par).astype(jnp.float32)
        return par.constrain(logits, LOGITS)

    def loss(self, tokens: Array, targets: Array, par: Parallelism = SINGLE_DEVICE) -> Array:
        """Mean next-token cross-entropy over this program's (local) tokens."""
        return jnp.mean(par.token_loss(self(tokens, par), targets, self.cfg.vocab_size))


# ----------------------------------------------------------------------------
# Weight interop with the CS336 PyTorch model: names, [out, in] layout, unpadded vocab.
# ----------------------------------------------------------------------------

def _cs336_layout(path: str, w: np.ndarray, vocab_size: int) -> np.ndarray:
    if path == "token_embeddings.weight":
        return w[:vocab_size]  # [V, D]
    if path == "lm_head.weight":
        return w[:, :vocab_size].T  # [D, V_pad] -> [V, D]
    return w.T if w.ndim == 2 else w  # Linear [in, out] -> torch [out, in]


def state_dict(model: TransformerLM) -> dict[str, np.ndarray]:
    """CS336 / PyTorch-named float32 numpy weights (unpadded vocab, Linear as [out, in])."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(str(p) for p in path)
        out[name] = _cs336_layout(name, np.asarray(var[...]), model.cfg.vocab_size)
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
    params = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(params):
        name = ".".join(str(p) for p in path)
        w = np.asarray(sd[name], dtype=np.float32)
        old = np.asarray(var[...])
        if name == "token_embeddings.weight":
            w = np.concatenate([w, old[w.shape[0]:]], axis=0)
        elif name == "lm_head.weight":
            w = np.concatenate([w.T, old[:, w.shape[0]:]], axis=1)
        elif w.ndim == 2:
            w = w.T
        var[...] = jnp.asarray(w)
