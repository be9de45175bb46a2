"""int8 (twinshard/model/quantize.py) at its numeric edges, against NumPy in float64, and under every
way its token axes can be laid over a mesh.

- `quantized`: an all-zero channel quantizes to 0 with a finite scale (no NaN or inf anywhere after);
  a value at the channel's absmax maps to +-127 and never to -128, whichever sign holds the absmax;
  ties round half to even (np.round); each channel has its own scale over the reduced axes; bf16
  inputs round as their float64 values do;
- the forward, dx and dW of an int8_dw product are the same whether the tokens lie on one device or
  are split over data, context, both (either order) or the sequence alone: dW's absmax is a pmax over
  the axes `splitting_tokens` names, and each manual runner names exactly the axes its batch is split
  over.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import manual_parallel
from runners import CFG
from twinshard.config import Config
from twinshard.model import matmuls, quantize
from twinshard.parallel import support


def reference_int8(v: np.ndarray, reduce: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) in float64: scale = absmax / 127 over `reduce` (1 where the channel is all zero),
    q = round half to even of v / scale."""
    absmax = np.abs(v.astype(np.float64)).max(axis=reduce, keepdims=True)
    scale = np.where(absmax > 0, absmax / 127, 1.0)
    return np.round(v.astype(np.float64) / scale), scale


@functools.partial(jax.jit, static_argnums=1)
def _quantized(v, reduce: tuple[int, ...]):
    return quantize.quantized(v, reduce)  # jitted: one compile, not one per eager op


def q_and_scale(v, reduce: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    q = _quantized(jnp.asarray(v), reduce)
    assert q.qvalue.dtype == jnp.int8 and q.scale.dtype == jnp.float32
    return np.asarray(q.qvalue), np.asarray(q.scale)


def test_an_all_zero_channel_quantizes_to_zero_with_a_finite_scale() -> None:
    w = np.array([[0.0, 1.0, 0.0], [0.0, -2.0, 0.0], [0.0, 0.5, 0.0]], np.float32)  # columns 0 and 2 zero
    for v, reduce in ((w, (0,)), (w.T.copy(), (1,))):  # per column over rows; per row over columns
        q, s = q_and_scale(v, reduce)
        want_q, want_s = reference_int8(v, reduce)
        assert np.array_equal(q, want_q) and np.allclose(s, want_s) and np.isfinite(s).all()
        zero = (slice(None), [0, 2]) if reduce == (0,) else ([0, 2], slice(None))
        assert not q[zero].any() and (s[zero] == 1.0).all()  # the documented scale of an all-zero channel
    x = np.zeros((4, 3), np.float32)  # an all-zero row of activations, forward and back, dW rounded too
    y, dx, dw = jax.jit(int8_dw_product)(x, w, np.ones((4, 3), np.float32))
    assert all(np.isfinite(a).all() for a in (y, dx, dw)) and not np.asarray(y).any() and not np.asarray(dw).any()
    np.testing.assert_allclose(dx, np.ones((4, 3)) @ w.T, rtol=1e-2)  # g s_w rounded: dx is g w^T to 1/127


@pytest.mark.parametrize("sign", [+1.0, -1.0])
def test_the_absmax_maps_to_127_of_its_sign_and_nothing_to_minus_128(sign: float) -> None:
    """Columns whose absmax is 127 (scale 1 exactly, so float32 divides as float64 does)."""
    rng = np.random.default_rng(1)
    v = np.round(rng.uniform(-120, 120, size=(64, 8)), 2).astype(np.float32)
    v[5, :] = sign * 127.0  # each column's absmax, on the side of `sign`
    v[6, :] = -sign * 126.5  # the other side, a tie: half to even, 126
    v[7, :] = -sign * 126.75
    q, s = q_and_scale(v, (0,))
    assert (s == 1.0).all() and (q[5] == sign * 127).all() and (q[6] == -sign * 126).all()
    assert (q[7] == -sign * 127).all() and q.min() >= -127 and q.max() <= 127
    assert np.array_equal(q, reference_int8(v, (0,))[0])
    x = (v / 64).astype(np.float32)  # the same column at absmax 127/64: its scale 1/64, q unchanged
    q_x, s_x = q_and_scale(x, (0,))
    assert np.array_equal(q_x, q) and (s_x == 1 / 64).all()


def test_ties_round_half_to_even() -> None:
    """absmax 127 gives scale 1 exactly, so v / s is v: each x.5 rounds to the even integer."""
    v = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]], np.float32)
    q, s = q_and_scale(v, (1,))
    assert s.tolist() == [[1.0]] and q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]]
    assert q.tolist() == reference_int8(v, (1,))[0].tolist()


@pytest.mark.parametrize("reduce", [(0,), (1,), (0, 1)])
def test_each_channel_has_its_own_scale_over_the_reduced_axes(reduce) -> None:
    """Channels 2^k apart in magnitude: one scale for all would quantize the small ones to a few values."""
    rng = np.random.default_rng(2)
    v = (rng.normal(size=(3, 16, 12)) * 2.0 ** np.arange(12)).astype(np.float32)
    reduce3 = tuple(a + 1 for a in reduce)  # the leading axis of 3 is a channel axis too
    q, s = q_and_scale(v, reduce3)
    want_q, want_s = reference_int8(v, reduce3)
    assert s.shape == want_s.shape and np.allclose(s, want_s, rtol=1e-7)
    assert np.abs(q - want_q).max() <= 1 and np.mean(q == want_q) > 0.99
    assert np.abs(q).max(axis=reduce3).min() == 127  # every channel reaches its own 127


def test_bf16_inputs_round_as_their_float64_values() -> None:
    rng = np.random.default_rng(3)
    v = jnp.asarray(rng.normal(size=(32, 16)) * 2.0 ** np.arange(16), jnp.bfloat16)
    q, s = q_and_scale(v, (0,))
    want_q, want_s = reference_int8(np.asarray(v.astype(jnp.float32)), (0,))
    np.testing.assert_allclose(s, want_s, rtol=1e-7)  # absmax of bf16 values is exact; its scale float32
    assert np.abs(q - want_q).max() <= 1 and np.mean(q == want_q) > 0.99
    y = jax.jit(matmuls.matmul, static_argnums=2)(v, v.T[:, :8], "int8")
    assert y.dtype == jnp.bfloat16  # the product returns in its input's dtype


# ----------------------------------------------------------------------------- token layouts

B, T, IN, OUT = 8, 8, 16, 24
# every way the code lays [B, T] tokens over a data:2 x context:4 mesh (batch: data; sequence: context)
LAYOUTS = {"data": P("data", None), "context": P(None, "context"), "data and context": P("data", "context"),
           "batch over both": P(("data", "context"), None), "sequence over both": P(None, ("data", "context"))}


def int8_dw_product(x, w, g, over: tuple[str, ...] = ()):
    """y, dx, dW of int8_dw's x [.., IN] @ w [IN, OUT] with cotangent g [.., OUT]."""
    y, vjp = jax.vjp(lambda x, w: matmuls.matmul(x, w, "int8_dw", over), x, w)
    return (y, *vjp(g))


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(4)
    scale = 2.0 ** (np.arange(B * T) % 5).reshape(B, T, 1)  # tokens of different magnitude: the absmax moves
    return ((rng.normal(size=(B, T, IN)) * scale).astype(np.float32), rng.normal(size=(IN, OUT)).astype(np.float32),
            (rng.normal(size=(B, T, OUT)) * scale[::-1]).astype(np.float32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_dw_is_the_same_product_however_the_tokens_are_split(operands, layout: str) -> None:
    """dW's absmax over every token (a pmax over the axes splitting them) makes each layout's y, dx and
    dW those of one device: y and dx per token are exact; dW's float32 partial sums add in another order.
    Each device's own absmax (no pmax) is off by 1e-4 to 1e-2 of dW's largest entry."""
    x, w, g = operands
    want = [np.asarray(a) for a in jax.jit(int8_dw_product)(x, w, g)]
    mesh = jax.make_mesh((2, 4), ("data", "context"))
    spec = LAYOUTS[layout]
    over = tuple(a for a in ("data", "context") if a in jax.tree.leaves(tuple(spec)))
    fn = jax.jit(jax.shard_map(lambda x, w, g: int8_dw_product(x, w, g, over), mesh=mesh,
                               in_specs=(spec, P(), spec), out_specs=(spec, spec, P())))
    place = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    got = [np.asarray(a) for a in fn(place(x, spec), place(w, P()), place(g, spec))]
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert np.abs(got[2] - want[2]).max() <= 1e-6 * np.abs(want[2]).max()


def test_each_manual_runner_names_the_axes_its_tokens_are_split_over() -> None:
    """ManualRunner.token_axes (the pmax of int8_dw's absmax) is every mesh axis of size > 1 in its
    batch's PartitionSpec, for each strategy int8 runs under, on a mesh where each axis is split."""
    cfg = Config(dataclasses.replace(CFG.model, quantization="int8_dw"), CFG.train)
    meshes = {"fsdp": "data:8,tensor:1", "cp": "context:8", "ulysses": "context:8",
              "fsdp_cp": "data:2,context:4", "fsdp_ulysses": "data:2,context:4"}  # dp's axes are fsdp's
    assert set(meshes) <= set(support.SUPPORT)
    for strategy, mesh in meshes.items():
        r = manual_parallel.make_runner(strategy, mesh, cfg)
        split = tuple(a for a in jax.tree.leaves(tuple(r.batch_spec)) if r.mesh.shape[a] > 1)
        assert sorted(r.token_axes) == sorted(split) and r.token_axes, (strategy, r.token_axes, r.batch_spec)
