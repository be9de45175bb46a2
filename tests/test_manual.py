"""The shard_map twin against single-device training, the GSPMD twin, and its own code.

Every strategy on the tiny preset (num_heads 8 so tp can use all 8 devices):
same losses, step-1 gradients and 5-step parameters as single-device and auto;
and the compiled step's collectives are exactly the ones manual_parallel names.
"""

import functools

import jax
import numpy as np
import pytest

import auto_parallel
import manual_parallel
import reference
from runners import CFG, CLIP, MESHES
from twinshard import hlo, testing
from twinshard.train.trainer import SingleDevice

# CFG (tests/runners.py, shared with test_auto and test_memory): grad_clip 0.25 < the gradient
# norm (~0.7 at init, measured), so every step runs the clipped branch: the twins' global norms
# (manual: psum of partial squared norms) must agree with single device for the clipped
# updates, and the reported norms are compared.
STEPS = 5
# Measured here (JAX 0.12.0.1, XLA:CPU), max over dp, fsdp, tp, fsdp_tp, manual vs
# single / auto vs single / manual vs auto: losses 1.9e-6 (a mean of 256 f32
# token losses summed in another order), step-1 gradients 1.7e-8, params after 5
# AdamW steps 2.4e-7 (AdamW turns rounding noise into parameter noise where
# |g| ~ eps; tests/test_auto.py saw up to 2.0e-6 over 4 seeds). Tolerances ~10x.
PARAM_ATOL = 2e-5
LOSS_ATOL = 2e-5
GRAD_ATOL = 2e-7
NORM_RTOL = 1e-6  # grad norms: measured max relative difference 8.8e-8 (f32 sums in another order)


def batches(n=STEPS):
    return reference.random_batches(CFG.train.batch_size, CFG.model.context_length, CFG.model.vocab_size, n)


def run(runner, grads: bool = True):
    """Step-1 gradients, then losses and final params of STEPS training steps."""
    return reference.train_record(runner, CFG, STEPS, grads)


@functools.cache
def single():
    return run(SingleDevice(CFG.model, CFG.train))


@functools.cache
def manual(strategy):
    return run(manual_parallel.make_runner(strategy, MESHES[strategy], CFG))


@functools.cache
def auto(strategy):
    """The GSPMD twin's record without step-1 gradients: tests/test_auto.py compares those with
    single device (an SGD step of lr 1), and here they were 3 more cold programs."""
    return run(auto_parallel.make_runner(strategy, MESHES[strategy], CFG), grads=False)


max_diff = reference.max_diff


@pytest.mark.parametrize("strategy", MESHES)
def test_manual_matches_single_device(strategy):
    m, s = manual(strategy), single()
    assert max_diff(m["init"], s["init"]) == 0.0  # bitwise-identical init under any sharding
    np.testing.assert_allclose(m["losses"], s["losses"], atol=LOSS_ATOL, rtol=0)
    assert max_diff(m["grads"], s["grads"]) < GRAD_ATOL
    assert max_diff(m["params"], s["params"]) < PARAM_ATOL
    np.testing.assert_allclose(m["grad_norms"], s["grad_norms"], rtol=NORM_RTOL)


def test_reported_grad_norm_is_the_unclipped_float64_norm():
    """Step 1's reported grad_norm is the L2 norm of the step-1 gradient, computed here in
    NumPy float64 from the single-device gradients (before clipping), and clipping engaged."""
    s = single()
    want = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(s["grads"])))
    assert want > 2 * CLIP, want  # the clipped branch ran
    np.testing.assert_allclose(s["grad_norms"][0], want, rtol=1e-6)
    for strategy in MESHES:
        np.testing.assert_allclose(manual(strategy)["grad_norms"][0], want, rtol=NORM_RTOL)
        np.testing.assert_allclose(auto(strategy)["grad_norms"][0], want, rtol=NORM_RTOL)


@pytest.mark.parametrize("strategy", MESHES)
def test_manual_matches_auto(strategy):
    m, a = manual(strategy), auto(strategy)
    np.testing.assert_allclose(m["losses"], a["losses"], atol=LOSS_ATOL, rtol=0)
    assert max_diff(m["params"], a["params"]) < PARAM_ATOL
    np.testing.assert_allclose(m["grad_norms"], a["grad_norms"], rtol=NORM_RTOL)
    # both twins use the same placement for params and optimizer moments
    specs = lambda st: [x.sharding.spec for x in jax.tree.leaves(st)]  # noqa: E731
    assert specs(m["state"]) == specs(a["state"])


def compiled_ledger(strategy) -> hlo.Ledger:
    r = manual(strategy)["runner"]
    xs = jax.ShapeDtypeStruct((CFG.train.batch_size, CFG.model.context_length), np.int32,
                              sharding=r.batch_sharding)
    return hlo.ledger(r.train_step.lower(r.abstract_state(), xs, xs).compile(), r.mesh)


L, N_MATRICES, N_NORMS = CFG.model.num_layers, 7 * CFG.model.num_layers + 2, 2 * CFG.model.num_layers + 1


def test_every_collective_is_named_in_manual_parallel():
    for strategy in MESHES:
        led = compiled_ledger(strategy)
        testing.expect_parsed(led)
        for rec in led:
            assert rec.source and ("manual_parallel/" in rec.source or rec.source.startswith("twinshard/model/loss.py")
                                   or "/twinshard/model/loss.py" in rec.source), (strategy, rec, led.table())


def test_dp_all_reduce_moves_exactly_the_parameter_bytes():
    led = compiled_ledger("dp")
    testing.expect_no_collective(led, op="all-gather")
    testing.expect_no_collective(led, op="reduce-scatter")
    param_bytes = 4 * CFG.model.num_params()
    testing.expect_bytes(led, ("data",), param_bytes + 4, rel=0, op="all-reduce")  # + the f32 loss


def test_fsdp_gathers_each_weight_forward_and_backward_and_scatters_each_gradient():
    led = compiled_ledger("fsdp")
    # forward: every matrix; backward: every matrix but the embedding (its gradient,
    # a scatter-add, needs no table values), re-gathered because remat drops it.
    testing.expect_collectives(led, "all-gather", ("data",), count=2 * N_MATRICES - 1)
    testing.expect_collectives(led, "reduce-scatter", ("data",), count=N_MATRICES)
    # DP mean of the RMSNorm gains (one per leaf: ln1, ln2 stacked [L, D], ln_final) + the loss
    # + the global-norm psum
    testing.expect_collectives(led, "all-reduce", ("data",), count=3 + 2)
    weight_bytes = 4 * (CFG.model.num_params() - CFG.model.d_model * N_NORMS)
    embed_bytes = 4 * CFG.model.padded_vocab_size * CFG.model.d_model
    testing.expect_bytes(led, ("data",), 2 * weight_bytes - embed_bytes, rel=0, op="all-gather")
    testing.expect_bytes(led, ("data",), weight_bytes / 8, rel=0, op="reduce-scatter")


def test_tp_all_reduces_activations_only():
    led = compiled_ledger("tp")
    m, t = CFG.model, CFG.train
    act = 4 * t.batch_size * m.context_length * m.d_model
    # forward 2/layer (g after O and W2) + embedding psum; backward 2/layer (f) + f before lm_head
    testing.expect_collectives(led, "all-reduce", ("tensor",), count=4 * L + 2 + 3 + 1)
    big = led.filter(op="all-reduce", axes=("tensor",))
    assert sum(r.multiplicity for r in big if r.bytes == act) == 4 * L + 2, led.table()  # x L: in the scan
    testing.expect_no_collective(led, larger_than=act)  # no weight-sized collective
    testing.expect_no_collective(led, op="all-gather")


@pytest.mark.parametrize("strategy", MESHES)
def test_ledger_equals_the_cost_model_exactly(strategy):
    """Count and bytes of every (op, mesh axes) row equal the analytic model (twinshard/cost/communication.py)."""
    from twinshard import cost

    led = compiled_ledger(strategy)
    model = cost.cost(CFG.model, strategy, manual(strategy)["runner"].sizes, CFG.train.batch_size)
    rows = cost.compare(led.summary(), model.summary())
    bad = [r for r in rows if not r["match"]]
    assert not bad, cost.compare_table(rows) + "\n" + led.table()
