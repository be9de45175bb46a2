"""The attention seam: jax.nn.dot_product_attention against the readable reference.

`ModelConfig.attention` picks `layers.causal_attention`'s implementation:
'reference' (layers.scaled_dot_product_attention + causal_mask, the spec),
'xla' (jax.nn.dot_product_attention, any backend), 'cudnn' (GPU only; checked
against the reference by tools/gpu_bench.sh on a device) or 'auto' (the
default: cudnn on a GPU in bf16, xla elsewhere). Under Megatron TP each device
runs the kernel on its own H/tensor heads, unchanged.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import manual_parallel
from twinshard import layers
from twinshard.config import Config, preset

import reference as ref
from twinshard.trainer import SingleDevice

BASE = preset("tiny")


def test_the_model_runs_the_configured_kernel():
    import functools

    from twinshard import trainer

    def jaxpr(attention):
        cfg = dataclasses.replace(BASE.model, attention=attention)
        params = jax.eval_shape(functools.partial(trainer.create_params, cfg, 0))
        x = jax.ShapeDtypeStruct((2, 8), jnp.int32)
        return str(jax.make_jaxpr(functools.partial(trainer.loss_fn, cfg=cfg))(params, x, x))

    assert jaxpr("xla") != jaxpr("reference")


def _loss_and_grads(runner, cfg):
    rng = np.random.default_rng(1)
    b = rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.context_length + 1)).astype(np.int32)
    state = runner.init_state(0)
    return jax.device_get(runner.loss_and_grads(state.params, *runner.place_batch(b[:, :-1], b[:, 1:])))


def test_model_with_the_xla_kernel_equals_the_reference_single_device_and_under_tp():
    """Loss and gradients of the whole model: reference vs xla kernel on one device, and the
    xla kernel inside the manual TP twin (each device attends over its own heads)."""
    ref_cfg = Config(dataclasses.replace(BASE.model, num_heads=8, attention="reference"), BASE.train)
    xla_cfg = Config(dataclasses.replace(ref_cfg.model, attention="xla"), BASE.train)
    want = _loss_and_grads(SingleDevice(ref_cfg.model, ref_cfg.train), ref_cfg)
    runs = {"single": SingleDevice(xla_cfg.model, xla_cfg.train),
            "manual tp": manual_parallel.make_runner("tp", "data:1,tensor:8", xla_cfg)}
    for name, runner in runs.items():
        loss, grads = _loss_and_grads(runner, xla_cfg)
        assert abs(float(loss) - float(want[0])) < 2e-5, name
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1])))
        assert diff < 2e-7, (name, diff)  # the tolerance of tests/test_manual.py (GRAD_ATOL)


@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_fused_attention_matches_the_reference(impl):
    """jax.nn.dot_product_attention (XLA here; cuDNN flash attention on a GPU in bf16,
    checked by tools/gpu_bench.sh) against the readable scaled_dot_product_attention.
    Measured (f32, [2, 4, 32, 16]): outputs 4.8e-7 apart, gradients 7.2e-7."""
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
