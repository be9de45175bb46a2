"""Megatron sequence parallelism (tp_sp), and fsdp_tp_sp (FSDP over data inside it), in both twins,
on the tiny preset (num_heads 8).

Each runner is compiled once (module cache) and gives the step-1 gradients, 5 steps of
losses and params against single device (test_data_tensor's record, shared), its compiled step's
ledger and its memory_analysis(). Meshes: the manual twin on tensor:8 (sequence shards of 4
tokens), the GSPMD twin and the collective matmul (manual, remat full) on data:2,tensor:4
(sequence parallelism inside data parallelism); the GSPMD twin there also with grad_accum 2
(the runner's per-data-shard vmap runs tp_sp's hooks: GSPMD.without_batch); fsdp_tp_sp's twins
on data:2,tensor:4, the manual one's ledger against the cost model row by row.

Measured here (JAX 0.12.0.1, XLA:CPU, opt level 0), against single device: losses 1.4e-6,
step-1 gradients 2.4e-8, params after 5 AdamW steps 1.3e-6 (both twins, both meshes);
tolerances as tests/test_data_tensor.py.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import auto_parallel
import manual_parallel
import reference
from test_data_tensor import CFG, STEPS, single  # the same config and single-device record
from test_data_tensor import synced_shapes, use_shapes  # the all-reduced shapes; each weight's shape where used
from runners import assert_ledger_without_optimizer, loss_and_grads
from test_remat import runner_residuals
from twinshard import cost, hlo, testing
from twinshard.cost.weights import weights
from twinshard.hardware import topology
from twinshard.config import Config
from twinshard.train.trainer import SingleDevice

B, T, D, L = CFG.train.batch_size, CFG.model.context_length, CFG.model.d_model, CFG.model.num_layers
PARAM_ATOL, LOSS_ATOL, GRAD_ATOL = 2e-5, 2e-5, 2e-7
# name: (strategy, mesh, model overrides)
pytestmark = pytest.mark.tp_sp  # every test here proves tp_sp (some against tp)
RUNS = {"manual": ("tp_sp", "tensor:8", {}), "auto": ("tp_sp", "data:2,tensor:4", {}),
        "manual tp": ("tp", "data:1,tensor:8", {}),
        # the collective matmul, inside data parallelism, under remat full (its ppermutes re-run)
        "collective matmul": ("tp_sp", "data:2,tensor:4", {"collective_matmul": True, "remat": "full"}),
        "auto accum": ("tp_sp", "data:2,tensor:4", {}),
        # fsdp over data inside tp_sp: both twins on data:2,tensor:4 (its weights [D/2, F/4])
        "manual fsdp_tp_sp": ("fsdp_tp_sp", "data:2,tensor:4", {}),
        "auto fsdp_tp_sp": ("fsdp_tp_sp", "data:2,tensor:4", {}),
        "manual fsdp_tp_sp accum": ("fsdp_tp_sp", "data:2,tensor:4", {})}
RECORDED = ("manual", "auto", "manual fsdp_tp_sp", "auto fsdp_tp_sp")  # runs with a training record
GRAD_ACCUM = {"auto accum": 2, "manual fsdp_tp_sp accum": 2}  # TrainConfig.grad_accum of a run (default 1)
max_diff = reference.max_diff


def config(name: str) -> Config:
    return Config(dataclasses.replace(CFG.model, **RUNS[name][2]),
                  dataclasses.replace(CFG.train, grad_accum=GRAD_ACCUM.get(name, 1)))


@functools.cache
def initial_state():
    """The single-device initial train state on the host (test_data_tensor's `single` compiles its init)."""
    return jax.device_get(SingleDevice(CFG.model, CFG.train).init_state(CFG.train.seed))


def make(name: str):
    """The run's runner, its init_state the single-device initial state placed in its shardings: a
    transfer where the sharded init (PlacedRunner's, the same code for every strategy) is one more
    cold compile per runner. tp_sp's parameters are placed as tp's, fsdp_tp_sp's as fsdp_tp's, whose
    sharded init test_data_tensor.py::test_initial_params_are_bitwise_single_device holds bitwise."""
    strategy, mesh, _ = RUNS[name]
    twin = auto_parallel if name.startswith("auto") else manual_parallel
    runner = twin.make_runner(strategy, mesh, config(name))
    runner.init_state = lambda seed: jax.device_put(initial_state(), runner.state_shardings)
    return runner


@functools.cache
def record(name: str):
    """The GSPMD twins' records have no step-1 gradients (tests/reference.py)."""
    return reference.train_record(make(name), config(name), STEPS, grads=not name.startswith("auto"))


@functools.cache
def train_only(name: str):
    """Losses and params of STEPS train steps (one compile: no separate loss_and_grads)."""
    r = make(name)
    state = r.init_state(CFG.train.seed)
    losses = []
    for x, y in reference.random_batches(B, T, CFG.model.vocab_size, STEPS):
        state, metrics = r.train_step(state, *r.place_batch(x, y))
        losses.append(float(metrics["loss"]))
    return {"losses": np.array(losses), "params": jax.device_get(state.params), "runner": r}


def compile_step(r):
    xs = jax.ShapeDtypeStruct((B, T), np.int32, sharding=r.batch_sharding)
    return r.train_step.lower(r.abstract_state(), xs, xs).compile()


@functools.cache
def compiled(name: str):
    """The train step compiled once: (compiled, ledger, runner)."""
    r = record(name)["runner"] if name in RECORDED else (
        train_only(name)["runner"] if name == "collective matmul" else make(name))
    c = compile_step(r)
    return c, hlo.ledger(c, r.mesh), r


# (the GSPMD twin's grad_accum 2: its loss and gradients, test_auto_twin_accumulates_on_sequence_shards)
@pytest.mark.parametrize("twin", RECORDED)
def test_tp_sp_matches_single_device(twin):
    got, want = record(twin), single()
    np.testing.assert_allclose(got["losses"], want["losses"], atol=LOSS_ATOL, rtol=0)
    if not twin.startswith("auto"):
        assert max_diff(got["grads"], want["grads"]) < GRAD_ATOL
    assert max_diff(got["params"], want["params"]) < PARAM_ATOL


@pytest.mark.parametrize("name", ["manual", "collective matmul", "manual fsdp_tp_sp"])
def test_manual_ledger_equals_the_cost_model(name):
    """Every collective is a line of manual_parallel/ (or the loss's statistics), and count and
    bytes of every (op, axes) row equal twinshard/cost/communication.py: tensor:8, and the collective matmul on
    data:2,tensor:4 under remat=full, where the backward loop runs the forward ppermutes again
    (the shards are saved, not the gathered sequence) and no reduce-scatter."""
    _, led, r = compiled(name)
    testing.expect_parsed(led)
    for rec in led:
        assert "manual_parallel/" in rec.source or "twinshard/model/loss.py" in rec.source, (rec, led.table())
    rows = cost.compare(led.summary(), cost.cost(config(name).model, RUNS[name][0], r.sizes, B).summary())
    assert all(row["match"] for row in rows), cost.compare_table(rows) + "\n" + led.table()


def _ring(led: hlo.Ledger, op: str, size: int) -> float:
    """Ring bytes over tensor of the `op` records whose result is `size` bytes (x multiplicity)."""
    return sum(rec.ring_bytes * rec.multiplicity for rec in led.filter(op=op, axes=("tensor",)) if rec.bytes == size)


def test_gather_plus_scatter_bytes_equal_tp_all_reduce_bytes():
    """Per layer, the measured all-gathers [B, T, D] + reduce-scatters [B, T/t, D] of tp_sp move
    on a ring exactly the bytes of TP's all-reduces of [B, T, D] (the cost model's tp rows, which
    tests/test_data_tensor.py proves equal to TP's ledger): an all-reduce IS a reduce-scatter followed
    by an all-gather, each (t-1)/t of the array per device; tp_sp only runs the two halves at
    different places (the scatter after a row-parallel matmul, the gather before the next
    column-parallel one). Outside the layers the same holds for the embedding and lm_head."""
    led, t = compiled("manual")[1], 8
    a = 4 * B * T * D
    tp = cost.cost(CFG.model, "tp", {"data": 1, "tensor": t}, B)
    tp_ring = sum(r.ring_bytes for r in tp.collectives if r.op == "all-reduce" and r.bytes == r.count * a)
    sp_ring = _ring(led, "all-gather", a) + _ring(led, "reduce-scatter", a // t)
    assert sp_ring == tp_ring == (4 * L + 2) * 2 * (t - 1) / t * a, (sp_ring, tp_ring)
    # and nothing over tensor larger than the residual stream: no weight moves
    testing.expect_no_collective(led, axes=("tensor",), larger_than=a)
    testing.expect_no_collective(led, op="all-reduce", axes=("tensor",), larger_than=4 * B * T)


def test_auto_twin_gathers_and_scatters_the_sequence():
    """GSPMD (data:2,tensor:4): the same 4L + 2 all-gathers of [B/data, T, D] as the manual twin;
    XLA:CPU writes each reduce-scatter as an all-reduce of [B/data, T, D] (+ a slice; docs/design.md),
    2L + 1 forward, and GSPMD all-reduces the input gradients of q, k, v, w1, w3 separately
    (5L) and the lm_head's (1) where the manual twin reduce-scatters their sum (2L + 1)."""
    led = compiled("auto")[1]
    a = 4 * (B // 2) * T * D
    testing.expect_collectives(led, "all-gather", ("tensor",), count=4 * L + 2)
    testing.expect_bytes(led, ("tensor",), (4 * L + 2) * a, rel=0, op="all-gather")
    testing.expect_no_collective(led, op="reduce-scatter")  # XLA:CPU
    big = [r for r in led.filter(op="all-reduce", axes=("tensor",)) if r.bytes == a]
    assert sum(r.multiplicity for r in big) == (2 * L + 1) + (5 * L + 1), led.table()
    testing.expect_no_collective(led, axes=("tensor",), larger_than=a)
    # each (TP-local) weight matrix's gradient crosses data in the weight's own [in, out] shape
    # (matmuls.matmul's backward; tp_sp's einsum path crossed as [out, in] before it)
    assert synced_shapes(led, ("data",), min_rank=2) == [
        s for s in use_shapes("tp", {"data": 2, "tensor": 4}, fsdp_only=False) if len(s) == 2]


def test_auto_fsdp_tp_sp_gathers_weights_over_data_and_the_sequence_over_tensor():
    """GSPMD on data:2,tensor:4: each matrix's tensor shard gathered over data once (7L + 2; it keeps
    them for the backward pass, as auto fsdp_tp), the sequence gathered over tensor as auto tp_sp's
    (4L + 2 of [B/data, T, D]); no array over tensor larger than the residual stream (no weight
    crosses tensor), none over data larger than a gathered tensor shard (no activation crosses data)."""
    led, a = compiled("auto fsdp_tp_sp")[1], 4 * (B // 2) * T * D
    testing.expect_collectives(led, "all-gather", ("data",), count=7 * L + 2)
    testing.expect_collectives(led, "all-gather", ("tensor",), count=4 * L + 2)
    assert {r.bytes for r in led.filter(op="all-gather", axes=("tensor",))} == {a}, led.table()
    testing.expect_no_collective(led, axes=("tensor",), larger_than=a)
    widest = max(4 * w.size // 4 for w in weights(CFG.model) if w.is_matrix)  # f32, a matrix's 1/tensor shard
    testing.expect_no_collective(led, axes=("data",), larger_than=widest)


def test_manual_fsdp_tp_sp_accumulates_on_whole_weights_and_sequence_shards():
    """grad_accum K = 2 (data:2,tensor:4): each matrix gathered once per step (gather_step), the
    micro-batches on `resident` hooks, each summing its RMSNorm gains' gradients over the tensor
    shards of the sequence (2L + 1 psums per micro-batch). The step-1 gradients equal single
    device's; the compiled loss_and_grads' ledger is the cost model's at K = 2 (its rows but the
    optimizer's, which the train step adds whatever K: the ledger tests above)."""
    r = make("manual fsdp_tp_sp accum")
    x, y = reference.random_batches(B, T, CFG.model.vocab_size, 1)[0]
    params, (x, y) = r.init_state(CFG.train.seed).params, r.place_batch(x, y)
    compiled = r.loss_and_grads.lower(params, x, y).compile()
    assert max_diff(jax.device_get(compiled(params, x, y)[1]), single()["grads"]) < GRAD_ATOL
    model = cost.cost(CFG.model, "fsdp_tp_sp", r.sizes, B, grad_accum=GRAD_ACCUM["manual fsdp_tp_sp accum"])
    assert_ledger_without_optimizer(hlo.ledger(compiled, r.mesh), model)


def test_auto_twin_accumulates_on_sequence_shards():
    """grad_accum K = 2 on data:2,tensor:4: the per-data-shard vmap runs tp_sp's hooks, so each
    micro-batch [B/(data K), T, D] is sequence-parallel and the loss and gradients equal single
    device's step 1 (its loss_and_grads, compiled once: what accumulation changes is all there;
    measured 9.5e-7 and 2.4e-8). Its forward runs the 2L + 1 gathers of K = 1 (above), its backward
    4L + 1 where K = 1 runs 2L + 1 (measured: inside the vmap GSPMD gathers each of the 2L layer-loop
    gradients twice, from the same operand, under two spellings of the tensor groups that are not
    merged), K (6L + 2) = 28 at L = 2; the all-reduces of [B/(data K), T, D] are K = 1's 7L + 2 per
    micro-batch. Every data collective runs once (the gradient mean after the micro-batch loop)."""
    got, k = loss_and_grads(make("auto accum"), config("auto accum")), GRAD_ACCUM["auto accum"]
    assert abs(got["loss"] - single()["losses"][0]) < LOSS_ATOL
    assert max_diff(got["grads"], single()["grads"]) < GRAD_ATOL
    led, a = got["ledger"], 4 * (B // (2 * k)) * T * D
    testing.expect_collectives(led, "all-gather", ("tensor",), count=k * (6 * L + 2))
    assert {r.bytes for r in led.filter(op="all-gather")} == {a}, led.table()
    big = [r for r in led.filter(op="all-reduce", axes=("tensor",)) if r.bytes == a]
    assert sum(r.multiplicity for r in big) == k * (7 * L + 2), led.table()
    assert all(r.multiplicity == 1 for r in led.filter(axes=("data",))), led.table()
    testing.expect_no_collective(led, axes=("tensor",), larger_than=a)


def test_temporaries_below_tp():
    """memory_analysis() per device on tensor:8: tp_sp's temporaries are below TP's (the residual
    stream, norms and layer inputs are 1/8 as large; the gathered inputs of the column-parallel
    matmuls, saved under remat none, are what TP saves anyway), and each is within the cost
    model's band (tests/test_memory.py). Measured (XLA:CPU): tp_sp 1,479,528 B (model 1,487,616),
    tp 2,237,928 B (model 1,899,776): 34% less. Under remat full the saved layer activations are
    exactly 1/16 of TP's (the layer input [B, T/8, D] against 2 [B, T, D]; the residual test below)."""
    temp = {n: compiled(n)[0].memory_analysis().temp_size_in_bytes for n in ("manual", "manual tp")}
    model = {n: cost.memory(CFG.model, RUNS[n][0], {"data": 1, "tensor": 8}, B, T).temporaries
             for n in temp}
    assert temp["manual"] < temp["manual tp"], temp
    assert model["manual"] < model["manual tp"], model
    for n in temp:
        assert 0.85 <= temp[n] / model[n] <= 1.25, (n, temp, model)


@pytest.mark.parametrize("policy", ["none", "full", "dots", "dots_no_batch"])
def test_saved_residuals_per_layer_equal_the_model(policy):
    """The layer scan's saved residuals (stacked [L, ...]) are L x cost.saved_per_layer(...,
    sequence=True), + the last layer's output [B, T/8, D]; the two [D] gains the model leaves
    out under none (tests/test_remat.py) are left out here too."""
    r = manual_parallel.make_runner("tp_sp", "tensor:8", Config(dataclasses.replace(CFG.model, remat=policy),
                                                                CFG.train))
    saved = [(shape, n) for shape, n, where in runner_residuals(r) if "output of scan" in where]
    gains = sum(n for shape, n in saved if shape[1:] == (1, 1, D))
    want = L * cost.saved_per_layer(CFG.model, policy, B, T, 8, sequence=True) + B * T // 8 * D
    assert sum(n for _, n in saved) - gains == 4 * want


def test_sequence_must_split_over_tensor():
    """T = context_length not divisible by tensor: a ValueError naming it and the fix, before compiling."""
    cfg = Config(dataclasses.replace(CFG.model, context_length=36), CFG.train)
    for twin in (auto_parallel, manual_parallel):
        with pytest.raises(ValueError, match=r"seq=36 is not divisible by mesh axis tensor=8.*context_length"):
            twin.make_runner("tp_sp", "tensor:8", cfg)


def test_collective_matmul_equals_the_all_gather():
    """--collective_matmul (data:2,tensor:4, remat full) changes the schedule, not the math:
    losses and params after 5 steps equal single device's (measured max differences: losses
    1.4e-6, params 1.0e-6; tp_sp without it on tensor:8: gradients 6.5e-9 apart). In the
    ledger each of the 2L all-gathers before a column-parallel block is t-1 = 3
    collective-permutes of [B/2, T/4, D] forward and 3 backward (its reduce-scatter), 3 more
    re-run by remat (the attention block's reduce-scatter too), and the ring bytes of the forward
    and backward hops equal those of the all-gathers and reduce-scatters they replace."""
    got, want = train_only("collective matmul"), single()
    np.testing.assert_allclose(got["losses"], want["losses"], atol=LOSS_ATOL, rtol=0)
    assert max_diff(got["params"], want["params"]) < PARAM_ATOL
    led, t = compiled("collective matmul")[1], 4
    chunk = 4 * (B // 2) * (T // t) * D
    permutes = testing.expect_collectives(led, "collective-permute", ("tensor",), count=3 * 2 * L * (t - 1))
    assert {r.bytes for r in permutes} == {chunk}
    # each forward hop (and its remat re-run) sends the chunk to device i-1, the backward to i+1
    testing.expect_permute(led, {"tensor": -1}, wrap=True, count=2 * 2 * L * (t - 1))
    testing.expect_permute(led, {"tensor": +1}, wrap=True, count=2 * L * (t - 1))
    testing.expect_collectives(led, "all-gather", ("tensor",), count=2 * L + 2)  # the scatters' backward, lm_head
    # the scatters after each block, the embedding's, the lm_head's backward, and remat full's re-run of the
    # attention block's scatter (SequenceParallel.layer_policy saves the layer input alone)
    testing.expect_collectives(led, "reduce-scatter", ("tensor",), count=3 * L + 2)
    hops = sum(r.ring_bytes * r.multiplicity for r in permutes) * 2 / 3  # without remat's re-run
    assert hops == 2 * 2 * L * (t - 1) / t * (4 * (B // 2) * T * D)


@pytest.mark.parametrize("strategy, mesh, twin, message", [
    ("tp", "data:1,tensor:8", manual_parallel, "not of --strategy=tp: use --strategy=tp_sp --impl=manual"),
    ("fsdp_tp_sp", "data:2,tensor:4", manual_parallel, "not of --strategy=fsdp_tp_sp: use --strategy=tp_sp"),
    ("tp_sp", "data:1,tensor:8", auto_parallel, "manual twin only \\(--impl=auto\\): use --impl=manual"),
])
def test_collective_matmul_needs_manual_tp_sp(strategy, mesh, twin, message):
    cfg = config("collective matmul")
    with pytest.raises(ValueError, match=message):
        twin.make_runner(strategy, mesh, cfg)
    with pytest.raises(ValueError, match="use strategy tp_sp or collective_matmul=False"):
        cost.cost(cfg.model, "tp", {"data": 1, "tensor": 8}, B)


def test_fsdp_tp_sp_memory_beside_the_model():
    """fsdp_tp_sp's compiled step (manual, data:2,tensor:4) per device: its params and optimizer
    arguments are the memory model's to the byte (every matrix [.../2, .../4], the norm gains whole),
    and memory_analysis()'s temporaries within the manual twins' band of it (tests/test_memory.py).
    Measured (XLA:CPU): 908,160 B against the model's 980,736."""
    step, _, r = compiled("manual fsdp_tp_sp")
    model = cost.memory(CFG.model, "fsdp_tp_sp", r.sizes, B, T)
    xs = jax.ShapeDtypeStruct((B, T), np.int32, sharding=r.batch_sharding)
    args = topology.argument_bytes(step, r.abstract_state(), xs, xs)
    assert (args["params"]["bytes"], args["optimizer"]["bytes"]) == (model.params, model.optimizer)
    ratio = step.memory_analysis().temp_size_in_bytes / model.temporaries
    assert 0.85 <= ratio <= 1.35, (ratio, step.memory_analysis().temp_size_in_bytes, model)
