"""The dtypes the code promises at its accumulation points, read from the traced program.

ModelConfig says: in bf16 compute, params, norms, softmax statistics and the loss stay float32;
the recompute kernel accumulates every attention matmul in float32 (preferred_element_type);
the gradient accumulator is float32 whatever the weights are stored in. On XLA:CPU a bf16 slip
at one of these points can leave the values within every test's tolerance (XLA:CPU computes a
bf16 dot in float32 and rounds once), so each promise is asserted on the jaxpr: the dtype of the
equation that does the work, forward and backward.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import numpy as np
import pytest

from test_options import equations
from twinshard.config import Config, preset
from twinshard.train.trainer import SingleDevice, create_params, loss_fn

TINY = preset("tiny")
BF16 = dataclasses.replace(TINY.model, dtype="bfloat16")
# the equations of softmax statistics, norms and the loss: exp, log, max, 1/sqrt(mean x^2), sums
STATISTICS = ("exp", "log", "reduce_max", "rsqrt", "reduce_sum")


@functools.cache
def loss_and_grad_jaxpr(attention: str):
    m = dataclasses.replace(BF16, attention=attention)
    params = jax.eval_shape(lambda: create_params(m, 0))
    tokens = jax.ShapeDtypeStruct((2, m.context_length), np.int32)
    return jax.make_jaxpr(jax.value_and_grad(lambda p, x, y: loss_fn(p, x, y, m)))(params, tokens, tokens)


@pytest.mark.parametrize("attention", ["recompute", "reference", "xla"])
def test_statistics_norms_and_the_loss_are_float32_in_bf16(attention):
    closed = loss_and_grad_jaxpr(attention)
    found = collections.Counter((e.primitive.name, str(e.outvars[0].aval.dtype)) for e in equations(closed.jaxpr)
                                if e.primitive.name in STATISTICS)
    assert {name for name, _ in found} >= {"exp", "log", "reduce_max", "rsqrt"}, found  # the promise has points
    assert not [k for k in found if k[1] != "float32"], f"(equation, dtype) that the promise says is float32: {found}"
    assert {str(a.dtype) for a in closed.out_avals} == {"float32"}  # the loss and every gradient


def test_recompute_attention_accumulates_every_matmul_in_float32():
    """Its batched matmuls ([B, h] batch dims: q k^T and p v forward, dv, dp, dq, dk backward): the
    layers' flat matmuls (no batch dims) stay bf16 by design."""
    batched = [e for e in equations(loss_and_grad_jaxpr("recompute").jaxpr)
               if e.primitive.name == "dot_general" and e.params["dimension_numbers"][1][0]]
    assert len(batched) >= 6, len(batched)  # 2 forward, 4 backward at least
    wrong = [(str(e.params["preferred_element_type"]), str(e.outvars[0].aval.dtype)) for e in batched
             if str(e.params["preferred_element_type"]) != "float32" or str(e.outvars[0].aval.dtype) != "float32"]
    assert not wrong, f"attention matmuls accumulating in another dtype: {wrong}"


def test_the_gradient_accumulator_is_float32_over_bf16_weights():
    """--weight_dtype=bfloat16 --grad_accum=2: the micro-batch loop (the scan that carries the
    embedding's gradient) accumulates every gradient in float32."""
    cfg = Config(dataclasses.replace(TINY.model, weight_dtype="bfloat16"), dataclasses.replace(TINY.train, grad_accum=2))
    r = SingleDevice(cfg.model, cfg.train)
    state = r.abstract_state()
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32)
    shapes = {tuple(p.shape) for p in jax.tree.leaves(state.params)}
    assert {str(p.dtype) for p in jax.tree.leaves(state.params)} == {"bfloat16"}
    embedding = (cfg.model.padded_vocab_size, cfg.model.d_model)
    loops = [e for e in equations(jax.make_jaxpr(r.train_step)(state, tokens, tokens).jaxpr) if e.primitive.name == "scan"
             and any(tuple(v.aval.shape) == embedding for v in e.outvars)]
    assert len(loops) == 1, len(loops)
    carried = [str(v.aval.dtype) for v in loops[0].outvars if tuple(v.aval.shape) in shapes]
    assert len(carried) >= len(shapes) and set(carried) == {"float32"}, carried
