"""Weight interop with the CS336 PyTorch model: names, [out, in] layout, unpadded vocab; the
scanned stacks are unstacked into `layers.{i}.*` in run order (experts keep their [E, out, in] stack)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twinshard.config import ModelConfig
from twinshard.model.transformer import LAYERS, TransformerLM


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


_EXPERT_NAMES = {f"ffn.{w}.weight": f"ffn.experts.{w}.weight" for w in ("w1", "w2", "w3")}


def _layer_names(path: str, cfg: ModelConfig) -> list[str] | None:
    """A stacked leaf's per-layer names in run order ('layers.ffn.w1.weight' -> ['layers.0.ffn.w1.weight', ...]), None outside the stacks."""
    stack, _, rest = path.partition(".")
    first = 0  # the stack's first layer
    for name, layers in cfg.stacks:
        if name == stack:
            rest = _EXPERT_NAMES.get(rest, rest) if layers.num_experts else rest
            return [f"{LAYERS}.{first + i}.{rest}" for i in range(layers.num_layers)]
        first += layers.num_layers
    return None


def _flat_params(model: TransformerLM) -> list[tuple[str, nnx.Variable]]:
    return [(".".join(str(p) for p in path), var)
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def state_dict(model: TransformerLM) -> dict[str, np.ndarray]:
    """CS336 / PyTorch-named float32 numpy weights (unpadded vocab, Linear as [out, in])."""
    out = {}
    for path, var in _flat_params(model):
        w = np.asarray(var[...])
        names = _layer_names(path, model.cfg)
        for name, wi in (zip(names, w, strict=True) if names else [(path, w)]):
            out[name] = _cs336_layout(name, wi, model.cfg.vocab_size)
    return out


def _checked_weight(name: str, value: object) -> np.ndarray:
    """`value` as a numpy array if it is a finite floating-point numpy/jax array, else ValueError
    (lists, scalars and torch tensors are refused: the caller converts knowingly)."""
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
        names = _layer_names(path, model.cfg)
        if names:  # stack layers.{i}.* into [n, ...]
            w = np.stack([_from_cs336_layout(n, np.asarray(sd[n], np.float32), o) for n, o in zip(names, old)])
        else:
            w = _from_cs336_layout(path, np.asarray(sd[path], np.float32), old)
        var[...] = jnp.asarray(w)
