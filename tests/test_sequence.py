"""Megatron sequence parallelism (tp_sp) in both twins, on the tiny preset (num_heads 8).

Each runner is compiled once (module cache) and gives the step-1 gradients, 5 steps of
losses and params against single device, its compiled step's ledger and its
memory_analysis(). Meshes: the manual twin on tensor:8 (sequence shards of 4 tokens), the
GSPMD twin on data:2,tensor:4 (sequence parallelism inside data parallelism).

Measured here (JAX 0.12.0.1, XLA:CPU, opt level 0), against single device: losses 1.4e-6,
step-1 gradients 2.4e-8, params after 5 AdamW steps 1.3e-6 (both twins, both meshes);
tolerances as tests/test_manual.py.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import auto_parallel
import manual_parallel
import reference
from test_remat import runner_residuals
from twinshard import cost, hlo, testing
from twinshard.config import Config, preset
from twinshard.trainer import SingleDevice

BASE = preset("tiny")
CFG = Config(dataclasses.replace(BASE.model, num_heads=8), dataclasses.replace(BASE.train, grad_clip=0.25))
B, T, D, L = CFG.train.batch_size, CFG.model.context_length, CFG.model.d_model, CFG.model.num_layers
STEPS = 5
PARAM_ATOL, LOSS_ATOL, GRAD_ATOL = 2e-5, 2e-5, 2e-7
RUNS = {"manual": ("tp_sp", "tensor:8"), "auto": ("tp_sp", "data:2,tensor:4"), "manual tp": ("tp", "data:1,tensor:8")}
max_diff = reference.max_diff


def make(name: str, cfg: Config = CFG):
    strategy, mesh = RUNS[name]
    return (auto_parallel if name == "auto" else manual_parallel).make_runner(strategy, mesh, cfg)


@functools.cache
def single():
    return reference.train_record(SingleDevice(CFG.model, CFG.train), CFG, STEPS)


@functools.cache
def record(name: str):
    return reference.train_record(make(name), CFG, STEPS)


def compile_step(r):
    xs = jax.ShapeDtypeStruct((B, T), np.int32, sharding=r.batch_sharding)
    return r.train_step.lower(r.abstract_state(), xs, xs).compile()


@functools.cache
def compiled(name: str):
    """The train step compiled once: (compiled, ledger, runner)."""
    r = record(name)["runner"] if name != "manual tp" else make(name)
    c = compile_step(r)
    return c, hlo.ledger(c, r.mesh), r


@pytest.mark.parametrize("twin", ["manual", "auto"])
def test_tp_sp_matches_single_device(twin):
    got, want = record(twin), single()
    assert max_diff(got["init"], want["init"]) == 0.0
    np.testing.assert_allclose(got["losses"], want["losses"], atol=LOSS_ATOL, rtol=0)
    assert max_diff(got["grads"], want["grads"]) < GRAD_ATOL
    assert max_diff(got["params"], want["params"]) < PARAM_ATOL


def test_manual_ledger_equals_the_cost_model():
    """Every collective is a line of manual_parallel/ (or the loss's statistics), and count and
    bytes of every (op, axes) row equal twinshard/cost.py, on tensor:8 and on data:2,tensor:4."""
    for r, led in ((compiled("manual")[2], compiled("manual")[1]), *_data_parallel_manual()):
        testing.expect_parsed(led)
        for rec in led:
            assert "manual_parallel/" in rec.source or "twinshard/loss.py" in rec.source, (rec, led.table())
        rows = cost.compare(led.summary(), cost.cost(CFG.model, "tp_sp", r.sizes, B).summary())
        assert all(row["match"] for row in rows), cost.compare_table(rows) + "\n" + led.table()


def _data_parallel_manual():
    r = manual_parallel.make_runner("tp_sp", "data:2,tensor:4", CFG)
    return [(r, hlo.ledger(compile_step(r), r.mesh))]


def _ring(led: hlo.Ledger, op: str, size: int) -> float:
    """Ring bytes over tensor of the `op` records whose result is `size` bytes (x multiplicity)."""
    return sum(rec.ring_bytes * rec.multiplicity for rec in led.filter(op=op, axes=("tensor",)) if rec.bytes == size)


def test_gather_plus_scatter_bytes_equal_tp_all_reduce_bytes():
    """Per layer, the measured all-gathers [B, T, D] + reduce-scatters [B, T/t, D] of tp_sp move
    on a ring exactly the bytes of TP's all-reduces of [B, T, D] (the cost model's tp rows, which
    tests/test_manual.py proves equal to TP's ledger): an all-reduce IS a reduce-scatter followed
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
    XLA:CPU writes each reduce-scatter as an all-reduce of [B/data, T, D] (+ a slice; DESIGN.md),
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


def test_temporaries_below_tp():
    """memory_analysis() per device on tensor:8: tp_sp's temporaries are below TP's (the residual
    stream, norms and layer inputs are 1/8 as large; the gathered inputs of the column-parallel
    matmuls, saved under remat none, are what TP saves anyway), and each is within the cost
    model's band (tests/test_memory.py)."""
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


def test_remat_regathers_the_sequence_shards():
    """Under remat=full the manual twin saves the reduce-scatter outputs (base.saves_reductions)
    but re-gathers the column-parallel inputs in the backward loop: 2L all-gathers more, exactly
    the cost model's; no reduce-scatter is recomputed."""
    r = manual_parallel.make_runner("tp_sp", "tensor:8", Config(dataclasses.replace(CFG.model, remat="full"),
                                                                CFG.train))
    led = hlo.ledger(compile_step(r), r.mesh)
    rows = cost.compare(led.summary(), cost.cost(CFG.model, "tp_sp", r.sizes, B, remat="full").summary())
    assert all(row["match"] for row in rows), cost.compare_table(rows)
    none = compiled("manual")[1]
    assert led.count("all-gather", "tensor") == none.count("all-gather", "tensor") + 2 * L
    assert led.count("reduce-scatter", "tensor") == none.count("reduce-scatter", "tensor")


def test_sequence_must_split_over_tensor():
    """T = context_length not divisible by tensor: a ValueError naming it and the fix, before compiling."""
    cfg = Config(dataclasses.replace(CFG.model, context_length=36), CFG.train)
    for twin in (auto_parallel, manual_parallel):
        with pytest.raises(ValueError, match=r"seq=36 is not divisible by mesh axis tensor=8.*context_length"):
            twin.make_runner("tp_sp", "tensor:8", cfg)
