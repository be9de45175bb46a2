"""The accelerator-speed options of ModelConfig (launch flags of the same names), each off by default:

- logits_dtype="compute": the LM head's logits stay in the compute dtype, forward and backward, with
  float32 statistics (no float32 [tokens, V] array in the traced step, chunked or not);
  loss_recompute=False: the chunked loss saves each chunk's logits instead of recomputing them;
- norm_dtype="compute": RMSNorm in the compute dtype, the mean of squares accumulated in float32;
- qkv_layout="heads": q, k, v einsummed straight into the kernel's [B, h, T, dh] (no transposes
  around attention in a v5e compile);
- splash_fused_bwd / attention_block / xla_tpu_scoped_vmem_limit_kib: seen in a v5e compile (the
  kernel's block sizes, its separate dq kernel, a block of 2048 that compiles only with the limit).
Each keeps the loss within the bf16 bound of the default and the twins equal to single device.
"""

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import auto_parallel
import reference
from runners import CFG, MESHES, initial_params, loss_and_grads, max_relative_diff, twin_runner
from traced import gradient_step_equations
from launch import fit
from twinshard import cost
from twinshard.config import Config, rope_on_halves
from twinshard.splash_blocks import splash_block
from twinshard.parallel.resolve import single_run
from twinshard.hardware import topology
from twinshard.model import layers
from twinshard.train import trainer

BF16 = Config(dataclasses.replace(CFG.model, dtype="bfloat16"), CFG.train)
B = 3  # B*T differs from every weight dimension (tiny: T 32, D 64)
needs_libtpu = pytest.mark.skipif(not topology.libtpu_installed(),
                                  reason="needs libtpu: uv run --locked --extra tpu pytest")


def model(**over):
    return dataclasses.replace(BF16.model, **over)


def float32_arrays(cfg, keep) -> set[tuple[int, ...]]:
    """Shapes of the float32 arrays `keep(shape)` selects among every value of the traced gradient step
    (sub-jaxprs of scans, checkpoints and custom rules included)."""
    return {v.aval.shape for eqn in gradient_step_equations(cfg, B) for v in eqn.outvars
            if getattr(v.aval, "dtype", None) == jnp.float32 and keep(v.aval.shape)}


def _vocab_wide(cfg):
    """[..., V_pad] but not the lm_head weight's [D, V_pad] (its float32 gradient is the parameter's)."""
    return lambda s: len(s) >= 2 and s[-1] == cfg.padded_vocab_size and s != (cfg.d_model, cfg.padded_vocab_size)


@pytest.mark.parametrize("chunks, recompute", [(0, True), (2, True), (2, False)])
def test_compute_logits_leave_no_float32_array_of_vocab_width(chunks, recompute):
    compute = model(logits_dtype="compute", loss_chunks=chunks, loss_recompute=recompute)
    assert float32_arrays(compute, _vocab_wide(compute)) == set()
    default = model(loss_chunks=chunks, loss_recompute=recompute)
    assert float32_arrays(default, _vocab_wide(default))  # float32 logits: the check can fail


def test_the_narrow_statistics_accumulate_in_float32():
    """The bf16 loss's sum of exponentials and the bf16 norm's mean square (layers.row_dot) come out of
    the dot in float32, not bf16: invisible in XLA:CPU's values, visible in the traced program."""
    from twinshard.model import loss

    e = jax.ShapeDtypeStruct((4, 8, 512), jnp.bfloat16)
    (dot,) = [q for q in jax.make_jaxpr(layers.row_dot)(e, e).eqns if q.primitive.name == "dot_general"]
    assert dot.params["preferred_element_type"] == jnp.float32 and dot.outvars[0].aval.dtype == jnp.float32
    assert jax.eval_shape(loss.row_sum, e).dtype == jnp.float32


def test_compute_norms_leave_no_float32_residual_stream():
    m = BF16.model
    stream = lambda s: s in ((B, m.context_length, m.d_model), (B * m.context_length, m.d_model))  # noqa: E731
    assert float32_arrays(model(norm_dtype="compute"), stream) == set()
    assert float32_arrays(model(), stream)


# Measured (tiny, bf16 compute, one batch): |loss - default| <= 4e-3 for every option; gradients
# within 2.5% of the largest entry per leaf. bf16 rounds 2^-9 relative per value: the bound is that
# of two bf16 programs, not of float32.
LOSS_ATOL, GRAD_RTOL = 1e-2, 5e-2
OPTIONS = [{"logits_dtype": "compute"}, {"logits_dtype": "compute", "loss_chunks": 2},
           {"logits_dtype": "compute", "loss_chunks": 2, "loss_recompute": False},
           {"loss_chunks": 2, "loss_recompute": False}, {"norm_dtype": "compute"}, {"qkv_layout": "heads"}]


@functools.cache
def each_option() -> list:
    """(loss, gradients) of the default bf16 model, then of each of OPTIONS, at the initial params on one
    [B, T] batch: one program for all seven (measured: 8.7 s of CPU to compile, where two compiled apart
    took 5.1)."""
    params = initial_params(BF16)
    x, y = reference.random_batches(B, BF16.model.context_length, BF16.model.vocab_size, 1)[0]
    grads = [jax.value_and_grad(functools.partial(trainer.loss_fn, cfg=model(**over))) for over in [{}, *OPTIONS]]
    return jax.device_get(jax.jit(lambda p, x, y: [f(p, x, y) for f in grads])(params, x, y))


@pytest.mark.parametrize("over", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_each_option_keeps_loss_and_gradients_within_bf16_of_the_default(over):
    (want_loss, want), (got_loss, got) = each_option()[0], each_option()[1 + OPTIONS.index(over)]
    assert abs(float(got_loss) - float(want_loss)) < LOSS_ATOL
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=GRAD_RTOL * float(np.abs(w).max()), rtol=0)


# Every option on at once, bf16: each twin's loss and gradients against single device's, from one compile of
# each gradient program. The manual twin on tp (heads split over `tensor`: the heads layout's einsums, the
# vocab-parallel loss in the compute dtype), GSPMD's on fsdp (the single-device code, gathered weights).
# The manual twin on fsdp runs the same model code as GSPMD's (left out: a compile of no new code path).
# Training on from here is each strategy's twin test's (tests/test_data_tensor.py): the options change
# the forward and backward, not the update.
ALL_ON = Config(model(logits_dtype="compute", norm_dtype="compute", qkv_layout="heads", loss_chunks=2,
                      loss_recompute=False), CFG.train)
# Measured (bf16, step 1): twin vs single loss within 2.0e-4 (manual tp; auto fsdp 2.2e-5), gradients within
# 1.2e-2 of each leaf's largest entry (auto fsdp 9.0e-3): bf16 sums in another order round differently (2^-9
# relative per value). The loss bound is tests/test_precision.py's, the gradients' GRAD_RTOL above.
TWIN_LOSS_ATOL, TWIN_GRAD_RTOL = 2e-3, GRAD_RTOL
TWINS = [("manual", "tp"), ("auto", "fsdp")]


@pytest.mark.parametrize("impl, strategy", TWINS, ids=[f"{i}-{s}" for i, s in TWINS])
def test_twins_equal_single_device_with_every_option_on(impl, strategy):
    got = loss_and_grads(twin_runner(f"{impl} {strategy}", ALL_ON), ALL_ON)
    want = _single_all_on()
    assert abs(got["loss"] - want["loss"]) < TWIN_LOSS_ATOL
    assert max_relative_diff(got["grads"], want["grads"]) < TWIN_GRAD_RTOL


@functools.cache
def _single_all_on() -> dict:
    return loss_and_grads(twin_runner("single", ALL_ON), ALL_ON)


@pytest.mark.parametrize("heads", [8, 1], ids=["head_dim 8", "head_dim 64, halves"])
def test_heads_layout_attends_as_the_tokens_layout_in_float32(heads, monkeypatch):
    """Where twinshard.config.rope_on_halves (here forced at head_dim 64, as at 256 on a TPU), the heads layout projects q
    and k with each head's features as (evens, odds), so RoPE rotates two contiguous halves; one permutation of
    both leaves every score q.k as it was: either way the layer equals the tokens layout's to float32
    rounding. Its q [B, h, T, dh] is the tokens layout's with that permutation (v as it was)."""
    from flax import nnx

    from twinshard.model import attention

    assert [rope_on_halves(dh) for dh in (8, 64, 128, 256, 512)] == [False, False, False, True, True]
    monkeypatch.setattr(attention, "rope_on_halves", lambda dh: dh == 64)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, CFG.model.context_length, CFG.model.d_model)),
                    jnp.float32)
    tokens, heads_layout = (attention.CausalSelfAttention(model(qkv_layout=layout, dtype="float32", num_heads=heads),
                                                          rngs=nnx.Rngs(0)) for layout in ("tokens", "heads"))
    np.testing.assert_allclose(heads_layout(x), tokens(x), rtol=1e-5, atol=1e-6)
    dh, (wq, _, wv, _) = CFG.model.d_model // heads, tokens.weights()
    as_heads = lambda p: p.reshape(*p.shape[:2], -1, dh).transpose(0, 2, 1, 3)  # noqa: E731  [B, T, h*dh] -> [B, h, T, dh]
    np.testing.assert_allclose(attention.project_heads(x, wq, dh, halves=True),
                               as_heads(x @ wq)[..., layers.evens_then_odds(dh)], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(attention.project_heads(x, wv, dh), as_heads(x @ wv), rtol=1e-5, atol=1e-6)


def test_heads_layout_is_refused_where_the_strategy_places_its_own_matmuls():
    cfg = Config(model(qkv_layout="heads"), CFG.train)
    runner = auto_parallel.make_runner("tp_sp", MESHES["tp"], cfg)
    xs = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32, sharding=runner.batch_sharding)
    with pytest.raises(ValueError, match="--qkv_layout=tokens"):
        runner.train_step.lower(runner.abstract_state(), xs, xs)


# ----------------------------------------------------------------------------- v5e compiles (no chip)

def _tpu_compiled(cfg: Config):
    """The single-device train step of `cfg` compiled for one v5e chip from this CPU host."""
    (chip,) = topology.devices("v5e:1x1")
    runner = trainer.SingleDevice(cfg.model, cfg.train)
    runner.sharding = jax.sharding.SingleDeviceSharding(chip)  # the state (hence the step) on the chip
    xs = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32, sharding=runner.sharding)
    with layers.compiling_for("tpu"):
        lowered = runner.train_step.lower(runner.abstract_state(), xs, xs)
    return topology.compile_for_pod(lowered)


@functools.cache
def _tpu_single(cfg: Config) -> str:
    """_tpu_compiled's HLO text, compiled once for the module (~5-10 s of CPU a step)."""
    return _tpu_compiled(cfg).as_text()


SPLASH = Config(model(attention="splash", context_length=256, d_model=256, num_heads=2, num_layers=1),
                dataclasses.replace(CFG.train, batch_size=4))
# The two splash steps the layout and the kernel-option tests read: each layout with its own block and
# backward (both layouts hand the kernel the same layers.Splash, so each pairing proves both options reach it).
SPLASH_STEPS = {"tokens": (128, True), "heads": (256, False)}


def splash_step(layout: str) -> Config:
    block, fused = SPLASH_STEPS[layout]
    return Config(dataclasses.replace(SPLASH.model, qkv_layout=layout, attention_block=block, splash_fused_bwd=fused),
                  SPLASH.train)


def _copies_of(text: str, shape: tuple[int, ...]) -> int:
    """transpose and copy instructions (or fusions named for one) producing an array of `shape`."""
    dims = ",".join(map(str, shape))
    return len(re.findall(rf"^\s*(?:ROOT )?%(?:[\w.\-]*(?:copy|transpose)[\w.\-]*) = \w+\[{dims}\]", text, re.M))


@needs_libtpu
def test_heads_layout_removes_the_transposes_around_attention():
    """The tokens layout splits heads by transposing [B, T, h, dh] <-> [B, h, T, dh] (measured: 5
    copies of [4, 256, 2, 128] in the step); the heads layout has none."""
    m = SPLASH.model
    shape = (SPLASH.train.batch_size, m.context_length, m.num_heads, m.head_dim)
    tokens, heads = (_copies_of(_tpu_single(splash_step(layout)), shape) for layout in ("tokens", "heads"))
    assert tokens > 0 and heads == 0, (tokens, heads)


def _splash_blocks(text: str) -> list[dict]:
    """The block sizes every splash kernel of a compiled TPU program was built with (its xprof_metadata)."""
    return [json.loads(m.replace('\\"', '"')) for m in re.findall(r'"xprof_metadata":"(\{.*?\})"', text)]


@needs_libtpu
@pytest.mark.parametrize("layout", SPLASH_STEPS)
def test_block_and_backward_options_reach_the_kernel(layout):
    block, fused = SPLASH_STEPS[layout]
    kernels = _splash_blocks(_tpu_single(splash_step(layout)))
    forward = [k for k in kernels if "block_q" in k]
    assert forward and {k["block_q"] for k in forward} == {block}
    assert {k["use_fused_bwd_kernel"] for k in forward} == {fused}
    assert {k["block_q_dq"] for k in forward} == ({None} if fused else {block})


@needs_libtpu
def test_scoped_vmem_limit_lets_blocks_of_2048_compile():
    """A splash block of 2048 at head_dim 128 needs ~20M of scoped VMEM, over the v5e's default 16M
    (XLA:TPU's compile error, measured: 19.89M for the gradient's forward kernel, 20.89M for the forward
    alone): the forward is refused without the limit (so is any step that runs it), and with
    trainer.compiler_options's limit forward and backward compile. (Measured: the refused forward costs
    3.6 s of CPU to compile, the refused gradient 10.5.)"""
    (chip,) = topology.devices("v5e:1x1")
    q = jax.ShapeDtypeStruct((1, 2, 2048, 128), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(chip))

    def forward(q, k, v):
        with layers.compiling_for("tpu"):
            return layers.splash_attention(q, k, v, 2048)

    def grads(q, k, v):
        with layers.compiling_for("tpu"):
            return jax.grad(lambda *a: jnp.sum(layers.splash_attention(*a, 2048).astype(jnp.float32)),
                            argnums=(0, 1, 2))(q, k, v)

    def compile_with(f, kib: int):
        options = trainer.compiler_options(dataclasses.replace(SPLASH.model, xla_tpu_scoped_vmem_limit_kib=kib), "tpu", 1)
        return topology.compile_for_pod(jax.jit(f, compiler_options=options).lower(q, q, q))

    with pytest.raises(jax.errors.JaxRuntimeError, match="scoped vmem limit"):
        compile_with(forward, 0)
    assert _splash_blocks(compile_with(grads, 98304).as_text())[0]["block_q"] == 2048


@needs_libtpu
def test_the_automatic_block_at_head_dim_256_compiles_for_a_v5e():
    """The 160M shape's attention (T 2048, 4 query heads, one kv head of 256): the automatic block is 512
    (splash_blocks.splash_vmem_bytes; 1024 overflowed the chip's 16 MiB at 8 sequences) and compiles, forward and
    backward, in the default scoped VMEM."""
    (chip,) = topology.devices("v5e:1x1")
    on_chip = jax.sharding.SingleDeviceSharding(chip)
    q = jax.ShapeDtypeStruct((2, 4, 2048, 256), jnp.bfloat16, sharding=on_chip)
    kv = jax.ShapeDtypeStruct((2, 1, 2048, 256), jnp.bfloat16, sharding=on_chip)
    block = splash_block(2048, 0, 256)

    def grads(q, k, v):
        with layers.compiling_for("tpu"):
            return jax.grad(lambda *a: jnp.sum(layers.splash_attention(*a, block).astype(jnp.float32)),
                            argnums=(0, 1, 2))(q, k, v)

    assert block == 512
    assert _splash_blocks(topology.compile_for_pod(jax.jit(grads).lower(q, kv, kv)).as_text())[0]["block_q"] == 512


def test_scoped_vmem_limit_is_a_tpu_option_only():
    cfg = dataclasses.replace(SPLASH.model, xla_tpu_scoped_vmem_limit_kib=65536, async_collectives=False)
    assert trainer.compiler_options(cfg, "tpu", 4) == {"xla_tpu_scoped_vmem_limit_kib": "65536"}
    assert trainer.compiler_options(cfg, "cpu", 4) is None
    assert trainer.compiler_options(dataclasses.replace(cfg, xla_tpu_scoped_vmem_limit_kib=0), "tpu", 4) is None
    with pytest.raises(ValueError, match="xla_tpu_scoped_vmem_limit_kib=-1"):
        dataclasses.replace(SPLASH.model, xla_tpu_scoped_vmem_limit_kib=-1)


# The fast path's options on a small shape (head_dim 128, a vocabulary wide against d_model, as gpt2_125m's)
# One head of 256 (RoPE on halves, as the 160M shape runs): 18.5 s of CPU to compile where 2 heads of 128 took 26.8
# (measured, libtpu 0.0.50.1), the memory figures the same to the MiB.
FAST = Config(dataclasses.replace(BF16.model, vocab_size=8192, context_length=512, d_model=256, num_heads=1,
                                  d_ff=768, weight_dtype="bfloat16", logits_dtype="compute", norm_dtype="compute",
                                  qkv_layout="heads"), dataclasses.replace(CFG.train, batch_size=32))
# The cost model's bytes per device over the compiled step's total allocation on a v5e (AOT, libtpu 0.0.50.1),
# MiB: gpt2_125m 16x1024 bf16 with float32 weights 13,174 / 13,976 (0.94), with the fast path's options (the
# stack scanned) 8,792 / 8,404 (1.05); BENCHMARKS.md's 160M shape at 8 sequences 7,666 / 6,556 (1.17), unrolled in 2
# micro-batches 8,290 / 5,855 (1.42); FAST here 797 / 572 (1.40). At 8 sequences FAST's is 2.9: the model is
# loose on small steps. Splash's [T, T] backward or a second bf16 [tokens, V] counted again puts FAST past 1.6.
MODEL_BOUND = (0.9, 1.6)


@needs_libtpu
def test_the_compiled_peak_is_xlas_and_the_memory_model_holds_it_within_its_bound():
    """fit.compiled_bytes on a TPU reports XLA's total allocation, below arguments + outputs - aliased +
    temporaries (the sum the log printed as 18.12 GiB for a step that ran in 15.75); the cost model, with
    splash's kernel and the compute-dtype logits, stays within MODEL_BOUND of it."""
    compiled = _tpu_compiled(FAST)
    got, ma = fit.compiled_bytes(compiled), compiled.memory_analysis()
    assert got["peak"] == ma.total_allocation_bytes < got["summed"] and got["peak"] > ma.argument_size_in_bytes
    model = cost.of_run(single_run(FAST), tpu=True).memory.total
    assert MODEL_BOUND[0] <= model / got["peak"] <= MODEL_BOUND[1], (model, got)
