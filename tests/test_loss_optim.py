"""Loss, schedule and optimizer against their formulas."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import reference as ref
from twinshard.config import TrainConfig
from twinshard.model.loss import cross_entropy, token_cross_entropy
from twinshard.train.optim import clip_and_guard, cosine_lr, lr_schedule, make_optimizer


def test_cross_entropy_matches_reference_and_masks_padding():
    rng = np.random.default_rng(0)
    logits, targets = rng.normal(size=(2, 5, 20)) * 3, rng.integers(0, 17, (2, 5))
    got = cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), vocab_size=17)
    np.testing.assert_allclose(got, ref.cross_entropy(logits[..., :17], targets), rtol=1e-6)


def test_cross_entropy_finite_at_huge_logits():
    rng = np.random.default_rng(1)
    logits, targets = rng.normal(size=(4, 50)) * 1000, rng.integers(0, 50, 4)
    got = float(cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), 50))
    assert np.isfinite(got)
    np.testing.assert_allclose(got, ref.cross_entropy(logits, targets), rtol=1e-5)
    g = jax.grad(lambda z: cross_entropy(z, jnp.asarray(targets), 50))(jnp.asarray(logits, jnp.float32))
    assert np.isfinite(np.asarray(g)).all()


def test_vocab_sharded_statistics_equal_full_loss():
    """Splitting the vocab and summing statistics over shards gives the same loss
    (the decomposition the manual TP twin runs with pmax/psum)."""
    rng = np.random.default_rng(2)
    logits, targets = jnp.asarray(rng.normal(size=(3, 7, 24)), jnp.float32), jnp.asarray(rng.integers(0, 21, (3, 7)))
    full = token_cross_entropy(logits, targets, 21)
    shards = jnp.split(logits, 4, axis=-1)  # 4 shards of 6 columns; the last holds 3 padded ids
    gmax = jnp.max(jnp.stack([jnp.max(jnp.where(6 * i + jnp.arange(6) < 21, s, -jnp.inf), -1)
                              for i, s in enumerate(shards)]), 0)
    total = lambda fn: sum(fn(s, 6 * i) for i, s in enumerate(shards))  # noqa: E731
    s_exp = total(lambda s, o: jnp.sum(jnp.exp(jnp.where(o + jnp.arange(6) < 21, s, -jnp.inf) - gmax[..., None]), -1))
    z_y = total(lambda s, o: jnp.where((targets >= o) & (targets < o + 6),
                                       jnp.take_along_axis(s, jnp.clip(targets - o, 0, 5)[..., None], -1)[..., 0], 0))
    np.testing.assert_allclose(gmax + jnp.log(s_exp) - z_y, full, rtol=1e-6)


@pytest.mark.parametrize("t", [0, 1, 5, 9, 10, 11, 50, 99, 100, 101, 150])
def test_schedule_is_cs336_formula(t):
    got = float(cosine_lr(t, 1e-3, 1e-4, 10, 100))
    assert got == pytest.approx(ref.cs336_lr(t, 1e-3, 1e-4, 10, 100), rel=1e-6, abs=1e-12)


def test_lr_schedule_uses_train_config():
    cfg = TrainConfig(lr=2.0, min_lr=0.5, warmup_steps=4, steps=20)
    sched = lr_schedule(cfg)
    assert [round(float(sched(t)), 6) for t in (0, 2, 4, 20, 30)] == [0.0, 1.0, 2.0, 0.5, 0.5]


def _adamw_numpy(p, grads, lr_at, b1, b2, eps, wd):
    """AdamW (Loshchilov & Hutter), as in the CS336 handout, in float64."""
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        a = lr_at(t - 1) * np.sqrt(1 - b2**t) / (1 - b1**t)
        p = p - a * m / (np.sqrt(v) + eps * np.sqrt(1 - b2**t)) - lr_at(t - 1) * wd * p
    return p


@pytest.mark.parametrize("eps", [1e-8, 0.5])  # 0.5: not optax's default, and large enough to matter
def test_adamw_matches_handout_formula(eps):
    cfg = TrainConfig(lr=0.1, min_lr=0.01, warmup_steps=2, steps=6, grad_clip=0.0,
                      weight_decay=0.1, beta1=0.9, beta2=0.95, eps=eps)
    rng = np.random.default_rng(3)
    p0, grads = rng.normal(size=(5,)), [rng.normal(size=(5,)) for _ in range(6)]
    tx = make_optimizer(cfg)
    p, state = jnp.asarray(p0, jnp.float32), tx.init(jnp.asarray(p0, jnp.float32))
    for g in grads:
        u, state = tx.update(jnp.asarray(g, jnp.float32), state, p)
        p = optax.apply_updates(p, u)
    lr_at = lambda t: ref.cs336_lr(t, 0.1, 0.01, 2, 6)  # noqa: E731
    # optax puts eps outside the bias correction: eps_hat = eps * sqrt(1 - b2^t) in the handout's form
    want = _adamw_numpy(p0, grads, lr_at, 0.9, 0.95, eps, 0.1)
    np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_global_norm_clipping(skip_nonfinite):
    """The update is clipped to norm 1; the reported grad_norm is the norm BEFORE clipping
    (both code paths: with and without the non-finite guard)."""
    tx = clip_and_guard(optax.identity(), max_norm=1.0, skip_nonfinite=skip_nonfinite)
    g = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}  # norm 5
    u, state = tx.update(g, tx.init(g))
    assert float(optax.tree.norm(u)) == pytest.approx(1.0, rel=1e-5)
    assert float(state.grad_norm) == pytest.approx(5.0)
    small = jax.tree.map(lambda x: x / 10, g)  # norm 0.5: unchanged
    u, _ = tx.update(small, tx.init(g))
    np.testing.assert_allclose(u["a"], small["a"], rtol=1e-5)


def test_nonfinite_updates_are_skipped_and_counted():
    cfg = dataclasses.replace(TrainConfig(), lr=0.1, warmup_steps=0, skip_nonfinite=True)
    tx = make_optimizer(cfg)
    p = jnp.ones(3)
    state = tx.init(p)
    u, state = tx.update(jnp.array([1.0, jnp.nan, 0.0]), state, p)
    np.testing.assert_array_equal(u, 0.0)
    assert int(state.skipped) == 1
    u, state2 = tx.update(jnp.array([1.0, 2.0, jnp.inf]), state, p)
    assert int(state2.skipped) == 2
    jax.tree.map(np.testing.assert_array_equal, state2.inner, state.inner)  # moments untouched
    u, state3 = tx.update(jnp.ones(3), state2, p)
    assert int(state3.skipped) == 2 and np.isfinite(np.asarray(u)).all() and np.abs(np.asarray(u)).sum() > 0


def test_reported_lr_follows_applied_updates_after_a_skip():
    """A skipped (non-finite) update does not advance optax's count, so the schedule
    runs on applied updates; the reported lr is the one the update used."""
    from twinshard.train.trainer import TrainState, apply_gradients

    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4, steps=10, grad_clip=0.0)
    tx = make_optimizer(cfg)
    params = {"w": jnp.ones(2)}
    state = TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    lrs = []
    for g in ([jnp.nan, 1.0], [1.0, 1.0], [1.0, 1.0]):
        state, m = apply_gradients(state, {"w": jnp.array(g)}, tx, cfg)
        lrs.append(float(m["lr"]))
    assert lrs == [0.0, 0.0, 0.25] and int(m["skipped"]) == 1 and int(state.step) == 3
