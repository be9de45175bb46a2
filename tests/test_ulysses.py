"""All-to-all sequence parallelism (ulysses, fsdp_ulysses) in both twins: the all-to-all pair, each
twin against single-device training, and against single device's loss and gradients with grouped-query
attention, under --remat=full and --grad_accum=2 (one compiled loss_and_grads each: `lag`), the
manual ledger against the cost model, what GSPMD inserts, and the configurations refused before
compiling.

tests/runners.py's CFG (tiny, 8 heads, T = 32, B = 8, clipped steps); ulysses on context:4,
fsdp_ulysses on data:2,context:2.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import auto_parallel
import explicit_parallel
import manual_parallel
import reference
from manual_parallel.collectives import heads_to_seq, seq_to_heads
from runners import CFG, assert_ledger_without_optimizer, loss_and_grads
from twinshard import cost, hlo, testing
from twinshard.config import Config, preset
from twinshard.hardware import topology
from twinshard.parallel import context
from twinshard.train.trainer import SingleDevice

MESHES = {"ulysses": "context:4", "fsdp_ulysses": "data:2,context:2"}
TWINS = {"auto": auto_parallel, "manual": manual_parallel, "explicit": explicit_parallel}
STEPS = 3
# Measured (JAX 0.12.0.1, XLA:CPU), every twin below vs single device: losses equal to 9.6e-7,
# gradients (step 1, each `lag`) to 2.6e-8, params after 3 AdamW steps to 1.0e-6; test_context.py's
# tolerances.
LOSS_ATOL, GRAD_ATOL, NORM_RTOL, PARAM_ATOL = 1e-5, 2e-7, 1e-6, 2e-5


def config(kv_heads: int = 0, **train) -> Config:
    model = dataclasses.replace(CFG.model, num_kv_heads=kv_heads) if kv_heads else CFG.model
    return Config(model, dataclasses.replace(CFG.train, **train))


@functools.cache
def single():
    cfg = config()
    return reference.train_record(SingleDevice(cfg.model, cfg.train), cfg, STEPS)


@functools.cache
def initial_state():
    """The single-device initial train state of config(), on the host (`single` compiles its init)."""
    return jax.device_get(SingleDevice(CFG.model, CFG.train).init_state(CFG.train.seed))


def record(runner):
    """reference.train_record of config() from `initial_state` placed in the runner's shardings: a
    transfer where the sharded init (PlacedRunner's, the same code for every strategy, held bitwise by
    test_data_tensor.py::test_initial_params_are_bitwise_single_device) is one more cold compile."""
    runner.init_state = lambda seed: jax.device_put(initial_state(), runner.state_shardings)
    return reference.train_record(runner, config(), STEPS, grads=False)


@functools.cache
def twin(impl: str, strategy: str):
    """STEPS train steps of the twin on MESHES[strategy], without step-1 gradients (one loss_and_grads
    fewer to compile: ~3 s of CPU each, measured): equal losses, reported norms and params after AdamW
    steps leave a wrong gradient no place to hide (tests/reference.py train_record), and the manual
    twin's gradients themselves are compared in three variants of each strategy's program: 2 kv heads
    and --remat=full (ulysses), --grad_accum=2 (fsdp_ulysses)."""
    mesh = MESHES[strategy]
    n = math.prod(int(p.split(":")[1]) for p in mesh.split(","))
    return record(TWINS[impl].make_runner(strategy, mesh, config(), devices=jax.devices()[:n]))


@functools.cache
def lag(impl: str, strategy: str = "ulysses", mesh: str | None = None, kv_heads: int = 0, remat: str = "none",
        grad_accum: int = 1) -> dict:
    """The run's loss_and_grads compiled once on its config's initial params and first batch
    (tests/runners.py): loss, gradients and ledger; impl 'single': one device. For the claims inside
    loss_and_grads (GQA's repeats, remat, the micro-batches): a train step compiles in ~2x its CPU
    seconds (measured, XLA:CPU), and test_twins_match_single_device trains each strategy."""
    cfg = config(kv_heads, grad_accum=grad_accum)
    cfg = Config(dataclasses.replace(cfg.model, remat=remat), cfg.train)
    if impl == "single":
        return loss_and_grads(SingleDevice(cfg.model, cfg.train), cfg)
    mesh = mesh or MESHES[strategy]
    n = math.prod(int(p.split(":")[1]) for p in mesh.split(","))
    return loss_and_grads(TWINS[impl].make_runner(strategy, mesh, cfg, devices=jax.devices()[:n]), cfg)


def assert_gradients_match_single_device(got, kv_heads: int = 0):
    """Loss and every gradient leaf of a `lag` against single device's (multi-head: step 1 of `single`)."""
    want = lag("single", kv_heads=kv_heads) if kv_heads else {"loss": single()["losses"][0], "grads": single()["grads"]}
    assert abs(got["loss"] - want["loss"]) < LOSS_ATOL
    assert reference.max_diff(got["grads"], want["grads"]) < GRAD_ATOL


def assert_lag_ledger_is_the_cost_model(got):
    """A `lag`'s ledger against the cost model's rows but the optimizer's (loss_and_grads runs none)."""
    runner, led = got["runner"], got["ledger"]
    cfg = runner.cfg
    assert_ledger_without_optimizer(led, cost.cost(cfg.model, runner.name, runner.sizes, cfg.train.batch_size,
                                                   grad_accum=cfg.train.grad_accum))
    return led


def ledger(record) -> hlo.Ledger:
    r = record["runner"]
    xs = jax.ShapeDtypeStruct((CFG.train.batch_size, CFG.model.context_length), np.int32, sharding=r.batch_sharding)
    return hlo.ledger(r.train_step.lower(r.abstract_state(), xs, xs).compile().as_text(), r.mesh)


def assert_matches_single_device(got):
    want = single()
    np.testing.assert_allclose(got["losses"], want["losses"], atol=LOSS_ATOL, rtol=0)
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=NORM_RTOL)
    assert reference.max_diff(got["params"], want["params"]) < PARAM_ATOL


def assert_ledger_is_the_cost_model(record):
    runner, led = record["runner"], ledger(record)
    cfg = runner.cfg
    model = cost.cost(cfg.model, runner.name, runner.sizes, cfg.train.batch_size, grad_accum=cfg.train.grad_accum)
    rows = cost.compare(led.summary(), model.summary())
    assert all(r["match"] for r in rows), cost.compare_table(rows) + "\n" + led.table()
    return led


# ----------------------------------------------------------------------------- the all-to-all pair


def test_seq_to_heads_gives_whole_sequences_of_a_head_slice_and_heads_to_seq_inverts_it():
    """On context:4, x [B, h, T, dh] placed T-split in, head-split out: the global array is unchanged
    (device j holds heads [j h/4, (j+1) h/4) of every position, in order); the gradient of the pair
    is the identity's, and seq_to_heads' pullback is heads_to_seq."""
    mesh = jax.make_mesh((4,), ("context",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    seq, heads = P(None, None, "context"), P(None, "context")
    x = jax.random.normal(jax.random.key(0), (2, 8, 16, 4))
    to_heads = jax.shard_map(lambda a: seq_to_heads(a, "context"), mesh=mesh, in_specs=seq, out_specs=heads)
    to_seq = jax.shard_map(lambda a: heads_to_seq(a, "context"), mesh=mesh, in_specs=heads, out_specs=seq)
    np.testing.assert_array_equal(jax.jit(to_heads)(x), x)
    np.testing.assert_array_equal(jax.jit(lambda a: to_seq(to_heads(a)))(x), x)
    w = jax.random.normal(jax.random.key(1), x.shape)
    np.testing.assert_array_equal(jax.jit(jax.grad(lambda a: jnp.sum(to_heads(a) * w)))(x), w)
    np.testing.assert_array_equal(jax.jit(jax.grad(lambda a: jnp.sum(to_seq(a) * w)))(x), w)


def test_kv_repeats_reach_a_multiple_of_context_that_divides_the_heads():
    assert [context.kv_repeats(8, kv, c) for kv, c in ((2, 2), (2, 4), (4, 2), (4, 4), (4, 8), (1, 4))] == [
        1, 2, 1, 1, 2, 4]


# ----------------------------------------------------------------------------- twins vs single device


@pytest.mark.parametrize("strategy", list(MESHES))
@pytest.mark.parametrize("impl", ["auto", "manual"])
def test_twins_match_single_device(impl, strategy):
    assert_matches_single_device(twin(impl, strategy))


# (4 kv heads on context:4, one a device with no repeat, went: its exchange and attention are those of
# 2 kv heads on context:4 after their repeat, one of the 4 a device, and its code path, no repeat, is
# 4 kv heads on context:2's; one cold compile less.)
@pytest.mark.parametrize("kv_heads, mesh", [(2, "context:4"), (4, "context:2")])
def test_grouped_query_attention_matches_single_device(kv_heads, mesh):
    """8 query heads: 2 kv heads on context:4 are each repeated twice first (context.kv_repeats), so the
    k, v all-to-alls carry 4 heads, one a device; 4 kv heads split two a device over context:2 (no
    repeat). Loss and gradients against single device's."""
    assert_gradients_match_single_device(lag("manual", mesh=mesh, kv_heads=kv_heads), kv_heads)
    if (kv_heads, mesh) == (2, "context:4"):
        assert_gradients_match_single_device(lag("auto", mesh=mesh, kv_heads=kv_heads), kv_heads)
        assert_lag_ledger_is_the_cost_model(lag("manual", mesh=mesh, kv_heads=kv_heads))


@pytest.mark.ulysses  # the proof of ulysses's ledger under --remat (tests/test_proofs.py)
def test_remat_full_saves_the_all_to_alls():
    """--remat=full: loss and gradients equal to single device, and the ledger is the cost model's
    16 all-to-alls (8 per layer): the checkpointed layer's backward does not re-run the forward 4
    (saves_exchanges)."""
    got = lag("manual", remat="full")
    assert_gradients_match_single_device(got)
    led = assert_lag_ledger_is_the_cost_model(got)
    testing.expect_collectives(led, "all-to-all", ("context",), count=8 * CFG.model.num_layers)


@pytest.mark.parametrize("impl", ["auto", "manual"])
def test_fsdp_ulysses_accumulates(impl):
    """grad_accum 2: loss and gradients equal to single device; the manual ledger is the cost model's
    at K = 2, the all-to-alls once per micro-batch."""
    got = lag(impl, "fsdp_ulysses", grad_accum=2)
    assert_gradients_match_single_device(got)
    if impl == "manual":
        led = assert_lag_ledger_is_the_cost_model(got)
        testing.expect_collectives(led, "all-to-all", ("context",), count=2 * 8 * CFG.model.num_layers)


# ----------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("strategy", list(MESHES))
def test_manual_ledger_equals_the_cost_model_exactly(strategy):
    """Per layer 4 all-to-alls over context forward and 4 backward, each [b, H, T/C, dh]; cp's
    gradient means (fsdp_ulysses: fsdp_cp's); nothing else over context."""
    led = assert_ledger_is_the_cost_model(twin("manual", strategy))
    sizes, m = twin("manual", strategy)["runner"].sizes, CFG.model
    c, d = sizes["context"], sizes["data"]
    each = CFG.train.batch_size // d * CFG.model.context_length // c * m.d_model * 4
    testing.expect_collectives(led, "all-to-all", ("context",), count=8 * m.num_layers)
    assert {r.bytes for r in led.filter(op="all-to-all")} == {each}
    testing.expect_no_collective(led, op="collective-permute")


def test_auto_inserts_all_to_alls():
    """GSPMD's resharding between the pinned layouts (auto_parallel/ulysses.py), measured: 9
    all-to-alls of [B, H, T/C, dh] per layer (3 forward, 6 backward), no all-gather over context."""
    led = ledger(twin("auto", "ulysses"))
    m = CFG.model
    testing.expect_collectives(led, "all-to-all", ("context",), count=9 * m.num_layers)
    assert {r.bytes for r in led.filter(op="all-to-all")} == {CFG.train.batch_size * m.context_length // 4 * m.d_model * 4}
    testing.expect_no_collective(led, op="all-gather")


# ----------------------------------------------------------------------------- refused


@pytest.mark.parametrize("make", [manual_parallel.make_runner, auto_parallel.make_runner])
def test_bad_configs_are_refused_before_compiling(make):
    four_heads = Config(dataclasses.replace(CFG.model, num_heads=4), CFG.train)
    with pytest.raises(ValueError, match=r"num_heads=4 does not split over context=8 .*multiple of 8.*context from "
                                         r"\[2, 4\].*--strategy=cp"):
        make("ulysses", "context:8", four_heads)
    odd = Config(dataclasses.replace(CFG.model, context_length=36), CFG.train)
    with pytest.raises(ValueError, match=r"context_length=36 does not split into 8 equal chunks \(contiguous layout"):
        make("ulysses", "context:8", odd)
    with pytest.raises(ValueError, match=r"--num_experts=4: a mixture of experts runs under .* not --strategy=ulysses"):
        make("ulysses", "context:4", preset("tiny_moe"))
    with pytest.raises(ValueError, match=r"stage"):
        make("ulysses", "stage:2,context:4", CFG)


# ----------------------------------------------------------------------------- memory, checkpoints

# The cost model's temporaries against the compiled step's memory_analysis().temp_size_in_bytes
# (tests/test_memory.py says what the two numbers are). Measured, temp / model (JAX 0.12.0.1,
# XLA:CPU): manual ulysses 1.03, fsdp_ulysses 0.92; auto ulysses 1.15, fsdp_ulysses 1.26 (GSPMD's
# nine all-to-alls per layer, test_auto_inserts_all_to_alls, keep more exchanged copies alive).
ULYSSES_BAND = (0.87, 1.33)


@pytest.mark.parametrize("strategy", list(MESHES))
@pytest.mark.parametrize("impl", ["auto", "manual"])
def test_compiled_temporaries_beside_the_memory_model(impl, strategy):
    r = twin(impl, strategy)["runner"]
    xs = jax.ShapeDtypeStruct((CFG.train.batch_size, CFG.model.context_length), np.int32, sharding=r.batch_sharding)
    temp = r.train_step.lower(r.abstract_state(), xs, xs).compile().memory_analysis().temp_size_in_bytes
    model = cost.memory(CFG.model, strategy, r.sizes, CFG.train.batch_size, CFG.model.context_length)
    assert ULYSSES_BAND[0] <= temp / model.temporaries <= ULYSSES_BAND[1], (temp, dataclasses.asdict(model))


@pytest.mark.ulysses
def test_a_checkpoint_written_under_ulysses_restores_under_single_and_cp(tmp_path):
    """The state after 3 manual ulysses steps (4 devices) restores bit for bit on one device and
    under cp on 4 (Orbax reshards it; both keep the weights whole)."""
    from twinshard.train.checkpoint import Checkpointer

    state = twin("manual", "ulysses")["state"]
    want = jax.device_get(state)
    ckpt = Checkpointer(str(tmp_path / "ulysses"))
    ckpt.save(STEPS, state, {"strategy": "ulysses"})
    targets = {"single": SingleDevice(CFG.model, CFG.train).abstract_state(),
               "cp": manual_parallel.make_runner("cp", "context:4", CFG, devices=jax.devices()[:4]).abstract_state()}
    for where, target in targets.items():
        got, _ = ckpt.restore(target, expect={"strategy": "ulysses"})
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(jax.device_get(got)), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=where)


@pytest.mark.skipif(not topology.libtpu_installed(),
                    reason="needs libtpu (the tpu extra) to compile for a TPU topology")
def test_splash_inside_ulysses_compiles_for_a_tpu_pod_with_the_models_all_to_alls():
    """The manual twin on v5e:4x4 (16 chips, AOT from this CPU host) in bf16 with --attention=splash:
    each device's whole-sequence heads go through the Pallas TPU kernel (Mosaic custom calls, not
    interpret mode: layers.compiling_for) and the ledger is the cost model's. Measured: 3 custom
    calls, compiled in 2.7 s."""
    from twinshard.model import layers

    mesh = {"data": 1, "context": 16, "tensor": 1}
    cfg = Config(dataclasses.replace(CFG.model, num_heads=16, context_length=128, dtype="bfloat16", attention="splash"),
                 dataclasses.replace(CFG.train, batch_size=2))
    r = manual_parallel.make_runner("ulysses", "context:16", cfg,
                                    devices=topology.mesh_devices(mesh, topology.devices("v5e:4x4", (2, 2, 1))))
    tokens = jax.ShapeDtypeStruct((2, 128), jnp.int32, sharding=r.batch_sharding)
    with layers.compiling_for("tpu"):
        lowered = r.train_step.lower(r.abstract_state(), tokens, tokens)
    text = topology.compile_for_pod(lowered).as_text()
    assert text.count("tpu_custom_call") >= 2  # the splash kernels, forward and backward
    rows = cost.compare(hlo.ledger(text, r.mesh).summary(), cost.cost(cfg.model, "ulysses", mesh, 2, 128).summary())
    assert [(row["op"], row["match"]) for row in rows] == [("all-to-all", True), ("all-reduce", True)], rows


@pytest.mark.ulysses
@pytest.mark.parametrize("kv_heads", [0, 2])
def test_explicit_twin_matches_single_device_with_the_manual_twins_all_to_alls(kv_heads):
    """explicit_parallel/ulysses.py: a reshard of q, k, v to head shards and of the output back is
    an all-to-all each, forward and backward, as the manual twin writes them (count and bytes).
    Multi-head: 3 steps against single device's training (measured: losses 9.5e-7, params 2.4e-7),
    the train steps' all-to-alls; 2 kv heads (repeated to 4): loss and gradients against single
    device's (measured: 9.5e-7, 1.3e-8), the loss_and_grads' all-to-alls (the optimizer runs none). Its all-reduces are not the
    manual twin's: JAX's rules reduce the norm gains' gradients inside the backward layer loop
    (explicit_parallel/runner.py)."""
    if kv_heads:
        got, manual = lag("explicit", kv_heads=kv_heads), lag("manual", kv_heads=kv_heads)
        assert_gradients_match_single_device(got, kv_heads)
        mine, theirs = got["ledger"].summary(), manual["ledger"].summary()
    else:
        got = record(explicit_parallel.make_runner("ulysses", "context:4", config(), devices=jax.devices()[:4]))
        want = single()
        np.testing.assert_allclose(got["losses"], want["losses"], atol=LOSS_ATOL, rtol=0)
        assert reference.max_diff(got["params"], want["params"]) < PARAM_ATOL
        mine, theirs = ledger(got).summary(), ledger(twin("manual", "ulysses")).summary()
    key = ("all-to-all", ("context",))
    assert (mine[key]["count"], mine[key]["bytes"]) == (theirs[key]["count"], theirs[key]["bytes"]), (mine, theirs)


def test_saved_residuals_of_every_variant_move_as_the_memory_model_says():
    """Manual ulysses on context:4, multi-head and 2 kv heads (repeated to 4 for the exchange: the
    memory model's GQA term), under --remat=none and full (which saves the 4 exchanges): what the
    layers save (JAX's print_saved_residuals) minus the memory model's activations is one constant
    for all four (the lm head's terms, alike in each), so every term that differs between them is exact."""
    from test_remat import B, T, runner_residuals

    gaps = {}
    for kv_heads in (0, 2):
        for remat in ("none", "full"):
            cfg = config(kv_heads)
            cfg = Config(dataclasses.replace(cfg.model, remat=remat), cfg.train)
            r = manual_parallel.make_runner("ulysses", MESHES["ulysses"], cfg, devices=jax.devices()[:4])
            saved = sum(n for shape, n, where in runner_residuals(r)  # the norm gains' [1, 1, D] aside, as test_remat
                        if "output of scan" in where and shape[1:] != (1, 1, cfg.model.d_model))
            gaps[kv_heads, remat] = saved - cost.memory(cfg.model, "ulysses", r.sizes, B, T).activations
    assert len(set(gaps.values())) == 1, gaps
