"""Every layer against the NumPy float64 reference (tests/reference.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import reference as ref
from twinshard.model import layers, matmuls

RTOL, ATOL = 2e-5, 2e-5  # float32 vs float64 on O(1) values


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def f32(a):
    return jnp.asarray(a, jnp.float32)


def test_linear_stores_in_out(rng):
    x, w = rng.normal(size=(2, 3, 5)), rng.normal(size=(5, 7))  # w: [in, out]
    np.testing.assert_allclose(layers.linear(f32(x), f32(w)), ref.linear(x, w.T), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_gradients(rng, dtype):
    """matmuls.matmul's own backward (dW = x^T g in one dot) against float64: dx = g W^T, dW = x^T g,
    each in its primal's dtype; the flat 2-D path and the batched einsum agree."""
    x, w, g = rng.normal(size=(2, 3, 5)), rng.normal(size=(5, 7)), rng.normal(size=(2, 3, 7))
    tol = dict(rtol=RTOL, atol=ATOL) if dtype == jnp.float32 else dict(rtol=2e-2, atol=5e-2)
    for flat in (True, False):
        y, vjp = jax.vjp(lambda a, b: layers.linear(a, b, flat), jnp.asarray(x, dtype), jnp.asarray(w, dtype))
        dx, dw = vjp(jnp.asarray(g, dtype))
        assert (y.dtype, dx.dtype, dw.dtype) == (dtype,) * 3
        np.testing.assert_allclose(np.float64(dx), g @ w.T, **tol)
        np.testing.assert_allclose(np.float64(dw), np.einsum("bti,bto->io", x, g), **tol)


def test_custom_backwards_sum_like_autodiff_inside_shard_map(rng):
    """matmuls.matmul and layers.swiglu_gate inside shard_map (check_vma): a weight and a gate
    input invariant over `data` meet activations that vary over it. Their gradients equal
    autodiff's of the plain expressions, which psum over `data` (matmuls.cotangent_like); a
    custom backward without it made JAX reject the program instead."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    x, w, h3 = rng.normal(size=(4, 3)), rng.normal(size=(3, 5)), rng.normal(size=(2, 5))

    def grads(matmul, gate):
        def body(x, w, h3):  # x: [4/data, 3] varies over data; w [3, 5], h3 [2, 5] do not
            return jax.grad(lambda w, h3: jnp.sum(gate(matmul(x, w), h3)), argnums=(0, 1))(w, h3)
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=(P(), P()))(
            f32(x), f32(w), f32(h3))

    got = grads(matmuls.matmul, layers.swiglu_gate)
    want = grads(jnp.dot, lambda h1, h3: layers.silu(h1) * h3)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


def test_embedding(rng):
    table, ids = rng.normal(size=(11, 4)), rng.integers(0, 11, (2, 6))
    np.testing.assert_array_equal(layers.embedding(jnp.asarray(ids), f32(table)), f32(table[ids]))


def test_rms_norm(rng):
    x, g = rng.normal(size=(2, 3, 8)) * 5, rng.normal(size=8)
    np.testing.assert_allclose(layers.rms_norm(f32(x), f32(g), 1e-5), ref.rms_norm(x, g), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_rms_norm_where_eps_matters(rng, eps):
    """Inputs of RMS ~1e-3 (mean square 1e-6, below eps): eps sets the output, so using
    another eps (1e-6, or none) is far outside the tolerance (checked below)."""
    x, g = rng.normal(size=(2, 3, 8)) * 1e-3, rng.normal(size=8)
    got = np.asarray(layers.rms_norm(f32(x), f32(g), eps))
    np.testing.assert_allclose(got, ref.rms_norm(x, g, eps), rtol=RTOL, atol=ATOL * 1e-3)
    for other in (eps / 10, 0.0):
        assert np.max(np.abs(ref.rms_norm(x, g, other) - ref.rms_norm(x, g, eps))) > 100 * ATOL * 1e-3


def test_rms_norm_computes_in_float32():
    x = jnp.full((1, 64), 300.0, jnp.bfloat16)  # x^2 summed overflows nothing in f32
    out = layers.rms_norm(x, jnp.ones(64), 1e-5)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0, rtol=1e-2)


def test_swiglu(rng):
    x = rng.normal(size=(2, 3, 8))
    w1, w3, w2 = rng.normal(size=(8, 16)), rng.normal(size=(8, 16)), rng.normal(size=(16, 8))
    got = layers.swiglu(f32(x), f32(w1), f32(w2), f32(w3))
    np.testing.assert_allclose(got, ref.swiglu(x, w1.T, w2.T, w3.T), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_gate_gradients(rng, dtype):
    """layers.swiglu_gate's own backward (it keeps h1, h3 and recomputes the sigmoid) against
    float64 central differences of ref.silu(h1) * h3 (elementwise, so one perturbation of
    every entry at once), each gradient in its primal's dtype."""
    h1, h3, g = rng.normal(size=(3, 4, 16)) * 3, rng.normal(size=(3, 4, 16)), rng.normal(size=(3, 4, 16))
    eps = 1e-6
    want_h1 = g * h3 * (ref.silu(h1 + eps) - ref.silu(h1 - eps)) / (2 * eps)
    want_h3 = g * ref.silu(h1)
    _, vjp = jax.vjp(layers.swiglu_gate, jnp.asarray(h1, dtype), jnp.asarray(h3, dtype))
    d1, d3 = vjp(jnp.asarray(g, dtype))
    assert (d1.dtype, d3.dtype) == (dtype, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=1e-1)
    np.testing.assert_allclose(np.float64(d1), want_h1, **tol)
    np.testing.assert_allclose(np.float64(d3), want_h3, **tol)


def test_softmax_is_stable_and_matches(rng):
    x = rng.normal(size=(3, 10)) * 1000
    got = layers.softmax(f32(x))
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, ref.softmax(x), rtol=1e-5, atol=1e-6)


def test_rope_matches_pairwise_rotation(rng):
    x = rng.normal(size=(2, 3, 7, 8))
    pos = np.arange(7)
    got = layers.apply_rope(f32(x), jnp.asarray(pos), 10000.0, 16)
    np.testing.assert_allclose(got, ref.rope(x, pos, 10000.0), rtol=RTOL, atol=ATOL)


def test_rope_on_halves_is_rope_on_pairs_permuted(rng):
    """The heads layout's RoPE: features as (evens, odds) halves, each pair's two features dh/2 apart, rotated
    as the NumPy float64 reference rotates the pairs they came from (its output permuted the same way)."""
    perm = layers.evens_then_odds(8)
    assert perm.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    x, pos = rng.normal(size=(2, 3, 7, 8)), np.arange(3, 10)
    got = layers.apply_rope_halves(f32(x[..., perm]), jnp.asarray(pos), 10000.0, 16)
    np.testing.assert_allclose(got, ref.rope(x, pos, 10000.0)[..., perm], rtol=RTOL, atol=ATOL)


def test_rope_preserves_norm_and_relative_position(rng):
    q, k = rng.normal(size=(1, 16)), rng.normal(size=(1, 16))
    rot = lambda v, p: layers.apply_rope(f32(np.repeat(v, 1, 0)), jnp.asarray([p]), 10000.0, 64)  # noqa: E731
    np.testing.assert_allclose(np.linalg.norm(rot(q, 5)), np.linalg.norm(q), rtol=1e-5)
    dot = lambda a, b: float(jnp.sum(rot(q, a) * rot(k, b)))  # noqa: E731
    np.testing.assert_allclose(dot(3, 1), dot(12, 10), rtol=1e-4)


def test_sdpa_respects_mask(rng):
    q, k, v = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 6, 4)), rng.normal(size=(2, 6, 3))
    mask = rng.random((5, 6)) > 0.3
    mask[:, 0] = True  # every query keeps at least one key
    got = layers.scaled_dot_product_attention(f32(q), f32(k), f32(v), jnp.asarray(mask))
    np.testing.assert_allclose(got, ref.attention(q, k, v, mask), rtol=1e-4, atol=1e-5)


ATTENTIONS = ["reference", "recompute", "xla"]  # the readable layer, its recomputing backward, jax.nn's kernel


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_causal_self_attention(rng, attention):
    b, t, d, h = 2, 6, 16, 4
    x = rng.normal(size=(b, t, d))
    wq, wk, wv, wo = (rng.normal(size=(d, d)) / 4 for _ in range(4))  # [in, out]
    got = layers.causal_self_attention(f32(x), f32(wq), f32(wk), f32(wv), f32(wo), d // h, 10000.0, t, attention)
    want = ref.mha(x, wq.T, wk.T, wv.T, wo.T, h, 10000.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_causal_mask():
    np.testing.assert_array_equal(layers.causal_mask(4), np.tril(np.ones((4, 4), bool)))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_causal_attention_ignores_the_future(rng, attention):
    d = 8
    ws = [f32(rng.normal(size=(d, d))) for _ in range(4)]
    x = rng.normal(size=(1, 5, d))
    x2 = x.copy()
    x2[:, 3:] = rng.normal(size=(1, 2, d))  # change only positions 3, 4
    a = layers.causal_self_attention(f32(x), *ws, 4, 10000.0, 5, attention)
    b = layers.causal_self_attention(f32(x2), *ws, 4, 10000.0, 5, attention)
    np.testing.assert_array_equal(a[:, :3], b[:, :3])
    assert not np.allclose(a[:, 3:], b[:, 3:])
