"""The explicit twin (explicit_parallel/: sharding in JAX's types) against single-device training,
its compiled collectives, and its types at trace time.

Every strategy it writes (dp, fsdp, tp, fsdp_tp, tp_sp) on tests/runners.py's CFG and MESHES
(tp_sp: tensor:8), so that single device compiles the programs of tests/test_data_tensor.py: the same
losses, reported grad norms and 5-step parameters as single device, within test_data_tensor's
tolerances (measured here, JAX 0.12.0.1, XLA:CPU, max over the four: losses 1.4e-6, params after 5
AdamW steps 1.7e-6 (tp)). One compiled train step per strategy, no separate gradient program: equal
losses, norms and AdamW params leave a wrong gradient no place to hide (reference.train_record,
grads=False); the gradients themselves are compared where a test compiles the gradient program
anyway (fsdp with accumulation, tp with grouped-query attention). Its compiled step carries the
collectives each strategy should, counted by hand below (docs/explicit.md sets them beside the other twins'). The typed tests
trace without compiling: `twinshard.testing.expect_sharding` checks a value's type inside the
traced function, or an aval of its jaxpr.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import explicit_parallel
import reference
from runners import CFG, MESHES, loss_and_grads
from test_data_tensor import GRAD_ATOL, LOSS_ATOL, NORM_RTOL, PARAM_ATOL, STEPS
from twinshard import hlo, testing
from twinshard.config import Config, preset
from twinshard.model import layers, matmuls
from twinshard.parallel import placement, resolve, strategies
from twinshard.train import trainer
from twinshard.testing import expect_bytes, expect_collectives, expect_no_collective, expect_sharding

M = CFG.model
B, T, D, F, L = CFG.train.batch_size, M.context_length, M.d_model, M.d_ff, M.num_layers
N_MATRICES = 7 * L + 2  # q, k, v, o, w1, w2, w3 per layer, the embedding, the lm_head
N_GAINS = 2 * L + 1  # ln1, ln2 per layer, ln_final: one [D] each
MATRIX_LEAVES = 7 + 2  # the stacked [L, ...] leaves of the 7 kinds, the embedding, the lm_head
ACT = 4 * B * T * D  # an f32 [B, T, D]
# the data x tensor strategies of this twin (its ulysses: tests/test_ulysses.py)
STRATEGIES = tuple(s for s in explicit_parallel.STRATEGIES if strategies.get(s).family == "base")
MESH = {**MESHES, "tp_sp": "tensor:8"}  # tp_sp: tests/test_sequence.py's mesh


@functools.cache
def runner(strategy: str, grad_accum: int = 1) -> explicit_parallel.ExplicitRunner:
    cfg = CFG if grad_accum == 1 else accum_cfg(grad_accum)
    return explicit_parallel.make_runner(strategy, MESH[strategy], cfg)


def accum_cfg(grad_accum: int) -> Config:
    """CFG with grad_accum micro-batches and a batch of 16, so each of 8 data shards holds 2 rows."""
    return Config(M, dataclasses.replace(CFG.train, grad_accum=grad_accum, batch_size=16))


@functools.cache
def single() -> dict:
    """Single-device training on CFG: tests/test_data_tensor.py's single() (the same init and train step:
    one compile for the suite) without its step-1 gradient program, which nothing here compares."""
    return reference.train_record(trainer.SingleDevice(CFG.model, CFG.train), CFG, STEPS, grads=False)


@functools.cache
def compiled_step(strategy: str):
    """The strategy's train step traced and compiled once: it trains (explicit) and its ledger is read."""
    r = runner(strategy)
    return r.train_step.lower(r.abstract_state(), tokens(r), tokens(r)).compile()


@functools.cache
def explicit(strategy: str) -> dict:
    """reference.train_record of the strategy's compiled step (an Explicit-mode trace costs seconds: once)."""
    r = runner(strategy)
    return reference.train_record(CompiledStep(r, compiled_step(strategy)), CFG, STEPS, grads=False)


class CompiledStep:
    """A runner whose train_step is the given compiled executable (the rest: the runner's)."""

    def __init__(self, runner, step):
        self.runner, self.train_step = runner, step

    def __getattr__(self, name):
        return getattr(self.runner, name)


def tokens(r, batch: int = B):
    return jax.ShapeDtypeStruct((batch, T), np.int32, sharding=r.batch_sharding)


@functools.cache
def ledger(strategy: str) -> hlo.Ledger:
    return hlo.ledger(compiled_step(strategy), runner(strategy).mesh)


# --- against single device --------------------------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_explicit_matches_single_device(strategy):
    e, s = explicit(strategy), single()
    assert reference.max_diff(e["init"], s["init"]) == 0.0  # bitwise-identical init
    np.testing.assert_allclose(e["losses"], s["losses"], atol=LOSS_ATOL, rtol=0)
    assert reference.max_diff(e["params"], s["params"]) < PARAM_ATOL
    np.testing.assert_allclose(e["grad_norms"], s["grad_norms"], rtol=NORM_RTOL)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_is_placed_as_the_manual_twin_declares(strategy):
    """The trained arrays carry the placement the manual runner declares for the same strategy."""
    import manual_parallel

    declared = manual_parallel.make_runner(strategy, MESH[strategy], CFG).state_specs  # builds, compiles nothing
    got = [x.sharding.spec for x in jax.tree.leaves(explicit(strategy)["state"])]
    assert got == jax.tree.leaves(declared, is_leaf=lambda x: isinstance(x, P))


def test_fsdp_accumulates_on_weights_gathered_once():
    """grad_accum 2 (a batch of 16): the gradients equal single device's, and FSDP gathers each
    matrix leaf once per step (MATRIX_LEAVES all-gathers, whatever K: the step's weights are
    resident) and reduces each once (XLA:CPU: all-reduce + slice), where per-micro-batch ZeRO-3
    would gather 2 N_MATRICES - 1 times per micro-batch."""
    cfg = accum_cfg(2)
    r = runner("fsdp", 2)
    x, y = reference.random_batches(16, T, M.vocab_size, 1)[0]
    one = trainer.SingleDevice(cfg.model, cfg.train)
    want = jax.device_get(one.loss_and_grads(one.init_state(0).params, x, y))
    got = jax.device_get(r.loss_and_grads(r.init_state(0).params, *r.place_batch(x, y)))
    assert abs(float(got[0]) - float(want[0])) < LOSS_ATOL
    assert reference.max_diff(got[1], want[1]) < GRAD_ATOL
    led = hlo.ledger(r.loss_and_grads.lower(r.abstract_state().params, tokens(r, 16), tokens(r, 16)).compile(),
                     r.mesh)
    expect_collectives(led, "all-gather", "data", count=MATRIX_LEAVES)
    # each matrix leaf reduced once; the gains' per layer and micro-batch; the loss per micro-batch
    expect_collectives(led, "all-reduce", "data", count=MATRIX_LEAVES + 2 * N_GAINS + 2)


# --- the compiled collectives ------------------------------------------------------------------

def test_dp_reduces_each_matrix_gradient_once_after_the_layer_loop():
    led = ledger("dp")
    testing.expect_parsed(led)
    expect_no_collective(led, op="all-gather")
    # one per matrix leaf (after the loop: unreduced until then), one per gain and layer, the loss
    expect_collectives(led, "all-reduce", "data", count=MATRIX_LEAVES + N_GAINS + 1)
    expect_bytes(led, "data", 4 * M.num_params() + 4, rel=0, op="all-reduce")  # as the manual twin's
    in_loop = [r for r in led.filter(op="all-reduce") if r.multiplicity > 1]
    assert all(r.shape == (D,) for r in in_loop), led.table()  # only the gains' inside the layer loop


def test_fsdp_gathers_each_weight_forward_and_backward():
    led = ledger("fsdp")
    testing.expect_parsed(led)
    weight_bytes = 4 * (M.num_params() - D * N_GAINS)
    embed_bytes = 4 * M.padded_vocab_size * D
    # forward: every matrix; backward: every matrix but the embedding (remat re-gathers), as manual
    expect_collectives(led, "all-gather", "data", count=2 * N_MATRICES - 1)
    expect_bytes(led, "data", 2 * weight_bytes - embed_bytes, rel=0, op="all-gather")
    # XLA:CPU's reduce-scatter of each matrix gradient (all-reduce + slice), the gains, loss, norm
    expect_collectives(led, "all-reduce", "data", count=N_MATRICES + N_GAINS + 2)
    expect_bytes(led, "data", weight_bytes + 4 * D * N_GAINS + 8, rel=0, op="all-reduce")


def test_tp_all_reduces_activations_where_megatron_does():
    led = ledger("tp")
    testing.expect_parsed(led)
    # forward: g after O and W2 per layer, the lookup; backward: f per layer (q, k, v summed
    # unreduced, then w1, w3), f before the lm_head; the 3 loss statistics; the norm, once
    expect_collectives(led, "all-reduce", "tensor", count=4 * L + 2 + 3 + 1)
    assert sum(r.multiplicity for r in led.filter(op="all-reduce") if r.bytes == ACT) == 4 * L + 2, led.table()
    expect_no_collective(led, larger_than=ACT)  # no weight-sized collective
    expect_no_collective(led, op="all-gather")


def test_remat_recomputes_matmuls_never_a_reduction():
    """remat=full under tp: each checkpointed layer saves g's output (a reshard from `unreduced`),
    so the backward loop repeats no all-reduce: the loss and gradients move what remat=none does."""
    cfg = Config(dataclasses.replace(M, remat="full"), CFG.train)
    r = explicit_parallel.make_runner("tp", MESH["tp"], cfg)
    led = hlo.ledger(r.loss_and_grads.lower(r.abstract_state().params, tokens(r), tokens(r)).compile(), r.mesh)
    expect_collectives(led, "all-reduce", "tensor", count=4 * L + 2 + 3)


def test_fsdp_tp_composes_both():
    led = ledger("fsdp_tp")
    testing.expect_parsed(led)
    expect_collectives(led, "all-gather", "data", count=2 * N_MATRICES - 1)
    expect_collectives(led, "all-reduce", "tensor", count=4 * L + 2 + 3)
    expect_collectives(led, "all-reduce", "data", count=N_MATRICES + N_GAINS + 1)
    expect_collectives(led, "all-reduce", ("data", "tensor"), count=1)  # the global norm's one sum
    expect_bytes(led, "tensor", (4 * L + 2) * ACT / 2 + 3 * 4 * B * T / 2, rel=0, op="all-reduce")  # [B/2, ...]


def test_tp_sp_gathers_and_scatters_the_sequence():
    led = ledger("tp_sp")
    testing.expect_parsed(led)
    # f: 2 per layer and one before the lm_head; g's transposes: 2 per layer and the embedding's
    expect_collectives(led, "all-gather", "tensor", count=4 * L + 2)
    expect_bytes(led, "tensor", (4 * L + 2) * ACT, rel=0, op="all-gather")  # each the whole [B, T, D]
    # g: 2 per layer, the lookup; f's transposes: 2 per layer, the lm_head's (XLA:CPU's reduce-
    # scatters: all-reduce + slice); the gains' gradients over the sequence shards, 3 statistics, the norm
    expect_collectives(led, "all-reduce", "tensor", count=4 * L + 2 + N_GAINS + 3 + 1)
    assert sum(r.multiplicity for r in led.filter(op="all-reduce") if r.bytes == ACT) == 4 * L + 2, led.table()


# --- the types, at trace time ------------------------------------------------------------------

def traced_types(r, fn) -> dict:
    """Trace fn(params, x, y) (nothing compiles) and return the types it records."""
    seen: dict = {}
    jax.jit(lambda p, x, y: fn(p, x, y, seen)).trace(r.abstract_state().params, tokens(r), tokens(r))
    return seen


MATRIX = lambda axes: "norm" not in axes  # noqa: E731


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradients_leave_the_backward_pass_typed(strategy):
    """dp: each matrix's gradient leaves the backward pass `unreduced` over `data` (partial sums,
    reduced once by the runner); fsdp, tp, fsdp_tp: every matrix's gradient sharded as its
    parameter (FSDP's reduce-scatter ran in the backward layer loop); the gains' replicated. After
    the runner's sync, every gradient is typed as its parameter."""
    r = runner(strategy)

    def record(params, x, y, seen):
        typed = r.step_params(params)
        grads = jax.grad(r.loss)(typed, x, y)
        seen["grads"] = jax.tree.map(jax.typeof, grads)
        seen["synced"] = jax.tree.map(jax.typeof, r._loss_and_grads(params, x, y)[1])

    seen = traced_types(r, record)
    axes = trainer.logical_axes(M)
    for g, s, ax in zip(jax.tree.leaves(seen["grads"]), jax.tree.leaves(r.param_specs, is_leaf=lambda x: isinstance(x, P)),
                        jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        want = P(*s, unreduced={"data"}) if strategy == "dp" and MATRIX(ax) else s
        expect_sharding(g, want)
    for g, s in zip(jax.tree.leaves(seen["synced"]), jax.tree.leaves(r.param_specs, is_leaf=lambda x: isinstance(x, P))):
        expect_sharding(g, s)


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_accumulation_stays_unreduced_until_one_reduction(strategy):
    """grad_accum 2: the micro-batch loop's carry of every matrix gradient is typed `unreduced`
    over `data` (dp: the weights are `reduced`; fsdp: gathered once to `reduced`), read from the
    avals of the traced jaxpr; the one reduction is the runner's reshard after the loop."""
    r = runner(strategy, 2)
    params = r.abstract_state().params

    def accumulate(p, x, y):
        return trainer.accumulated_value_and_grad(r.loss, r.step_params(p), x, y, 2)

    jaxpr = jax.make_jaxpr(accumulate)(params, tokens(r, 16), tokens(r, 16))
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    shapes = [a.shape for a in jax.tree.leaves(params)]
    carry = scan.outvars[:len(shapes)]  # the carry (the gradient sum), then the per-micro-batch outputs
    axes = jax.tree.leaves(trainer.logical_axes(M), is_leaf=lambda x: isinstance(x, tuple))
    assert [v.aval.shape for v in carry] == shapes
    for v, ax in zip(carry, axes):
        if MATRIX(ax):
            expect_sharding(v.aval, P(*[None] * len(v.aval.shape), unreduced={"data"}))
        else:
            expect_sharding(v.aval, P())  # the gains: reduced in the loop (docs/explicit.md)


def test_fsdp_gather_is_a_reshard_to_reduced_and_its_transpose_reduce_scatters():
    r = runner("fsdp")
    w = jax.ShapeDtypeStruct((D, F), jnp.float32, sharding=NamedSharding(r.mesh, P("data", None)))
    x = jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=NamedSharding(r.mesh, P("data")))

    def loss(w, x):
        full = r.par.weight(w, ("embed", "mlp"))
        expect_sharding(full, P(None, None, reduced={"data"}))  # whole on every device, no data moved by the type
        return jnp.sum(layers.linear(x, full) ** 2)  # its gradient reads the gathered weight

    def grad(w, x):
        value, g = jax.value_and_grad(loss)(w, x)
        expect_sharding(g, P("data", None))  # sharded as its parameter
        return value, g

    led = hlo.ledger(jax.jit(grad).lower(w, x).compile(), r.mesh)
    expect_collectives(led, "all-gather", "data", count=1)
    expect_bytes(led, "data", 4 * D * F, rel=0, op="all-gather")
    # the unreduced [D, F] gradient to [D@data, F]: XLA:CPU's reduce-scatter is all-reduce + slice
    expect_collectives(led, "all-reduce", "data", min_count=1)
    expect_bytes(led, "data", 4 * D * F + 4, rel=0, op="all-reduce")  # + the scalar loss


def test_megatron_f_and_g_are_reshards_of_typed_partial_sums():
    """g: the row-parallel matmul's output is `unreduced` over `tensor`, and its reshard to
    replicated is the forward's one all-reduce; f: the input is cast to `reduced` (free), so the
    two column-parallel input gradients come back unreduced, add up, and f's transpose reduces
    their sum once."""
    r = runner("tp")
    par, mesh = r.par, r.mesh
    x = jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=NamedSharding(mesh, P()))
    col = jax.ShapeDtypeStruct((D, F), jnp.float32, sharding=NamedSharding(mesh, P(None, "tensor")))
    row = jax.ShapeDtypeStruct((F, D), jnp.float32, sharding=NamedSharding(mesh, P("tensor", None)))

    def mlp(x, w1, w3, w2):
        xin = par.enter_tensor_parallel(x)  # what column_parallel does first
        expect_sharding(xin, P(reduced={"tensor"}))
        h1, h3 = layers.linears(xin, (w1, w3))
        expect_sharding(h1, P(None, None, "tensor"))
        partial = layers.linear(h1 * h3, w2)
        expect_sharding(partial, P(unreduced={"tensor"}))
        out = par.exit_tensor_parallel(partial)
        expect_sharding(out, P())
        return jnp.sum(out)

    def grad(x, w1, w3, w2):
        value, dx = jax.value_and_grad(mlp)(x, w1, w3, w2)
        expect_sharding(dx, P())
        return value, dx

    led = hlo.ledger(jax.jit(grad).lower(x, col, col, row).compile(), mesh)
    expect_collectives(led, "all-reduce", "tensor", count=2)  # g forward, f backward (of the summed two)
    expect_bytes(led, "tensor", 2 * ACT, rel=0, op="all-reduce")


def test_constrain_checks_the_declared_layout():
    """The explicit hooks' `constrain` moves nothing and refuses a type the strategy does not declare."""
    par = runner("dp").par
    split = jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=NamedSharding(par.mesh, P("data")))
    whole = jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=NamedSharding(par.mesh, P()))
    jax.jit(lambda x: par.constrain(x, ("batch", "seq", "embed"))).trace(split)
    with pytest.raises(AssertionError, match=r"expected sharding P\('data', None, None\); the type is float32\[8,32,64\]"):
        jax.jit(lambda x: par.constrain(x, ("batch", "seq", "embed"))).trace(whole)


def test_expect_sharding_reads_arrays_tracers_and_avals():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = jax.device_put(np.zeros((8, 6), np.float32), NamedSharding(mesh, P("data")))
    expect_sharding(x, P("data", None))
    expect_sharding(x, P(("data",)))  # a 1-tuple is its axis; trailing unsplit dims may be left out
    expect_sharding(jax.typeof(x), P("data"))
    expect_sharding(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), P("data"))
    with pytest.raises(AssertionError, match=r"float32\[8@data,6\]"):
        expect_sharding(x, P(None, "data"))

    def partial(a, b):
        c = jnp.einsum("ij,jk->ik", a, b, out_sharding=matmuls.partial_sums("ij,jk->ik", a, b))
        expect_sharding(c, P("data", None, unreduced={"tensor"}))
        with pytest.raises(AssertionError, match=r"\{U:tensor\}"):
            expect_sharding(c, P("data", None))  # partial sums are not the sum
        return jax.sharding.reshard(c, NamedSharding(mesh, P("data", None)))

    a = jax.device_put(np.ones((8, 6), np.float32), NamedSharding(mesh, P("data", "tensor")))
    b = jax.device_put(np.ones((6, 4), np.float32), NamedSharding(mesh, P("tensor", None)))
    np.testing.assert_array_equal(jax.jit(partial)(a, b), np.full((8, 4), 6.0))
    ones = jax.make_mesh((8, 1), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    expect_sharding(jax.device_put(x, NamedSharding(ones, P("data"))), P("data", "tensor"))  # tensor: size 1
    with pytest.raises(AssertionError, match="carries no NamedSharding"):
        expect_sharding(jax.ShapeDtypeStruct((2,), np.float32), P())
    # On Auto axes a value's type says nothing of its placement (its type sharding is P(None, None)):
    # a concrete array is checked where it is, a traced one refused.
    auto = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    y = jax.device_put(np.zeros((8, 6), np.float32), NamedSharding(auto, P("data")))
    expect_sharding(y, P("data"))
    with pytest.raises(AssertionError, match=r"is sharded P\('data',\)"):
        expect_sharding(y, P())
    with pytest.raises(AssertionError, match=r"mesh axes \['data', 'tensor'\] are not Explicit"):
        jax.eval_shape(lambda v: expect_sharding(v, P("data")), y)


def test_readme_expect_sharding_example_runs():
    """docs/hlo-assertions.md's expect_sharding block runs as written, after the imports of its pytest file."""
    from test_readme_snippet import snippet

    namespace: dict = {}
    exec(snippet(containing="def test_"), namespace)  # the imports (and its own definitions)
    exec(snippet(containing="grad_once"), namespace)


def test_a_replicated_weight_gets_its_gradient_reduced_in_the_matmul_backward():
    """matmuls.matmul's weight gradient over data-split rows is a partial sum; for a replicated (not
    `reduced`) weight, `cotangent_like` reduces it to the weight's own type in the backward pass
    (what JAX's transpose of a plain dot does): replicated, equal to NumPy's x^T g."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(0)
    xs, ws = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
    x = jax.device_put(xs, NamedSharding(mesh, P("data")))
    w = jax.device_put(ws, NamedSharding(mesh, P()))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(layers.linear(x, w) ** 2)))
    g = grad(w, x)
    expect_sharding(g, P())
    np.testing.assert_allclose(np.asarray(g), 2 * xs.T @ (xs @ ws), rtol=1e-5)
    expect_collectives(hlo.ledger(grad.lower(w, x).compile(), mesh), "all-reduce", "data", count=1)


def test_partial_sums_only_in_explicit_mode():
    """Outside Explicit mode (one device, GSPMD's Auto axes) the layer math states no sharding."""
    auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    a = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(auto, P("data")))
    assert matmuls.partial_sums("ij,jk->ik", a, np.ones((4, 2), np.float32)) is None
    assert matmuls.partial_sums("ij,jk->ik", np.ones((8, 4)), np.ones((4, 2))) is None


# --- what this twin refuses --------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["cp", "pp", "ep"])
def test_refuses_the_strategies_it_does_not_write(strategy):
    with pytest.raises(ValueError, match=rf"--impl=explicit runs dp, fsdp, tp, fsdp_tp, tp_sp, ulysses, not --strategy={strategy}"):
        explicit_parallel.make_runner(strategy, None, CFG)


def test_refuses_a_mixture_of_experts():
    with pytest.raises(ValueError, match="--impl=explicit runs dense models"):
        explicit_parallel.make_runner("dp", "data:8,tensor:1", preset("tiny_moe"))


def test_grouped_query_attention_splits_kv_heads_or_is_refused():
    """With --num_kv_heads=2: tensor:2 splits the kv heads, and the loss and gradients are one device's
    (measured: the losses equal, gradients 1.3e-8 apart; test_explicit_matches_single_device[tp] trains
    the same code over 5 steps); tensor:4 would replicate them, which this twin does not write: refused
    before tracing, naming the twins that do."""
    cfg = Config(dataclasses.replace(CFG.model, num_kv_heads=2), CFG.train)  # tests/test_gqa.py's gqa(2)
    got = loss_and_grads(explicit_parallel.make_runner("tp", "data:1,tensor:2", cfg, devices=jax.devices()[:2]), cfg)
    want = loss_and_grads(trainer.SingleDevice(cfg.model, cfg.train), cfg)
    assert abs(got["loss"] - want["loss"]) < LOSS_ATOL
    assert reference.max_diff(got["grads"], want["grads"]) < GRAD_ATOL
    refused = r"tensor=4 does not divide --num_kv_heads=2: use --impl=auto or --impl=manual"
    with pytest.raises(ValueError, match=refused):
        explicit_parallel.make_runner("tp", "data:1,tensor:4", cfg, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=refused):  # resolve_run's one check, which the other twins pass
        resolve.check_kv_heads(strategies.TP, "explicit", {"data": 1, "tensor": 4}, cfg)
    for twin in ("auto", "manual"):
        resolve.check_kv_heads(strategies.TP, twin, {"data": 1, "tensor": 4}, cfg)
