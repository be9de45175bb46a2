"""--weight_dtype=bfloat16: the data-parallel gradient reduction moves each gradient in the weight dtype,
with or without gradient accumulation, and the cost model prices it so (its `w`, twinshard/cost/rows.py).

The rule (twinshard/train/trainer.py `accumulated_value_and_grad`): the float32 accumulator is cast to
its param's dtype once, before any reduction. FSDP's reduce-scatter is the pullback of its gather, in
the gathered (compute) dtype. Here the compute dtype is float32 and the weights bf16: the reverse of
tests/test_bf16_parallel.py (bf16 compute, float32 weights), so a gradient priced at the compute dtype,
or at float32, fails one of the two.

XLA:CPU has no bf16 all-reduce (with its all-reduce-promotion pass off the compile fails: "AllReduce for
datatype 'bf16' is not supported", measured), so the compiled module all-reduces float32 whatever the
program asks. The ledger here is the partitioned module just BEFORE that pass (XLA's dump of it): the
collectives in the dtypes the program asks a chip to move. One compile of `loss_and_grads` a case (no
optimizer: the global norm's scalar, an optimizer row of the model, is not in it).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import tempfile

import jax
import numpy as np
import pytest

import auto_parallel
import manual_parallel
from runners import CFG, MESHES
from twinshard import cost, hlo
from twinshard.config import Config
from twinshard.train import compile_cache

K = 2  # micro-batches of the accumulating cases
BATCH = 16  # 8 data shards of 2 rows: K = 2 splits every device's rows
WEIGHT_BYTES = 2
PROMOTION = "all-reduce-promotion"  # XLA:CPU's pass that rewrites bf16 all-reduces as float32


def config(grad_accum: int) -> Config:
    return Config(dataclasses.replace(CFG.model, weight_dtype="bfloat16"),
                  dataclasses.replace(CFG.train, batch_size=BATCH, grad_accum=grad_accum))


def asked_ledger(lowered, mesh) -> hlo.Ledger:
    """The ledger of `lowered` as partitioned, before XLA:CPU promotes its bf16 all-reduces."""
    with tempfile.TemporaryDirectory() as dump, compile_cache.disabled():  # a cache hit dumps nothing
        lowered.compile({"xla_dump_to": dump, "xla_dump_hlo_pass_re": PROMOTION})
        (before,) = pathlib.Path(dump).glob(f"*before_{PROMOTION}.txt")
        return hlo.ledger(before.read_text(), mesh)


@functools.cache
def case(impl: str, strategy: str, grad_accum: int):
    """(runner, cfg, ledger of its loss_and_grads as asked, the cost model's rows of that program)."""
    cfg = config(grad_accum)
    make = {"manual": manual_parallel, "auto": auto_parallel}[impl].make_runner
    r = make(strategy, MESHES[strategy], cfg)
    tokens = jax.ShapeDtypeStruct((BATCH, cfg.model.context_length), np.int32, sharding=r.batch_sharding)
    led = asked_ledger(r.loss_and_grads.lower(r.abstract_state().params, tokens, tokens), r.mesh)
    model = cost.cost(cfg.model, strategy, r.sizes, BATCH, grad_accum=grad_accum)  # w from cfg.weight_dtype
    return r, cfg, led, cost.summarize([row for row in model.collectives if row.phase != "optimizer"])


def gradient_records(led: hlo.Ledger) -> list:
    """The all-reduces over data of arrays (every one but the loss's f32 scalar)."""
    return [r for r in led.filter(op="all-reduce", axes="data") if r.shape]


@pytest.mark.parametrize("strategy, grad_accum", [("dp", 1), ("dp", K), ("fsdp", 1), ("fsdp", K)])
def test_manual_reduces_gradients_in_the_weight_dtype_as_the_model_prices_them(strategy, grad_accum):
    """dp: every leaf's pmean; fsdp: the norm gains' pmean, bf16, the matrices' reduce-scatter in the
    compute dtype (float32, gathered so); the loss a float32 scalar. The ledger equals the model row by row."""
    r, cfg, led, model = case("manual", strategy, grad_accum)
    rows = cost.compare(led.summary(), model)
    assert all(row["match"] for row in rows), cost.compare_table(rows) + "\n" + led.table()
    grads = gradient_records(led)
    want = len(jax.tree.leaves(r.abstract_state().params)) if strategy == "dp" else 3  # fsdp: the 3 norm gains
    assert len(grads) == want and {g.dtype for g in grads} == {"bf16"}, led.table()
    assert {g.dtype for g in led.filter(op=("all-gather", "reduce-scatter"))} <= {"f32"}, led.table()


def test_auto_dp_reduces_accumulated_gradients_in_the_weight_dtype():
    """grad_accum 2: the mean over data after the micro-batch loop (auto_parallel/runner.py), in bf16:
    the ledger is the manual twin's model row by row."""
    r, cfg, led, model = case("auto", "dp", K)
    rows = cost.compare(led.summary(), model)
    assert all(row["match"] for row in rows), cost.compare_table(rows) + "\n" + led.table()
    assert {g.dtype for g in gradient_records(led)} == {"bf16"}, led.table()


def test_auto_fsdp_reduces_norm_gains_in_the_weight_dtype_and_matrices_as_gathered():
    """grad_accum 2: the gathers are the model's; GSPMD on XLA:CPU writes each reduce-scatter as an
    all-reduce of the whole gradient (tests/test_accum.py), in the gathered float32: d times the model's
    scatter bytes; the norm gains' mean in bf16, the model's bytes."""
    r, cfg, led, model = case("auto", "fsdp", K)
    gathers = ("all-gather", ("data",))
    assert [led.summary()[gathers][k] for k in ("count", "bytes")] == [model[gathers][k] for k in ("count", "bytes")]
    m = cfg.model
    is_gain = lambda g: tuple(g.shape) in {(m.d_model,), (m.num_layers, m.d_model)}  # noqa: E731  [D], [L, D]
    gains = [g for g in gradient_records(led) if is_gain(g)]
    matrices = [g for g in gradient_records(led) if not is_gain(g)]
    norms = [w for w in cost.weights(m) if not w.is_matrix]
    assert {g.dtype for g in gains} == {"bf16"} and len(gains) == sum(w.leaves for w in norms), led.table()
    assert sum(g.bytes * g.multiplicity for g in gains) == sum(w.count * w.size for w in norms) * WEIGHT_BYTES
    assert {g.dtype for g in matrices} == {"f32"}, led.table()
    scattered = model[("reduce-scatter", ("data",))]["bytes"]
    assert sum(g.bytes * g.multiplicity for g in matrices) == r.sizes["data"] * scattered, led.table()
