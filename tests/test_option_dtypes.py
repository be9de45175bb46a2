"""The dtypes each precision option promises, in every code path it touches, read from the traced
program (jaxprs; nothing is compiled). tests/test_promised_dtypes.py and test_speed_options.py hold
single device's scanned stack; this file the other paths:

- dtype="bfloat16": every flat matmul of the layers, the LM head and their gradients multiplies bf16;
- logits_dtype="compute" and norm_dtype="compute": no float32 array of vocabulary width, no float32
  residual stream ([b, T, D] or [b T, D]), forward or backward;
- weight_dtype="bfloat16": the params, their gradients (in the weight dtype already in the twins'
  synchronisation: tests/test_gradient_bytes.py) and the optimizer's moments are bf16, and one train
  step returns the state in the types it was given, under AdamW, Lion, SGD and Adafactor;
- all in the unrolled stack, the chunked loss, and the manual, GSPMD and Explicit twins;
- float32 stays float32 under JAX's 64-bit mode: no float64 in the state or the step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import auto_parallel
import explicit_parallel
import manual_parallel
from runners import CFG, MESHES
from traced import _equations
from twinshard.config import Config
from twinshard.train import optim
from twinshard.train.trainer import SingleDevice

NARROW = dataclasses.replace(CFG.model, dtype="bfloat16", weight_dtype="bfloat16", logits_dtype="compute",
                             norm_dtype="compute")
# name -> (model config, runner maker); single device's scanned stack: tests/test_speed_options.py
PATHS = {
    "single unrolled": (dataclasses.replace(NARROW, scan_unroll=NARROW.num_layers),
                        lambda cfg: SingleDevice(cfg.model, cfg.train)),
    "single chunked loss": (dataclasses.replace(NARROW, loss_chunks=2), lambda cfg: SingleDevice(cfg.model, cfg.train)),
    "manual fsdp": (NARROW, lambda cfg: manual_parallel.make_runner("fsdp", MESHES["fsdp"], cfg)),
    "auto fsdp": (NARROW, lambda cfg: auto_parallel.make_runner("fsdp", MESHES["fsdp"], cfg)),
    "explicit fsdp": (NARROW, lambda cfg: explicit_parallel.make_runner("fsdp", MESHES["fsdp"], cfg)),
}


def tokens(runner, cfg: Config) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), jnp.int32,
                                sharding=getattr(runner, "batch_sharding", None))


@functools.cache
def traced(path: str):
    """(cfg, runner, abstract state, the jaxpr of loss_and_grads) of one path, traced once."""
    model, make = PATHS[path]
    cfg = Config(model, CFG.train)
    runner = make(cfg)
    state = runner.abstract_state()
    x = tokens(runner, cfg)
    return cfg, runner, state, jax.make_jaxpr(runner.loss_and_grads)(state.params, x, x)


def float32_shapes(closed, keep) -> set[tuple[int, ...]]:
    return {tuple(v.aval.shape) for e in _equations(closed.jaxpr) for v in e.outvars
            if getattr(v.aval, "dtype", None) == jnp.float32 and keep(tuple(v.aval.shape))}


@pytest.mark.parametrize("path", PATHS)
def test_compute_logits_and_norms_leave_no_float32_array_of_vocab_or_model_width(path: str) -> None:
    cfg, runner, _, closed = traced(path)
    m, devices = cfg.model, len(getattr(runner, "mesh", None).devices.flat) if hasattr(runner, "mesh") else 1
    rows = {cfg.train.batch_size, cfg.train.batch_size // devices}  # the whole batch, or a device's
    stream = {(b, m.context_length, m.d_model) for b in rows} | {(b * m.context_length, m.d_model) for b in rows}
    vocab = lambda s: len(s) >= 2 and s[-1] == m.padded_vocab_size and s != (m.d_model, m.padded_vocab_size)  # noqa: E731
    assert float32_shapes(closed, vocab) == set()
    assert float32_shapes(closed, lambda s: s in stream) == set()


@pytest.mark.parametrize("path", PATHS)
def test_bf16_compute_multiplies_every_flat_matmul_in_bf16(path: str) -> None:
    """The layers' projections, the LM head and their gradients: dot_generals without batch dims (the
    attention kernel's batched ones accumulate in float32 by design: test_promised_dtypes)."""
    closed = traced(path)[3]
    flat = [e for e in _equations(closed.jaxpr) if e.primitive.name == "dot_general"
            and not e.params["dimension_numbers"][1][0]]
    assert len(flat) >= 3 * 7, len(flat)  # 7 projections a layer, forward, dx and dW
    wrong = {tuple(str(v.aval.dtype) for v in e.invars) for e in flat} - {("bfloat16", "bfloat16")}
    assert not wrong, wrong


@pytest.mark.parametrize("path", PATHS)
def test_gradients_and_moments_are_in_the_weight_dtype_and_a_step_keeps_the_states_types(path: str) -> None:
    cfg, runner, state, closed = traced(path)
    loss, *grads = closed.out_avals
    assert loss.dtype == jnp.float32 and {str(g.dtype) for g in grads} == {"bfloat16"}
    floats = {str(a.dtype) for a in jax.tree.leaves((state.params, state.opt_state)) if a.ndim}
    assert floats == {"bfloat16"}  # params, AdamW's mu and nu
    x = tokens(runner, cfg)
    new, _ = jax.eval_shape(runner.train_step, state, x, x)
    assert jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, state)


@pytest.mark.parametrize("optimizer", ["adamw", "lion", "sgd", "adafactor"])
def test_every_optimizers_state_keeps_bf16_weights_types_through_a_step(optimizer: str) -> None:
    """Two micro-batches: their gradients leave the float32 accumulator in the weight dtype, and
    optim.in_param_dtypes keeps any other in it (optax returned lion's and sgd's moments float32 from
    float32 gradients)."""
    cfg = Config(dataclasses.replace(CFG.model, weight_dtype="bfloat16"),
                 dataclasses.replace(CFG.train, optimizer=optimizer, grad_accum=2))
    runner = SingleDevice(cfg.model, cfg.train)
    state = runner.abstract_state()
    assert {str(a.dtype) for a in jax.tree.leaves(state.params)} == {"bfloat16"}
    x = tokens(runner, cfg)
    new, _ = jax.eval_shape(runner.train_step, state, x, x)
    assert jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, state)
    moments = {str(a.dtype) for a in jax.tree.leaves(new.opt_state) if a.ndim and jnp.issubdtype(a.dtype, jnp.floating)}
    assert moments <= {"bfloat16"} and (moments or optimizer == "sgd"), moments


def test_adafactors_factored_moments_keep_the_weight_dtype() -> None:
    """A matrix of 256 x 384 (each side >= optim.MIN_DIM_SIZE_TO_FACTOR) keeps row and column moments;
    tiny's matrices, below it, one full moment each (the test above)."""
    assert min(256, 384) >= optim.MIN_DIM_SIZE_TO_FACTOR
    params = {"w": jnp.ones((256, 384), jnp.bfloat16), "gain": jnp.ones((384,), jnp.bfloat16)}
    tx = optim.scale_by_factored_rms()
    state = jax.eval_shape(tx.init, params)
    _, new = jax.eval_shape(tx.update, params, state, params)
    assert jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, state)
    assert {str(a.dtype) for a in jax.tree.leaves((new.v_row["w"], new.v_col["w"], new.v["gain"]))} == {"bfloat16"}
    assert (new.v_row["w"].shape, new.v_col["w"].shape) == ((256,), (384,))


def test_float32_stays_float32_under_jaxs_64_bit_mode() -> None:
    """The default config's state and step under jax_enable_x64 (and the highest matmul precision):
    no float64 or int64 anywhere, the state returned in the types given, the loss float32."""
    with jax.enable_x64(True), jax.default_matmul_precision("highest"):
        runner = SingleDevice(CFG.model, CFG.train)
        state = runner.abstract_state()
        x = tokens(runner, CFG)
        new, metrics = jax.eval_shape(runner.train_step, state, x, x)
    assert {str(a.dtype) for a in jax.tree.leaves(state)} == {"float32", "int32"}
    assert jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, state)
    assert {k: str(v.dtype) for k, v in metrics.items()} == {"grad_norm": "float32", "loss": "float32",
                                                             "lr": "float32", "skipped": "int32"}
    assert np.dtype(CFG.model.dtype) == np.float32 and CFG.model.weight_dtype == "float32"
