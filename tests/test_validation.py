"""API validation: configs are typed and finite; load_state_dict takes
only finite floating-point numpy/jax arrays. Each bad value is a ValueError naming the
field (`ModelConfig.d_model`) or state-dict key, the value, and what is accepted."""

from __future__ import annotations

import dataclasses
import math
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from twinshard.config import ModelConfig, TrainConfig, preset
from twinshard.model import TransformerLM, load_state_dict, state_dict

MODEL = preset("tiny").model
TRAIN = preset("tiny").train
INT = "expected an int"
FINITE = "expected a finite number"

CONFIG_CASES = [
    # (config, field, bad value, what the message says is accepted)
    (ModelConfig, "vocab_size", "x", INT),
    (ModelConfig, "vocab_size", None, INT),
    (ModelConfig, "d_model", 64.0, INT),
    (ModelConfig, "num_heads", True, INT),
    (ModelConfig, "num_layers", 2.5, INT),
    (ModelConfig, "context_length", "32", INT),
    (ModelConfig, "d_ff", np.float32(192), INT),
    (ModelConfig, "rope_theta", math.nan, FINITE),
    (ModelConfig, "rope_theta", math.inf, FINITE),
    (ModelConfig, "rope_theta", "1e4", FINITE),
    (ModelConfig, "norm_eps", -math.inf, FINITE),
    (ModelConfig, "norm_eps", None, FINITE),
    (TrainConfig, "lr", math.nan, FINITE),
    (TrainConfig, "lr", True, FINITE),
    (TrainConfig, "min_lr", math.inf, FINITE),
    (TrainConfig, "grad_clip", math.nan, FINITE),
    (TrainConfig, "beta2", "0.95", FINITE),
    (TrainConfig, "steps", 100.0, INT),
    (TrainConfig, "batch_size", False, INT),
    (TrainConfig, "seed", None, INT),
    (TrainConfig, "checkpoint_every", "10", INT),
    (TrainConfig, "skip_nonfinite", 1, "expected True or False"),
    (TrainConfig, "tokenizer", None, "expected a non-empty string"),
    (TrainConfig, "tokenizer", "", "expected a non-empty string"),
]


def build(cls, **change):
    base = MODEL if cls is ModelConfig else TRAIN
    return dataclasses.replace(base, **change)  # what launchers do; runs __post_init__


@pytest.mark.parametrize("cls, field, value, accepted", CONFIG_CASES,
                         ids=[f"{c.__name__}.{f}={v!r}" for c, f, v, _ in CONFIG_CASES])
def test_config_field_types_and_finiteness(cls, field, value, accepted) -> None:
    named = re.escape(f"{cls.__name__}.{field}={value!r}")
    with pytest.raises(ValueError, match=f"^{named} .*{accepted}"):
        build(cls, **{field: value})


FIELD_EXAMPLES = {"int": ("7", 7.0, True), "float": ("0.1", None, False),
                  "bool": ("yes", 1, None), "str": (3, None, b"gpt2")}


@pytest.mark.parametrize("cls", [ModelConfig, TrainConfig])
def test_every_field_is_type_checked(cls) -> None:
    # A field added later without a kind in field_types.checked fails here (TypeError, not ValueError).
    for f in dataclasses.fields(cls):
        for value in FIELD_EXAMPLES[str(f.type)]:
            with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}.{f.name}=")):
                build(cls, **{f.name: value})


def test_accepted_values_are_normalised() -> None:
    m = build(ModelConfig, d_model=np.int64(64), rope_theta=10_000, norm_eps=np.float64(1e-5))
    assert type(m.d_model) is int and m.d_model == 64
    assert type(m.rope_theta) is float and m.rope_theta == 10_000.0
    assert type(m.norm_eps) is float
    t = build(TrainConfig, lr=1, min_lr=0, steps=np.int32(20), grad_clip=0)
    assert (t.lr, t.min_lr, t.grad_clip) == (1.0, 0.0, 0.0) and type(t.lr) is float
    assert type(t.steps) is int and t.steps == 20
    assert m == MODEL and hash(m) == hash(MODEL)  # normalised values compare equal


@pytest.mark.parametrize("cls, field, value, message", [
    (ModelConfig, "vocab_size", 0, "ModelConfig.vocab_size=0 must be positive"),
    (ModelConfig, "rope_theta", -1.0, "ModelConfig.rope_theta=-1.0 must be positive"),
    (ModelConfig, "norm_eps", 0, "ModelConfig.norm_eps=0.0 must be positive"),
    (ModelConfig, "num_heads", 5, "ModelConfig.d_model=64 is not divisible by num_heads=5"),
    (TrainConfig, "lr", -1e-3, "TrainConfig.lr=-0.001 must be positive"),
    (TrainConfig, "min_lr", 1.0, r"TrainConfig.min_lr=1.0: need 0 <= min_lr <= lr \(0.003\)"),
    (TrainConfig, "beta1", 1, "TrainConfig.beta1=1.0: AdamW needs 0 <= beta1 < 1"),
    (TrainConfig, "eps", 0.0, "TrainConfig.eps=0.0: AdamW needs eps > 0"),
    (TrainConfig, "warmup_steps", 21, r"TrainConfig.warmup_steps=21 must be in \[0, steps=20\]"),
    (TrainConfig, "log_every", 0, "TrainConfig.log_every=0 must be positive"),
    (TrainConfig, "eval_every", -1, r"TrainConfig.eval_every=-1 must be >= 0 \(0: never\)"),
    (TrainConfig, "weight_decay", -0.1, "TrainConfig.weight_decay=-0.1 must be >= 0"),
    (ModelConfig, "scan_unroll", 0, "ModelConfig.scan_unroll=0 must be positive"),
    (ModelConfig, "dtype", "float16", "ModelConfig.dtype='float16' is not supported; choose one of float32, bfloat16"),
    (ModelConfig, "attention", "flash", "ModelConfig.attention='flash' is not supported; choose one of auto, "),
])
def test_config_ranges_name_the_field(cls, field, value, message) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        build(cls, **{field: value})


def test_first_dense_layers_out_of_range_names_a_fix_that_works() -> None:
    """K outside [0, L) is the range error whatever num_experts (a dense model's -1 too), and its
    advice for a dense model builds one."""
    with pytest.raises(ValueError, match=r"^ModelConfig.first_dense_layers=-1 \(--first_dense_layers\) must be in "
                                         r"\[0, num_layers=2\)"):
        build(ModelConfig, first_dense_layers=-1)
    with pytest.raises(ValueError, match=r"choose 0 to 1, or --num_experts=0 --first_dense_layers=0 for a dense "
                                         r"model\.$"):
        build(ModelConfig, num_experts=4, first_dense_layers=2)
    assert build(ModelConfig, num_experts=0, first_dense_layers=0).moe_layers == 0


# ----------------------------------------------------------------------------- load_state_dict


@pytest.fixture()
def model() -> TransformerLM:
    return TransformerLM(MODEL, rngs=nnx.Rngs(0))


def replaced(sd: dict, name: str, value) -> dict:
    return {**sd, name: value}


KEY = "token_embeddings.weight"  # [257, 64]; the last key state_dict lists


def bad_values(w: np.ndarray) -> list[tuple[object, str]]:
    nan, inf = w.copy(), w.copy()
    nan[3, 5] = np.nan
    inf[0, 0], inf[1, 1] = np.inf, -np.inf
    return [
        ("weights", "is a str, not an array"),
        (None, "is a NoneType, not an array"),
        (w.tolist(), "is a list, not an array"),  # right shape and values, still refused
        (1.0, "is a float, not an array"),
        (np.float32(1.0), "is a float32, not an array"),
        (w.astype(np.int32), "has dtype int32; weights must be floating point"),
        (w > 0, "has dtype bool; weights must be floating point"),
        (w.astype(np.complex64), "has dtype complex64"),
        (np.array(w.tolist(), dtype=object), "has dtype object"),
        (np.full(w.shape, "x"), "has dtype <U1"),
        (nan, r"has 1 non-finite values \(nan or inf\) out of 16448"),
        (jnp.asarray(inf), r"has 2 non-finite values \(nan or inf\) out of 16448"),
    ]


def test_load_state_dict_refuses_unusable_values_and_names_the_key(model) -> None:
    sd = state_dict(model)
    before = {k: v.copy() for k, v in sd.items()}
    for value, message in bad_values(sd[KEY]):
        with pytest.raises(ValueError, match=f"^state dict entry '{KEY}' {message}"):
            load_state_dict(model, replaced({k: v + 1 for k, v in sd.items()}, KEY, value))
        # checked before anything is written: the other (shifted) weights were not loaded
        for k, v in state_dict(model).items():
            np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_load_state_dict_refuses_a_non_mapping(model) -> None:
    with pytest.raises(ValueError, match="the state dict is a list; pass a dict of name -> array"):
        load_state_dict(model, list(state_dict(model).values()))


def test_load_state_dict_accepts_float_numpy_and_jax_arrays(model) -> None:
    sd = state_dict(model)
    other = TransformerLM(MODEL, rngs=nnx.Rngs(1))
    mixed = {k: (jnp.asarray(v) if i % 3 == 0 else v.astype(np.float64) if i % 3 == 1 else v)
             for i, (k, v) in enumerate(sd.items())}
    load_state_dict(other, mixed)
    for k, v in state_dict(other).items():
        np.testing.assert_array_equal(v, sd[k], err_msg=k)
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in sd.items()}
    load_state_dict(other, bf16)
    for k, v in state_dict(other).items():
        np.testing.assert_array_equal(v, bf16[k].astype(np.float32), err_msg=k)
