"""The attention seam: the recompute kernel and jax.nn.dot_product_attention against the readable reference.

`ModelConfig.attention` picks `layers.causal_attention`'s implementation:
'reference' (layers.scaled_dot_product_attention + causal_mask, the spec),
'recompute' (layers.recompute_attention: its backward keeps o and the log-sum-exp and
recomputes the probabilities, so no [T, T] array is saved), 'xla'
(jax.nn.dot_product_attention, any backend), 'cudnn' (GPU only; checked against the
reference by tools/gpu_bench.sh on a device) or 'auto' (the default: cudnn on a GPU in
bf16, recompute elsewhere). Under Megatron TP each device runs the kernel on its own
H/tensor heads, unchanged.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twinshard.model import layers
from twinshard.config import Config, preset

import reference as ref
from runners import CFG, loss_and_grads, twin_runner

BASE = preset("tiny")


def test_the_model_runs_the_configured_kernel():
    from twinshard.train import trainer

    def jaxpr(attention):
        cfg = dataclasses.replace(BASE.model, attention=attention)
        params = jax.eval_shape(functools.partial(trainer.create_params, cfg, 0))
        x = jax.ShapeDtypeStruct((2, 8), jnp.int32)
        return str(jax.make_jaxpr(functools.partial(trainer.loss_fn, cfg=cfg))(params, x, x))

    assert jaxpr("xla") != jaxpr("reference")


def config(attention: str) -> Config:
    """tests/runners.py's CFG with `attention`: its 'recompute' programs are CFG's (auto is recompute on
    CPU), shared with the other twin tests through the persistent compilation cache."""
    return Config(dataclasses.replace(CFG.model, attention=attention), CFG.train)


@functools.cache
def _run(name: str, attention: str) -> dict:
    """Loss and gradients of runner `name` ('single', 'manual tp') with the `attention` kernel, compiled once."""
    return loss_and_grads(twin_runner(name, config(attention)), config(attention))


@pytest.mark.parametrize("impl", ["xla", "recompute"])
def test_model_with_a_kernel_equals_the_reference_single_device_and_under_tp(impl):
    """Loss and gradients of the whole model: reference vs the kernel on one device, and the
    kernel inside the manual TP twin (each device attends over its own heads)."""
    want = _run("single", "reference")
    for name in ("single", "manual tp"):
        got = _run(name, impl)
        assert abs(got["loss"] - want["loss"]) < 2e-5, name
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(got["grads"]),
                                                                 jax.tree.leaves(want["grads"])))
        assert diff < 2e-7, (name, diff)  # the tolerance of tests/test_data_tensor.py (GRAD_ATOL)


@pytest.mark.parametrize("impl", ["xla", "recompute", "auto"])
def test_fused_attention_matches_the_reference(impl):
    """jax.nn.dot_product_attention (XLA here; cuDNN flash attention on a GPU in bf16,
    checked by tools/gpu_bench.sh) and layers.recompute_attention against the readable
    scaled_dot_product_attention. Measured (f32, [2, 4, 32, 16]): xla's outputs 4.8e-7
    apart, gradients 7.2e-7; recompute's 2.4e-7 and 9.5e-7 ([2, 4, 64, 16])."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 4, 32, 16)), jnp.float32) for _ in range(3))
    got, want = layers.causal_attention(q, k, v, impl), layers.causal_attention(q, k, v, "reference")
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-6)
    np.testing.assert_allclose(want, ref.attention(np.asarray(q, np.float64), np.asarray(k, np.float64),
                                                   np.asarray(v, np.float64), np.tril(np.ones((32, 32), bool))),
                               rtol=2e-5, atol=2e-5)

    def grads(i):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(layers.causal_attention(*a, i))), argnums=(0, 1, 2))(q, k, v)

    for a, b in zip(grads(impl), grads("reference")):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-6)


def test_recompute_attention_in_bf16_is_as_close_to_float64_as_the_reference():
    """bf16 q, k, v (--dtype=bfloat16): recompute's scores accumulate in f32 and its softmax
    statistics stay f32, so its outputs and gradients are no further from the float64
    attention than the reference's (which rounds q k^T to bf16 before its f32 softmax).
    Measured ([2, 4, 64, 16]): output max errors 6.2e-3 (recompute), 9.4e-3 (reference),
    1.1e-2 (xla); bf16 gradients 1.7e-2 from autodiff in float64 (xla: 1.7e-2, reference:
    1.4e-2), bf16's resolution on values of order 1."""
    rng = np.random.default_rng(3)
    q64, k64, v64, g64 = (rng.normal(size=(2, 4, 64, 16)) for _ in range(4))
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (q64, k64, v64))
    exact = lambda *a: ref.attention(*(np.asarray(x, np.float64) for x in a), np.tril(np.ones((64, 64), bool)))  # noqa: E731
    want = exact(q, k, v)  # float64 attention of the bf16-rounded inputs
    err = {i: float(np.max(np.abs(np.asarray(layers.causal_attention(q, k, v, i), np.float64) - want)))
           for i in ("recompute", "reference")}
    assert err["recompute"] <= err["reference"] and err["recompute"] < 2e-2, err
    with jax.enable_x64():
        grads64 = jax.grad(lambda *a: jnp.sum(layers.causal_attention(*a, "reference") * g64),
                           argnums=(0, 1, 2))(*(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)))
    got = jax.grad(lambda *a: jnp.sum(layers.causal_attention(*a, "recompute").astype(jnp.float32) * g64),
                   argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, grads64):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b), rtol=0, atol=5e-2)


def test_recompute_attention_saves_no_score_sized_array():
    """What the backward pass keeps: the reference (autodiff) saves [B, h, T, T] arrays (the
    masked scores and the probabilities); recompute_attention keeps q, k, v, o [B, h, T, dh]
    and the log-sum-exp [B, h, T, 1], nothing with a T x T tail."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    qkv = [jax.ShapeDtypeStruct((2, 4, 64, 16), jnp.float32)] * 3

    def saved(impl):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            print_saved_residuals(lambda *a: jnp.sum(layers.causal_attention(*a, impl)), *qkv)
        return text.getvalue()

    assert "[2,4,64,64]" in saved("reference")
    kept = saved("recompute")
    assert "[2,4,64,64]" not in kept and "f32[2,4,64,1]" in kept, kept


def test_recompute_attention_masks_by_true_positions():
    """positions (context parallelism's zig-zag order): key j is seen by query i iff
    positions[j] <= positions[i]; values and gradients equal the reference under that mask,
    and positions = arange(T) is the causal kernel."""
    from twinshard.parallel import context

    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 4, 16, 8)), jnp.float32) for _ in range(3))
    order = context.order(16, 2, "zigzag")  # [0..3, 12..15, 4..7, 8..11]
    assert list(order) != list(range(16))
    keep = layers.visible(order, order)
    got = layers.recompute_attention(q, k, v, tuple(int(i) for i in order))
    want = layers.scaled_dot_product_attention(q, k, v, jnp.asarray(keep))
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-6)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    g_got = jax.grad(loss(lambda *a: layers.recompute_attention(*a, tuple(int(i) for i in order))), (0, 1, 2))(q, k, v)
    g_want = jax.grad(loss(lambda *a: layers.scaled_dot_product_attention(*a, jnp.asarray(keep))), (0, 1, 2))(q, k, v)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-6)
    np.testing.assert_array_equal(layers.recompute_attention(q, k, v, tuple(range(16))),
                                  layers.recompute_attention(q, k, v))


# ----------------------------------------------------------------------------- large logits
# Scores of about +-100 (reference.large_logits: row maxima that differ per query and per block of
# keys): exp of an unshifted score overflows float32 (exp(88.7) is its largest value), so a softmax
# that forgets to subtract its max returns inf / nan here, where N(0, 1) scores hide it.
LARGE = (2, 2, 32, 8)
CAUSAL = np.tril(np.ones((LARGE[2], LARGE[2]), bool))


@functools.cache
def large_case():
    """q, k, v, the output cotangent, and NumPy float64's output and (dq, dk, dv) at large logits."""
    rng = np.random.default_rng(7)
    q, k, v = ref.large_logits(rng, LARGE)
    do = rng.normal(size=LARGE)
    return (q, k, v, do), ref.attention_vjp(q, k, v, CAUSAL, do)


def _vjp(impl, dtype, q, k, v, do):
    out, pullback = jax.vjp(lambda *a: layers.causal_attention(*a, impl), *(jnp.asarray(x, dtype) for x in (q, k, v)))
    return np.asarray(out, np.float64), [np.asarray(g, np.float64) for g in pullback(jnp.asarray(do, dtype))]


def _relative(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("impl", ["reference", "recompute", "xla"])
def test_attention_at_large_logits_equals_float64(impl):
    """float32 at scores of +-110: outputs and gradients equal NumPy float64. A float32 score of
    size 100 carries an absolute rounding of ~100 x 2^-24 = 6e-6, which is the relative error
    it gives its probability: measured max errors 1.1e-5 (outputs, |v| ~ 1) and 6e-6 of the
    largest gradient (recompute; reference and xla 4.3e-6). Tolerances ~5-10x."""
    (q, k, v, do), (want, want_grads) = large_case()
    scores = np.where(CAUSAL, q @ np.swapaxes(k, -1, -2) / np.sqrt(LARGE[-1]), np.nan)
    assert np.nanmax(scores) > 100 and np.nanmin(np.nanmax(scores, axis=-1)) < -90  # the premise
    got, grads = _vjp(impl, jnp.float32, q, k, v, do)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    for name, g, w in zip("qkv", grads, want_grads):
        assert _relative(g, w) < 5e-5, (name, _relative(g, w))


def test_recompute_backward_in_bf16_at_large_logits():
    """bf16 q, k, v, do at scores of +-110, against NumPy float64 on the same bf16-rounded values.

    1. No further from float64 than the reference kernel: dk and dv (measured max errors 0.9%
       and 0.16% of the largest gradient; the reference's 6.7% and 1.3%: it rounds q k^T to
       bf16 before its softmax, 2^-9 x 100 = 0.2 of a score). dq with a slack of 2: both
       kernels round d(q k^T) to bf16 before its product with k, whose rows share a large
       component (the scores' common direction) that the exact sum_k ds_qk = 0 cancels and the
       rounded ds does not: the same error in both, measured 10.3% (recompute) vs 6.4%.
    2. The rows whose softmax is one-hot (~40% here: a score ~100 above the rest): the exact
       gradient of q is 0 (ds = p (dp - do.o) with o = v of the one key), and the kernel's
       float32 dp and do.o are sums of the same bf16 products: measured |dq| 1e-15 of
       |do| max|v| max|k| / sqrt(dh). Either term rounded to bf16 leaves 2^-9 of it (1e-3)."""
    (q, k, v, do), _ = large_case()
    q, k, v, do = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (q, k, v, do))
    _, want = ref.attention_vjp(q, k, v, CAUSAL, do)
    grads = {impl: _vjp(impl, jnp.bfloat16, q, k, v, do)[1] for impl in ("recompute", "reference")}
    err = {impl: [_relative(g, w) for g, w in zip(gs, want)] for impl, gs in grads.items()}
    (dq, dk, dv), (ref_dq, ref_dk, ref_dv) = err["recompute"], err["reference"]
    assert dk <= ref_dk and dv <= ref_dv and dq <= 2 * ref_dq, err
    scores = np.where(CAUSAL, q @ np.swapaxes(k, -1, -2) / np.sqrt(LARGE[-1]), -np.inf)
    one_hot = ref.softmax(scores).max(axis=-1) > 1 - 1e-15
    assert one_hot.sum() > 0.3 * one_hot.size  # the premise
    got_dq = grads["recompute"][0]
    scale = np.linalg.norm(do, axis=-1) * np.abs(v).max() * np.abs(k).max() / np.sqrt(LARGE[-1])
    assert np.max(np.linalg.norm(got_dq, axis=-1)[one_hot] / scale[one_hot]) < 1e-6
