"""Grouped-query attention (ModelConfig.num_kv_heads) and the model shapes people plan with.

GQA: Hkv key/value heads, each shared by H/Hkv consecutive query heads (1: multi-query). The
kernels against a NumPy float64 GQA attention (tests/reference.py, kv heads repeated); both twins
of tp, fsdp_tp and tp_sp against single-device training, with the tensor axis splitting the kv
heads (it divides them) and replicating them (it is a multiple of them: every device slices its
own kv head, the weights' gradient summed over tensor); the manual ledger against the cost model;
cp, pp and ep running with GQA. Shapes: the Llama 3 presets' parameter counts against Meta's
published ones and a hand computation, the FLOPs per token, the shape flags of the launchers.

Configs: the twin tests' CFG (tests/runners.py: tiny with 8 heads of 8) with num_kv_heads 2 or 4.
"""

import dataclasses
import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import auto_parallel
import manual_parallel
import reference
from runners import CFG, assert_ledger_without_optimizer, initial_params, loss_and_grads
from twinshard import cost, hlo
from twinshard.config import Config, preset
from twinshard.model import layers
from twinshard import placed
from twinshard.parallel import strategies
from twinshard.hardware import topology
from twinshard.train.trainer import SingleDevice

needs_libtpu = pytest.mark.skipif(not topology.libtpu_installed(),
                                  reason="needs libtpu: uv run --locked --extra tpu pytest")


def gqa(kv: int, **model) -> Config:
    return Config(dataclasses.replace(CFG.model, num_kv_heads=kv, **model), CFG.train)


# ----------------------------------------------------------------------------- config and shapes


def test_num_kv_heads_defaults_to_num_heads_and_must_divide_it():
    m = CFG.model
    assert (m.num_kv_heads, m.kv_heads, m.kv_dim) == (0, 8, 64)  # 0: multi-head, kept 0 ...
    assert dataclasses.replace(m, num_heads=4).kv_heads == 4  # ... so another num_heads stays multi-head
    assert gqa(2).model.kv_dim == 16 and gqa(1).model.kv_heads == 1  # 1: multi-query
    for bad in (3, -1, 16):
        with pytest.raises(ValueError, match=rf"^ModelConfig.num_kv_heads={bad} \(--num_kv_heads\) must divide "
                                             r"num_heads=8.*choose --num_kv_heads from \[1, 2, 4, 8\]"):
            dataclasses.replace(m, num_kv_heads=bad)


def _hand_count(v, d, n_layers, kv_dim, f):
    """Embedding + lm_head, per layer q and output_proj [D, D], k and v [D, Hkv dh], w1 w2 w3 and
    two norm gains, then ln_final: the formula of ModelConfig.num_params, written out again."""
    return 2 * v * d + n_layers * (2 * d * d + 2 * d * kv_dim + 3 * d * f + 2 * d) + d


def test_llama3_presets_have_metas_published_shapes_and_parameter_counts():
    """Meta's config.json shapes; parameters 8.03B and 70.6B as Meta publishes them (8,030,261,248 and
    70,553,706,496 counted by hand here)."""
    small, large = preset("llama3_8b").model, preset("llama3_70b").model
    assert (small.d_model, small.num_layers, small.num_heads, small.kv_heads, small.d_ff) == (4096, 32, 32, 8, 14336)
    assert (large.d_model, large.num_layers, large.num_heads, large.kv_heads, large.d_ff) == (8192, 80, 64, 8, 28672)
    for m in (small, large):
        assert (m.vocab_size, m.padded_vocab_size, m.rope_theta, m.context_length, m.head_dim, m.kv_dim) == \
            (128256, 128256, 500000.0, 8192, 128, 1024)
    assert small.num_params() == _hand_count(128256, 4096, 32, 1024, 14336) == 8_030_261_248
    assert large.num_params() == _hand_count(128256, 8192, 80, 1024, 28672) == 70_553_706_496
    assert round(small.num_params() / 1e9, 2) == 8.03 and round(large.num_params() / 1e9, 1) == 70.6


def test_a_gqa_tree_has_narrow_k_and_v_and_the_counted_size():
    """The real parameter tree of a small GQA model: k and v [L, D, Hkv*dh] on the kv_heads axis, its
    size num_params (and the hand formula), the cost model's weights the same leaves."""
    from twinshard.train import trainer

    m = gqa(2).model
    shapes = jax.eval_shape(functools.partial(trainer.create_params, m, 0))
    axes = trainer.logical_axes(m)
    attn = shapes["layers"]["attn"]
    assert attn["q_proj"]["weight"].shape == (2, 64, 64) and attn["k_proj"]["weight"].shape == (2, 64, 16)
    assert attn["v_proj"]["weight"].shape == (2, 64, 16)
    assert axes["layers"]["attn"]["v_proj"]["weight"] == ("layers", "embed", "kv_heads")
    size = sum(a.size for a in jax.tree.leaves(shapes))
    assert size == m.num_params() == _hand_count(384, 64, 2, 16, 192)
    assert sum(w.leaves * w.layers * w.size for w in cost.weights(m)) == size


def test_flops_per_token_are_6_n_plus_attention():
    """A step's FLOPs per token: 6 N_mm (N_mm = N without the embedding table and the 2L+1 norm
    gains; GQA's narrower k and v count as they are) plus attention's 12 L T H dh."""
    for m, b, t in ((preset("llama3_8b").model, 4, 8192), (gqa(2).model, 8, 32), (CFG.model, 8, 32)):
        n_mm = m.num_params() - m.padded_vocab_size * m.d_model - (2 * m.num_layers + 1) * m.d_model
        f = cost.flops(m, b, t)
        assert f.matmul_params == n_mm
        assert f.total == b * t * (6 * n_mm + 12 * m.num_layers * t * m.num_heads * m.head_dim)


# ----------------------------------------------------------------------------- the kernels


def _qkv(rng, b=2, h=8, hk=2, t=32, dh=16):
    return (rng.normal(size=(b, h, t, dh)), rng.normal(size=(b, hk, t, dh)), rng.normal(size=(b, hk, t, dh)))


def _float64_vjp(q, k, v, do):
    """GQA attention and (dq, dk, dv) in float64 by hand: reference.attention_vjp on the kv heads
    repeated over their groups, each kv head's gradient the sum over its group."""
    group = q.shape[1] // k.shape[1]
    mask = np.tril(np.ones((q.shape[2],) * 2, bool))
    out, (dq, dk, dv) = reference.attention_vjp(q, np.repeat(k, group, 1), np.repeat(v, group, 1), mask, do)
    fold = lambda g: g.reshape(g.shape[0], -1, group, *g.shape[2:]).sum(2)  # noqa: E731
    return out, (dq, fold(dk), fold(dv))


@pytest.mark.parametrize("hk", [1, 2, 8])
@pytest.mark.parametrize("impl", ["reference", "recompute", "xla"])
def test_every_kernel_is_float64_gqa_attention(impl, hk):
    """Forward and gradients of layers.causal_attention with 8 query heads and hk kv heads (1:
    multi-query, 8: multi-head) against the float64 GQA attention. Measured (f32, [2, 8, 32, 16],
    JAX 0.12 XLA:CPU): outputs within 4.8e-7 of it, gradients within 2.9e-6 (multi-query's dv, a sum
    over 8 query heads); tolerances ~10x. (cuDNN's is checked on a GPU by tools/gpu_bench.sh.)"""
    rng = np.random.default_rng(hk)
    q, k, v = _qkv(rng, hk=hk)
    do = rng.normal(size=q.shape)
    want, grads = _float64_vjp(q, k, v, do)
    f32 = [jnp.asarray(a, jnp.float32) for a in (q, k, v, do)]

    @jax.jit  # one program (op by op, the kernel and its pullback compiled 15-33 small ones)
    def forward_and_pullback(q, k, v, do):
        out, vjp = jax.vjp(lambda *a: layers.causal_attention(*a, impl), q, k, v)
        return out, vjp(do)

    got, pulled = forward_and_pullback(*f32)
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-6)
    for g, w in zip(pulled, grads):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=3e-5)


def test_gqa_is_multi_head_attention_on_repeated_kv_heads():
    """The grouping itself: query head i attends with kv head i // (H/Hkv) (jax.nn's
    layout): the recompute kernel on k, v equals it on k, v repeated per query head."""
    q, k, v = (jnp.asarray(a, jnp.float32) for a in _qkv(np.random.default_rng(0)))
    rep = lambda x: jnp.repeat(x, 4, axis=1)  # noqa: E731
    # Bitwise on the AVX2 and AVX-512 Xeons measured before; on a Xeon with AMX and AVX512-FP16 the
    # grouped and repeated einsums round differently (XLA:CPU's dot kernels follow the CPU): 2.4e-7.
    np.testing.assert_allclose(layers.causal_attention(q, k, v, "reference"),
                               layers.causal_attention(q, rep(k), rep(v), "reference"), rtol=0, atol=1e-6)
    np.testing.assert_allclose(layers.causal_attention(q, k, v, "recompute"),
                               layers.causal_attention(q, rep(k), rep(v), "recompute"), rtol=0, atol=1e-6)


def test_the_model_is_the_float64_gqa_transformer():
    """Logits of a GQA TransformerLM from its CS336 state dict (k, v [Hkv*dh, D]) against the
    float64 reference model. Measured: 9.1e-7 apart (logits up to 2.9)."""
    from flax import nnx

    from twinshard.model import state_dict
    from twinshard.train.trainer import graphdef

    m = gqa(2).model
    # the twin tests' initial params (tests/runners.py, on the host), merged: no init compiled for this test
    model = nnx.merge(graphdef(m), jax.device_put(initial_params(gqa(2))))
    sd = state_dict(model)
    assert sd["layers.0.attn.k_proj.weight"].shape == (16, 64) and sd["layers.1.attn.q_proj.weight"].shape == (64, 64)
    tokens = np.random.default_rng(1).integers(0, m.vocab_size, (2, m.context_length))
    got = np.asarray(nnx.jit(lambda model, t: model(t))(model, jnp.asarray(tokens)))[..., :m.vocab_size]
    sd64 = {n: w.astype(np.float64) for n, w in sd.items()}
    want = reference.transformer_lm(sd64, tokens, m.num_layers, m.num_heads, m.rope_theta)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


# ----------------------------------------------------------------------------- placement


def test_the_tensor_axis_splits_the_kv_heads_it_divides_and_replicates_the_others():
    tp = strategies.get("tp")
    assert tp.placed(8, {"data": 1, "tensor": 4}) is tp  # 8 kv heads over 4: split
    replicated = tp.placed(2, {"data": 1, "tensor": 8})  # 2 kv heads, tensor 8: each replicated 4 times
    assert "kv_heads" not in replicated.params and "kv_heads" not in replicated.activations
    assert dict(replicated.params) == {k: v for k, v in tp.params.items() if k != "kv_heads"}
    specs = lambda kv, rules: placed.param_specs(gqa(kv), rules)["layers"]["attn"]  # noqa: E731
    assert specs(2, tp.placed(2, {"tensor": 2}).params)["k_proj"]["weight"] == jax.sharding.PartitionSpec(
        None, None, "tensor")
    assert specs(2, replicated.params)["v_proj"]["weight"] == jax.sharding.PartitionSpec(None, None, None)
    assert specs(2, replicated.params)["q_proj"]["weight"] == jax.sharding.PartitionSpec(None, None, "tensor")


def test_a_tensor_axis_that_cuts_a_kv_head_group_is_refused():
    """6 query heads in 3 kv groups on tensor 2: a device's 3 query heads would span two kv heads."""
    from twinshard.parallel.resolve import resolve_run

    cfg = Config(dataclasses.replace(CFG.model, d_model=96, num_heads=6, num_kv_heads=3), CFG.train)
    with pytest.raises(ValueError, match=r"kv_heads=3 neither divides nor is divided by mesh axis tensor=2.*"
                                         r"make num_kv_heads \(--num_kv_heads\) a divisor or a multiple of 2"):
        resolve_run("tp", "manual", "data:1,tensor:2", cfg, jax.devices()[:2])
    resolve_run("tp", "manual", "data:1,tensor:3", cfg, jax.devices()[:3])  # 3 kv heads over 3: split
    resolve_run("tp", "manual", "data:1,tensor:6", cfg, jax.devices()[:6])  # over 6: each replicated twice


# ----------------------------------------------------------------------------- both twins against single device

# (kv heads, strategy, mesh): the tensor axis replicating the kv heads (2 kv heads on tensor 8 or 4;
# tp_sp with data 2: their gradient sum joins the mean over data) and splitting them (4 on tensor 4).
RUNS = [(2, "tp", "data:1,tensor:8"), (2, "fsdp_tp", "data:2,tensor:4"), (4, "fsdp_tp", "data:2,tensor:4"),
        (2, "tp_sp", "data:2,tensor:4")]
STEPS = 3
# Measured here (JAX 0.12, XLA:CPU) against single device: losses 1.9e-6 (ep; the twins 1.4e-6),
# gradients 1.7e-8 (ep; the twins 1.5e-8); params after 3 AdamW steps 5.1e-6 and grad norms 8.2e-8
# relative (max over RUNS and both twins, when each trained). The tolerances of the data x tensor
# twins' tests (tests/test_data_tensor.py).
LOSS_ATOL, GRAD_ATOL, PARAM_ATOL, NORM_RTOL = 2e-5, 2e-7, 2e-5, 1e-6


@functools.cache
def lag(impl: str, kv: int, strategy: str, mesh: str, microbatches: int = 1) -> dict:
    """The run's loss_and_grads compiled once on gqa(kv)'s initial params and first batch
    (tests/runners.py): loss, gradients (in the model's layer order) and ledger. impl 'single': one
    device (strategy and mesh unused). What GQA changes (the kv heads each device slices, their
    gradient summed over the query-head groups) is all in loss_and_grads: the train step adds the
    optimizer, which the twin tests of each strategy prove (one multi-step run below with GQA)."""
    cfg = gqa(kv)
    if microbatches > 1:  # a pipeline's; SingleDevice ignores it (one device: the whole batch at once)
        cfg = Config(cfg.model, dataclasses.replace(cfg.train, microbatches=microbatches))
    if impl == "single":
        return loss_and_grads(SingleDevice(cfg.model, cfg.train), cfg)
    make = manual_parallel.make_runner if impl == "manual" else auto_parallel.make_runner
    n = math.prod(int(part.split(":")[1]) for part in mesh.split(","))
    out = loss_and_grads(make(strategy, mesh, cfg, jax.devices()[:n]), cfg)
    return {**out, "grads": out["runner"].to_model(out["grads"])}


# GSPMD places the kv heads itself: its twin on tp (2 kv heads over 8 shards) and on fsdp_tp (4 over 4).
# The manual tp run (RUNS[0]) is test_training_with_replicated_kv_heads_matches_single_device's: its
# train steps hold the step-1 loss and gradients this test compared (a loss_and_grads beside the
# train step of the same config: one cold compile less).
TWIN_RUNS = [("manual", *run) for run in RUNS[1:]] + [("auto", *run) for run in RUNS[:1] + RUNS[2:3]]


@pytest.mark.parametrize("impl, kv, strategy, mesh", TWIN_RUNS)
def test_twin_with_gqa_matches_single_device(impl, kv, strategy, mesh):
    """Loss and every gradient leaf against single device's on the same params and batch."""
    got, want = lag(impl, kv, strategy, mesh), lag("single", kv, "", "")
    assert abs(got["loss"] - want["loss"]) < LOSS_ATOL
    assert reference.max_diff(got["grads"], want["grads"]) < GRAD_ATOL


@functools.cache
def replicated_kv_training() -> tuple[dict, dict]:
    """STEPS AdamW steps (tests/reference.py train_record) of the manual tp twin with 2 kv heads on
    tensor 8 (RUNS[0]) and of single device, from each one's own init."""
    cfg = gqa(2)
    got = reference.train_record(manual_parallel.make_runner("tp", "data:1,tensor:8", cfg), cfg, STEPS, grads=False)
    return got, reference.train_record(SingleDevice(cfg.model, cfg.train), cfg, STEPS, grads=False)


@pytest.mark.tp
def test_training_with_replicated_kv_heads_matches_single_device():
    """STEPS AdamW steps of the manual tp twin with 2 kv heads on tensor 8 (each replicated 4 times:
    its leaves whole on every device, their gradient summed over tensor) against single device: the
    same init, losses, reported global norms (no replicated leaf counted 4 times) and params. Holds
    test_twin_with_gqa_matches_single_device[manual-2-tp-...]'s claim too: the step-1 loss is the
    first of the losses, and a wrong gradient changes the params after the steps or, scaled per leaf
    (AdamW is scale-free), the global norm (tests/reference.py train_record)."""
    got, want = replicated_kv_training()
    assert reference.max_diff(got["init"], want["init"]) == 0.0  # the same tree and init on any mesh
    np.testing.assert_allclose(got["losses"], want["losses"], atol=LOSS_ATOL, rtol=0)
    assert reference.max_diff(got["params"], want["params"]) < PARAM_ATOL
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=NORM_RTOL)


def _assert_ledger_is_the_model(run: dict, cfg):
    """The compiled loss_and_grads' ledger against the cost model's rows but the optimizer's."""
    runner = run["runner"]
    assert_ledger_without_optimizer(run["ledger"], cost.cost(cfg.model, runner.name, runner.sizes, cfg.train.batch_size))
    return run["ledger"]


def _train_step_ledger(runner, cfg) -> hlo.Ledger:
    """The ledger of the runner's compiled train step (the persistent cache's, after it trained) against
    the cost model's every row, the optimizer's included."""
    xs = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32, sharding=runner.batch_sharding)
    led = hlo.ledger(runner.train_step.lower(runner.abstract_state(), xs, xs).compile(), runner.mesh)
    rows = cost.compare(led.summary(), cost.cost(cfg.model, runner.name, runner.sizes, cfg.train.batch_size).summary())
    assert all(r["match"] for r in rows), cost.compare_table(rows) + "\n" + led.table()
    return led


@pytest.mark.parametrize("kv, strategy, mesh", RUNS)
def test_manual_ledger_with_gqa_is_the_cost_model(kv, strategy, mesh):
    """Every (op, axes) row equal; where tensor replicates the kv heads, the k and v gradients'
    sums over tensor are there: 2 all-reduces of L x D x Hkv dh f32 (/ data under fsdp_tp). The tp run's
    ledger is its train step's (replicated_kv_training compiles no loss_and_grads of it)."""
    if (kv, strategy, mesh) == RUNS[0]:
        runner = replicated_kv_training()[0]["runner"]
        led = _train_step_ledger(runner, gqa(kv))
    else:
        run = lag("manual", kv, strategy, mesh)
        runner, led = run["runner"], _assert_ledger_is_the_model(run, gqa(kv))
    if kv % runner.sizes["tensor"] == 0:
        return
    m, d = gqa(kv).model, runner.sizes["data"] if strategy == "fsdp_tp" else 1
    leaf = m.num_layers * m.d_model * m.kv_dim * 4 // d
    axes = ("data", "tensor") if strategy == "tp_sp" and runner.sizes["data"] > 1 else ("tensor",)
    sums = [r for r in led.filter(op="all-reduce", axes=axes) if r.bytes == leaf]
    assert sum(r.multiplicity for r in sums) == 2, led.table()


def test_gqa_shrinks_ring_attention_blocks_and_cp_equals_single_device():
    """cp on 8 context shards with 2 kv heads: each ring hop carries a [B, 2, T/8, dh] K or V block,
    a quarter of multi-head's; the ledger is the cost model's, loss and gradients single device's."""
    cfg, run = gqa(2), lag("manual", 2, "cp", "context:8")
    led = _assert_ledger_is_the_model(run, cfg)
    m, b = cfg.model, cfg.train.batch_size
    hops = led.filter(op="collective-permute")
    block = b * m.context_length // 8 * m.kv_dim * 4
    assert sum(r.multiplicity for r in hops) == 2 * 2 * 7 * m.num_layers and {r.bytes for r in hops} == {block}
    mha = cost.cost(CFG.model, "cp", run["runner"].sizes, b).summary()[("collective-permute", ("context",))]["bytes"]
    assert 4 * sum(r.bytes * r.multiplicity for r in hops) == mha
    want = lag("single", 2, "", "")
    assert abs(run["loss"] - want["loss"]) < LOSS_ATOL
    assert reference.max_diff(run["grads"], want["grads"]) < GRAD_ATOL


@pytest.mark.parametrize("strategy, mesh, preset_name", [("pp", "stage:2", None), ("ep", "data:2,expert:4", "tiny_moe")])
def test_pipeline_and_experts_run_with_gqa(strategy, mesh, preset_name):
    """The strategies that do not split heads compute a GQA model's loss and gradients as single device
    does (manual twin; pp: 2 stages, 2 micro-batches; ep: tiny_moe with 8 query heads, 2 kv heads)."""
    if strategy == "pp":
        got, want = lag("manual", 2, "pp", mesh, microbatches=2), lag("single", 2, "", "")
    else:
        base = preset(preset_name)
        cfg = Config(dataclasses.replace(base.model, num_heads=8, num_kv_heads=2), base.train)
        got = loss_and_grads(manual_parallel.make_runner(strategy, mesh, cfg), cfg)
        want = loss_and_grads(SingleDevice(cfg.model, cfg.train), cfg)
    assert abs(got["loss"] - want["loss"]) < LOSS_ATOL
    assert reference.max_diff(got["grads"], want["grads"]) < GRAD_ATOL


# ----------------------------------------------------------------------------- the memory model


@pytest.mark.parametrize("kv, mesh", [(2, None), (2, "data:1,tensor:8"), (4, "data:1,tensor:4")])
def test_saved_residuals_with_gqa_are_the_memory_model(kv, mesh):
    """What a layer saves (JAX's print_saved_residuals, counted as tests/test_remat.py does) is
    cost.saved_per_layer with k, v kv_local wide: single device, manual tp replicating the kv heads
    (which also keeps each layer's two kv head slices [D, dh]) and splitting them."""
    from test_remat import B, T, residuals, runner_residuals
    from twinshard.train.trainer import create_params, loss_fn

    m = gqa(kv).model
    if mesh is None:
        tokens = jax.ShapeDtypeStruct((B, T), np.int32)
        saved, t = residuals(functools.partial(loss_fn, cfg=m), jax.eval_shape(lambda: create_params(m, 0)),
                             tokens, tokens), 1
    else:
        t = int(mesh.split(":")[-1])
        saved = runner_residuals(manual_parallel.make_runner("tp", mesh, gqa(kv), jax.devices()[:t]))
    scan = sum(n for shape, n, where in saved if "output of scan" in where and shape[1:] != (1, 1, m.d_model))
    assert scan == 4 * (m.num_layers * cost.saved_per_layer(m, "none", B, T, t) + B * T * m.d_model)


# ----------------------------------------------------------------------------- the launchers' shape flags


def _flags(**given):
    from launch import common

    names = ("preset", "steps", "batch_size", "lr", "seed", "optimizer", "grad_accum", "grad_accum_dtype", "microbatches",
             "schedule",
             "virtual_stages", "cp_layout", "tokenizer", "strategy", "mesh", "dcn_mesh", "dtype", "attention", "scan_unroll", "remat",
             "collective_matmul", *common.SHAPE_FLAGS, *common.MOE_FLAGS)
    return types.SimpleNamespace(**{"devices": 8, "strategy": "single", **{n: None for n in names},
                                    "preset": "tiny", **given})


def test_shape_flags_give_any_shape_and_name_themselves_in_errors():
    from launch import common

    m = common.config_from_flags(_flags(d_model=96, num_layers=3, num_heads=6, num_kv_heads=2,
                                        context_length=64, vocab_size=300)).model
    assert (m.d_model, m.num_layers, m.num_heads, m.kv_heads, m.context_length, m.vocab_size) == (96, 3, 6, 2, 64, 300)
    assert m.d_ff == 256  # a new d_model re-derives 8/3 d_model (rounded up to 64)
    assert common.config_from_flags(_flags(preset="llama3_8b", num_layers=2, d_ff=512)).model.num_kv_heads == 8
    with pytest.raises(ValueError, match=r"^--num_kv_heads=3: ModelConfig.num_kv_heads=3 \(--num_kv_heads\)"):
        common.config_from_flags(_flags(num_kv_heads=3))
    with pytest.raises(ValueError, match=r"^--d_model=66: ModelConfig.d_model=66 is not divisible by num_heads=4"):
        common.config_from_flags(_flags(d_model=66))
    with pytest.raises(ValueError, match=r"--vocab_size=100 is below the 257 ids of the preset's tokenizer bytes"):
        common.config_from_flags(_flags(vocab_size=100))
    # the boundary: exactly the tokenizer's 257 ids is a vocabulary (its padding rounds it up), one fewer is not
    assert common.config_from_flags(_flags(vocab_size=257)).model.vocab_size == 257
    with pytest.raises(ValueError, match=r"^--vocab_size=256 is below the 257 ids .*pass --vocab_size >= 257"):
        common.config_from_flags(_flags(vocab_size=256))
    with pytest.raises(ValueError, match=r"--vocab_size=300 and --tokenizer=bytes: .*pass one of them"):
        common.config_from_flags(_flags(vocab_size=300, tokenizer="bytes"))


def test_plan_takes_the_shape_flags(tmp_path):
    """launch.plan on llama3_8b with 16 layers and multi-query attention: the plan's model is that shape."""
    import json

    from cli import run

    out = tmp_path / "plan.json"
    proc = run("-m", "launch.plan", "--preset=llama3_8b", "--num_layers=16", "--num_kv_heads=1",
               "--topology=h100:1x8", "--top=1", f"--json={out}")
    assert proc.returncode == 0, proc.stderr
    m = preset("llama3_8b").model
    want = dataclasses.replace(m, num_layers=16, num_kv_heads=1).num_params()
    assert f"{want / 1e9:.2f}B-parameter model" in proc.stdout, proc.stdout


def test_bench_takes_the_shape_flags():
    """launch.bench reads the same flag definitions (launch/common.py) into its config."""
    from absl import flags

    from launch import bench

    flags.FLAGS.unparse_flags()
    flags.FLAGS(["bench", "--preset=maxtext_llama_ref", "--num_kv_heads=2", "--num_layers=2", "--d_model=128"])
    try:
        m = bench.config_from_flags().model
    finally:
        flags.FLAGS.unparse_flags()
    assert (m.kv_heads, m.num_layers, m.d_model, m.num_heads, m.d_ff) == (2, 2, 128, 4, 384)


@needs_libtpu
def test_collectives_on_a_tpu_topology_takes_the_shape_flags(tmp_path):
    """launch.collectives --topology (a TPU v5e 2x4 compiled here) with GQA replicated over tensor 8:
    the manual ledger as the TPU compiles it is the cost model's, kv sums included."""
    import json

    from cli import run

    out = tmp_path / "c.json"
    proc = run("-m", "launch.collectives", "--preset=tiny", "--num_heads=8", "--num_kv_heads=2", "--strategy=tp",
               "--impl=manual", "--mesh=data:1,tensor:8", "--topology=v5e:2x4", f"--json={out}", timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["tpu_comparison"] and all(r["match"] for r in doc["tpu_comparison"]), proc.stdout
    assert sum(r["count"] for r in doc["model"]["collectives"] if "kv heads replicated" in r["what"]) == 2
