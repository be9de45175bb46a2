"""Mixed precision (ModelConfig.dtype="bfloat16") through the pipelines and gradient accumulation:
what moves between devices in which dtype, and the losses against single-device bf16 training.

The design (tests/test_precision.py has the single-device recipe): master weights float32, the
compute dtype bf16. So
- a pipeline hands its stages the residual stream [B/M, T, D] in the compute dtype, forward and
  backward: a stage hop in bf16 moves half the bytes of f32 (manual_parallel/pp.py `_gpipe`'s and
  `_scheduled`'s carries; auto_parallel/pp.py's stage buffer in x's dtype);
- FSDP's once-per-step gather (`gather_step` of both twins: grad_accum > 1, and pp_fsdp, whose
  micro-batches are its accumulation) casts each master shard to bf16 BEFORE the all-gather: the
  gathered copy is only read by bf16 matmuls, so gathering f32 would move twice the bytes for
  nothing;
- the manual twins' reduce-scatter of the accumulated gradient (the gather's pullback) runs in
  the gathered dtype, bf16, cast back to f32 after (manual_parallel/runner.py); the gradient
  sums over `stage` of the replicated embedding / ln_final / lm_head, the norm gains' data
  means, the squared norm and the loss are float32 (gradients of f32 master weights).

XLA:CPU rewrites bf16 collectives to f32 in its float-normalization-bf16 pass (its runtime lacks
some bf16 collectives), which would hide all of this (tests/test_tpu_topology.py proves fsdp and tp
on a TPU compile instead). Here each step is compiled with that pass off (KEEP_BF16): gathers and
permutes then keep the program's dtype and run on CPU; reduce-scatters are still promoted by the
backend (no bf16 reduce-scatter at all on XLA:CPU), so their dtype is read from the program's
StableHLO, where the manual twin writes them. The same compiled step trains: one compile a case.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import auto_parallel
import manual_parallel
import reference
from runners import scans
from twinshard import cost, hlo
from twinshard.parallel import pipeline
from twinshard.config import Config, preset
from twinshard.train.trainer import SingleDevice

BASE = preset("tiny")
M = 4  # micro-batches of the pipelines
STEPS = 3
# as tests/test_pipeline.py (4 layers: pp on 4 stages of 1, pp_fsdp on stage:2,data:2) in bf16
PIPE = Config(dataclasses.replace(BASE.model, num_layers=4, dtype="bfloat16"),
              dataclasses.replace(BASE.train, grad_clip=0.25, microbatches=M))
# FSDP with grad_accum 2: PIPE's model and batch (8 over data:4: K = 2 splits every device's 2 rows), so
# its single-device reference is PIPE's (single() below: one program for both)
ACCUM = Config(PIPE.model, dataclasses.replace(PIPE.train, microbatches=1, grad_accum=2))
# One case per loop that carries the residual stream: manual_parallel/pp.py's `_gpipe` and `_scheduled`
# (1F1B), pp_split.py's (zb_h1), auto_parallel/pp.py's stage buffer, each twin's gather_step. The
# interleaved schedules went (manual pp_fsdp, auto pp on stage:2, V = 2): their hops are the same loops'
# carries in x's dtype; tests/test_pipeline.py proves them against single device and the cost model.
CASES = {  # name: (impl, strategy, mesh, config)
    "manual_pp_gpipe": ("manual", "pp", "stage:4", PIPE),
    "manual_pp_fsdp_1f1b": ("manual", "pp_fsdp", "stage:2,data:2",
                            Config(PIPE.model, dataclasses.replace(PIPE.train, schedule="1f1b"))),
    # zb_h1's split backward (manual_parallel/pp_split.py) on bf16 weights gathered once: its stash in bf16
    "manual_pp_fsdp_zb_h1": ("manual", "pp_fsdp", "stage:2,data:2",
                             Config(PIPE.model, dataclasses.replace(PIPE.train, schedule="zb_h1"))),
    "auto_pp": ("auto", "pp", "stage:4", PIPE),
    "manual_fsdp_accum": ("manual", "fsdp", "data:4,tensor:1", ACCUM),
    "auto_fsdp_accum": ("auto", "fsdp", "data:4,tensor:1", ACCUM),
}
KEEP_BF16 = {"xla_disable_hlo_passes": "float-normalization-bf16"}
# bf16 vs bf16 in another summation order (and the pipeline's f32 sum over micro-batches): 2^-9
# relative rounding per value, averaged into a mean over 256 f32 token losses; measured
# max |twin - single| over 3 steps 8.7e-4 (pipelines; interleaved, measured before it went, 8.5e-4), 8.4e-4
# (fsdp K = 2 on PIPE's model and batch); test_precision's 2e-3.
LOSS_ATOL = 2e-3
BF16, F32 = 2, 4  # bytes per element


def single(cfg: Config) -> np.ndarray:
    """Single-device bf16 losses (grad_accum 1: the full batch per step, no pipeline schedule or
    micro-batches) and its initial state; one run for every config that differs only there (single
    device has no schedule): PIPE's and ACCUM's."""
    return _single(Config(cfg.model, dataclasses.replace(cfg.train, grad_accum=1, microbatches=1, schedule="gpipe",
                                                         virtual_stages=1)))


@functools.cache
def _single(one: Config) -> np.ndarray:
    r = SingleDevice(one.model, one.train)
    state = r.init_state(one.train.seed)
    init = jax.device_get(state)
    return np.array(_train(r.train_step, r, state, one)), init


def _train(step, r, state, cfg: Config) -> list[float]:
    losses = []
    for x, y in reference.random_batches(cfg.train.batch_size, cfg.model.context_length, cfg.model.vocab_size, STEPS):
        state, m = step(state, *r.place_batch(x, y))
        losses.append(float(m["loss"]))
    return losses


@dataclasses.dataclass
class Case:
    strategy: str
    cfg: Config
    runner: object
    ledger: hlo.Ledger
    stablehlo: str
    losses: np.ndarray


@functools.cache
def case(name: str) -> Case:
    """The case's train step compiled once with KEEP_BF16: its ledger, its StableHLO, and its
    losses over STEPS steps from the single-device initial state (placed: no init to compile)."""
    impl, strategy, mesh, cfg = CASES[name]
    n = math.prod(int(p.split(":")[1]) for p in mesh.split(","))
    make = {"auto": auto_parallel, "manual": manual_parallel}[impl].make_runner
    r = make(strategy, mesh, cfg, devices=jax.devices()[:n])
    xs = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32, sharding=r.batch_sharding)
    lowered = r.train_step.lower(r.abstract_state(), xs, xs)
    step = lowered.compile(compiler_options=KEEP_BF16)
    state = jax.device_put(r.to_stored(single(cfg)[1]), r.state_shardings)  # (interleaved: layers round-robin)
    return Case(strategy, cfg, r, hlo.ledger(step.as_text(), r.mesh), lowered.as_text(), np.array(_train(step, r, state, cfg)))


def stablehlo_collectives(text: str, op: str) -> list[tuple[str, ...]]:
    """The result types of every `stablehlo.<op>` in the program text, e.g. ('384x32xbf16',)
    (an op with a reduction region prints its type after the region's closing `})`)."""
    pattern = rf'"stablehlo\.{op}"\(.*?(?:\}}\)|>) : \(([^\n]*?)\) -> \(?([^\n]*?)\)?$'
    return [tuple(re.findall(r"tensor<([^>]*)>", m.group(2)))
            for m in re.finditer(pattern, text, flags=re.DOTALL | re.MULTILINE)]


def bf16_bytes(types) -> int:
    """Bytes of tensor types like '384x32xbf16' (all bf16)."""
    assert all(t.endswith("xbf16") for t in types), types
    return sum(BF16 * math.prod(int(d) for d in t.split("x")[:-1]) for t in types)


def hop(cfg: Config, data: int = 1) -> tuple[int, ...]:
    """One micro-batch of one data shard's residual stream, [B/(data M), T, D]."""
    return (cfg.train.batch_size // (data * M), cfg.model.context_length, cfg.model.d_model)


def assert_all_bf16(records, what: str, led: hlo.Ledger) -> None:
    records = list(records)
    assert records, what
    assert all(r.dtype == "bf16" and r.bytes == BF16 * math.prod(r.shape) for r in records), what + "\n" + led.table()


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_twins_equal_single_device_bf16(name):
    c = case(name)
    np.testing.assert_allclose(c.losses, single(c.cfg)[0], atol=LOSS_ATOL, rtol=0)
    assert c.losses[-1] < c.losses[0]  # it trains


def assert_ledger_is_the_bf16_model(c: Case) -> None:
    """The manual ledger equals the cost model in bf16 (dtype_bytes 2, from the config) row by
    row, the (op, axes) of reduce-scatter aside: there the count matches, the program's
    StableHLO asks for exactly the model's bf16 bytes, and XLA:CPU moves twice them (f32)."""
    model = cost.cost(c.cfg.model, c.strategy, c.runner.sizes, c.cfg.train.batch_size,
                      grad_accum=c.cfg.train.grad_accum, microbatches=c.cfg.train.microbatches,
                      schedule=c.cfg.train.schedule, virtual_stages=c.cfg.train.virtual_stages)
    assert model.dtype_bytes == BF16
    rows = cost.compare(c.ledger.summary(), model.summary())
    table = cost.compare_table(rows) + "\n" + c.ledger.table()
    scatter = [r for r in rows if r["op"] == "reduce-scatter"]
    assert all(r["match"] for r in rows if r["op"] != "reduce-scatter"), table
    for r in scatter:
        assert r["measured_count"] == r["model_count"] and r["measured_bytes"] == 2 * r["model_bytes"], table
    scattered = [t for types in stablehlo_collectives(c.stablehlo, "reduce_scatter") for t in types]
    assert bf16_bytes(scattered) == sum(r["model_bytes"] for r in scatter), (scattered, table)  # (pp: none)


def matrix_bytes(cfg: Config, stages: int = 1) -> int:
    """bf16 bytes of the matrices one device gathers whole: its stage's L/S layers' 7, embedding
    and lm_head (FSDP: stages = 1, all of them)."""
    return BF16 * sum(w.size * (w.count // stages if w.layers > 1 else w.count)
                      for w in cost.weights(cfg.model) if w.is_matrix)


def assert_float32_all_reduces(c: Case) -> None:
    """Every all-reduce the manual program asks for is float32 (the stage sums of the replicated
    params' gradients, the norm gains' data means, the squared norm, the loss; StableHLO:
    XLA:CPU would promote a bf16 one)."""
    types = [t for ts in stablehlo_collectives(c.stablehlo, "all_reduce") for t in ts]
    assert types and all(t.endswith("f32") for t in types), types


@pytest.mark.parametrize("name, data", [("manual_pp_gpipe", 1), ("manual_pp_fsdp_1f1b", 2), ("manual_pp_fsdp_zb_h1", 2)])
def test_manual_pipelines_hand_bf16_between_stages(name, data):
    """Every stage hop (forward output, backward input gradient) is one micro-batch [B/(data M),
    T, D] in bf16: 2 bytes an element, half of tests/test_pipeline.py's f32 hops; the ledger
    is the bf16 cost model. pp_fsdp: each of its stage's 9 matrix leaves gathered once, in bf16,
    and the accumulated gradient reduce-scattered in bf16 (assert_ledger_is_the_bf16_model)."""
    c = case(name)
    led, m, stages = c.ledger, c.cfg.train.microbatches, c.runner.sizes["stage"]
    train = c.cfg.train
    ticks = pipeline.ticks(m, stages) if train.schedule == "gpipe" else \
        pipeline.build(train.schedule, stages, m, train.virtual_stages).ticks
    permutes = led.filter(op="collective-permute", axes=("stage",))
    assert_all_bf16(permutes, "stage hops", led)
    assert {tuple(r.shape) for r in permutes} == {hop(c.cfg, data)}
    assert permutes.count() == 2 * ticks and permutes.total_bytes() == 2 * ticks * BF16 * math.prod(hop(c.cfg, data))
    assert_ledger_is_the_bf16_model(c)
    assert_float32_all_reduces(c)
    if data > 1:
        gathers = led.filter(op="all-gather", axes=("data",))
        assert_all_bf16(gathers, "FSDP gathers", led)
        assert [r.multiplicity for r in gathers] == [1] * 9, led.table()
        assert gathers.total_bytes() == matrix_bytes(c.cfg, stages)


def test_one_f_one_b_sums_the_micro_batch_gradients_in_float32():
    """pp_fsdp's 1F1B tick loop carries, besides its two rings of bf16 micro-batches (the inputs
    it holds and the gradients it waits to use, pipeline.buffers' slots and a spare each), the
    gradients of its stage's gathered bf16 weights as float32 sums. A bf16 sum rounds each of
    the M additions to 8 bits, yet keeps the losses within LOSS_ATOL of single device (measured),
    so the carried dtype is what is asserted."""
    c = case("manual_pp_fsdp_1f1b")
    stages, data = c.runner.sizes["stage"], c.runner.sizes["data"]
    xs = jax.ShapeDtypeStruct((c.cfg.train.batch_size, c.cfg.model.context_length), np.int32,
                              sharding=c.runner.batch_sharding)
    jaxpr = jax.make_jaxpr(c.runner.loss_and_grads)(c.runner.abstract_state().params, xs, xs).jaxpr
    slots = pipeline.buffers(pipeline.build("1f1b", stages, c.cfg.train.microbatches)).sizes
    rings = [(slots[k] + 1, *hop(c.cfg, data)) for k in ("act", "grad")]
    (ticks,) = [e for e in scans(jaxpr) if e.outvars[0].aval.shape == rings[0]]
    carried = [v.aval for v in ticks.outvars]
    assert [(a.shape, a.dtype) for a in carried[:2]] == [(r, jnp.bfloat16) for r in rings]
    sums = carried[2:]  # every parameter leaf's gradient, then the loss
    assert len(sums) == len(jax.tree.leaves(c.runner.abstract_state().params)) + 1
    assert {a.dtype for a in sums} == {np.dtype(np.float32)}, [(a.shape, a.dtype) for a in sums]


@pytest.mark.parametrize("name", ["auto_pp"])
def test_auto_pipeline_shifts_its_stage_buffer_in_bf16(name):
    """GSPMD's pipeline (auto_parallel/pp.py) keeps its stage buffers in the residual stream's
    dtype: every permute is one micro-batch [1, B/M, T, D] in bf16, 3 per tick of its V M + S - 1
    (1 forward, 2 backward: as tests/test_pipeline.py measures in f32), the bf16 cost model's
    (cost.gspmd_pipeline_hops); no weight moves."""
    c = case(name)
    train, stages = c.cfg.train, c.runner.sizes["stage"]
    led, ticks = c.ledger, train.virtual_stages * M + stages - 1
    permutes = list(led.filter(op="collective-permute"))
    assert_all_bf16(permutes, "stage buffer shifts", led)
    assert {tuple(r.shape) for r in permutes} == {(1, *hop(c.cfg))}, led.table()
    assert sum(r.multiplicity for r in permutes) == 3 * ticks, led.table()
    model = cost.gspmd_pipeline_hops(c.cfg.model, c.runner.sizes, train.batch_size, M, train.virtual_stages,
                                     train.schedule)
    rows = cost.compare(led.filter(op="collective-permute").summary(), cost.summarize(model))
    assert all(r["match"] for r in rows), cost.compare_table(rows)
    assert led.count("all-gather") == 0, led.table()


@pytest.mark.parametrize("impl", ["manual", "auto"])
def test_fsdp_accumulation_gathers_bf16_once(impl):
    """grad_accum 2: both twins' gather_step cast each master shard to bf16 and gather it whole
    once per step, before the micro-batch loop: 9 all-gathers (7 stacked [L, ...] leaves,
    embedding, lm_head) of exactly the matrices' bf16 bytes. Manual: the ledger is the bf16
    cost model, the accumulated gradient reduce-scattered in bf16 and the rest f32. (Auto: the
    gradient sync is the mean of the f32 accumulator, an all-reduce XLA:CPU promotes anyway.)"""
    c = case(f"{impl}_fsdp_accum")
    gathers = c.ledger.filter(op="all-gather", axes=("data",))
    assert_all_bf16(gathers, "FSDP gathers", c.ledger)
    assert [r.multiplicity for r in gathers] == [1] * 9, c.ledger.table()
    assert gathers.total_bytes() == matrix_bytes(c.cfg)
    if impl == "manual":
        assert_ledger_is_the_bf16_model(c)
        assert_float32_all_reduces(c)
