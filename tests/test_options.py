"""Every option has an observable effect, and where two settings meet, which one wins is tested both ways.

An option accepted and then ignored (a kernel's block size that never reaches the kernel) passes
every test that only checks the config. So each field of ModelConfig and TrainConfig is either
in STEP, where changing it alone must change the one-device train step's program (its StableHLO,
constants included: an lr is a constant of the step), or in ELSEWHERE, naming the test that
observes it off the step (a launcher's schedule, a strategy's layout). A new option fails
test_every_option_is_observed until it is placed in one of them.

Precedence: an explicit setting against a default derived from the hardware (the attention kernel:
"auto" is splash on a TPU in bf16; --device_memory_gib against the accelerator's bytes_limit) and
against a default derived from the shape (the splash block), each way round.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import suite
from launch import fit
from twinshard.config import Config, ModelConfig, TrainConfig, preset
from twinshard.splash_blocks import splash_block
from twinshard.model import layers
from twinshard.train.trainer import SingleDevice

DENSE = preset("tiny")  # 2 layers of 4 heads, T = 32
MOE = preset("tiny_moe")
DROPLESS = Config(dataclasses.replace(MOE.model, capacity_factor=0.0), MOE.train)  # ragged dispatch's
SPLASH = dataclasses.replace(DENSE.model, context_length=256, attention="splash", attention_block=128)

# option -> (the config it shows in, another value): the step's program must differ
STEP: dict[str, tuple[Config | ModelConfig, object]] = {
    "vocab_size": (DENSE, 300), "context_length": (DENSE, 64), "d_model": (DENSE, 32), "num_layers": (DENSE, 3),
    "num_heads": (DENSE, 8), "d_ff": (DENSE, 64), "num_kv_heads": (DENSE, 2), "rope_theta": (DENSE, 500.0),
    "norm_eps": (DENSE, 1e-3), "dtype": (DENSE, "bfloat16"), "weight_dtype": (DENSE, "bfloat16"),
    "attention": (DENSE, "reference"), "attention_block": (Config(SPLASH, DENSE.train), 256),
    "scan_unroll": (DENSE, 2), "remat": (DENSE, "full"), "loss_chunks": (DENSE, 2), "tp_overlap_chunks": (DENSE, 2),
    "num_experts": (DENSE, 4), "first_dense_layers": (MOE, 1), "experts_per_token": (MOE, 1),
    "capacity_factor": (MOE, 2.0), "moe_group_size": (MOE, 16), "router_aux_loss": (MOE, 0.5),
    "router_z_loss": (MOE, 0.5), "expert_d_ff": (MOE, 32), "moe_dispatch": (DROPLESS, "ragged"),
    "batch_size": (DENSE, 4), "steps": (DENSE, 40), "lr": (DENSE, 1e-2), "min_lr": (DENSE, 1e-5),
    "warmup_steps": (DENSE, 5), "weight_decay": (DENSE, 0.2), "beta1": (DENSE, 0.8), "beta2": (DENSE, 0.99),
    "eps": (DENSE, 1e-6), "grad_clip": (DENSE, 0.5), "skip_nonfinite": (DENSE, False),
    "optimizer": (DENSE, "lion"), "grad_accum": (DENSE, 2), "quantization": (DENSE, "int8"),
}
# option -> the test that observes it where the one-device step does not show it
ELSEWHERE = {
    "grad_accum_dtype": "tests/test_accum.py::test_every_twin_sums_in_the_dtype_the_flag_names",
    "async_collectives": "tests/test_xla_options.py::test_the_options_make_the_all_reduce_asynchronous_with_compute_beside_it",
    "collective_matmul": "tests/test_sequence.py::test_collective_matmul_equals_the_all_gather",
    "seed": "tests/test_data.py::test_get_batch_deterministic_in_seed_and_step",
    "tokenizer": "tests/test_bpe.py",
    "log_every": "tests/test_train.py::test_eval_runs_on_its_own_schedule",
    "eval_every": "tests/test_train.py::test_eval_runs_on_its_own_schedule",
    "eval_batches": "tests/test_train.py::test_eval_averages_eval_batches_batches_of_the_same_state",
    "checkpoint_every": "tests/test_train.py",
    "microbatches": "tests/test_pipeline.py",
    "schedule": "tests/test_pipeline.py::test_scheduled_matches_gpipe_and_single_device",
    "virtual_stages": "tests/test_pipeline.py::test_bad_pipeline_configs_are_clear_errors",
    "cp_layout": "tests/test_context.py::test_ring_attention_equals_full_attention",
    # the speed options: each observed on the traced or TPU-compiled step it promises to change
    "logits_dtype": "tests/test_speed_options.py::test_compute_logits_leave_no_float32_array_of_vocab_width",
    "loss_recompute": "tests/test_speed_options.py::test_compute_logits_leave_no_float32_array_of_vocab_width",
    "norm_dtype": "tests/test_speed_options.py::test_compute_norms_leave_no_float32_residual_stream",
    "qkv_layout": "tests/test_speed_options.py::test_heads_layout_removes_the_transposes_around_attention",
    "splash_fused_bwd": "tests/test_speed_options.py::test_block_and_backward_options_reach_the_kernel",
    "xla_tpu_scoped_vmem_limit_kib": "tests/test_speed_options.py::test_scoped_vmem_limit_lets_blocks_of_2048_compile",
}


def test_every_option_is_observed():
    options = [f.name for cls in (ModelConfig, TrainConfig) for f in dataclasses.fields(cls)]
    assert sorted(options) == sorted([*STEP, *ELSEWHERE]), "place each new option in STEP or ELSEWHERE"
    collected = {i["nodeid"].split("[")[0] for i in suite.collect()} | {i["nodeid"].split("::")[0] for i in suite.collect()}
    assert not [t for t in ELSEWHERE.values() if t not in collected], "ELSEWHERE names a test pytest does not collect"


def with_option(cfg: Config | ModelConfig, option: str, value) -> Config:
    cfg = cfg if isinstance(cfg, Config) else Config(cfg, DENSE.train)
    if option in {f.name for f in dataclasses.fields(ModelConfig)}:
        return Config(dataclasses.replace(cfg.model, **{option: value}), cfg.train)
    return Config(cfg.model, dataclasses.replace(cfg.train, **{option: value}))


@functools.cache
def step_program(cfg: Config) -> str:
    r = SingleDevice(cfg.model, cfg.train)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32)
    return r.train_step.lower(r.abstract_state(), tokens, tokens).as_text()


@pytest.mark.parametrize("option", list(STEP))
def test_each_option_changes_the_step_program(option):
    base, value = STEP[option]
    base = base if isinstance(base, Config) else Config(base, DENSE.train)
    assert getattr(base.model if hasattr(base.model, option) else base.train, option) != value
    assert step_program(with_option(base, option, value)) != step_program(base), f"--{option}={value} changes nothing"


# ----------------------------------------------------------------------------- the splash block


def splash_grid(block: int, t: int = 256) -> tuple[int, ...]:
    """The grid of the splash kernel's forward pallas_call for q, k, v [1, 2, t, 64] at `block`."""
    q = jax.ShapeDtypeStruct((1, 2, t, 64), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda q, k, v: layers.causal_attention(q, k, v, "splash", block=block))(q, q, q)
    grids = [e.params["grid_mapping"].grid for e in equations(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
    assert grids, "no pallas_call: splash did not run"
    return grids[0]


def equations(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def test_the_splash_block_reaches_the_kernel_and_zero_is_the_shapes_choice():
    """--attention_block=128 on T = 256 is a 2 x 2 grid of query and key blocks per head; 256 is
    one block; 0 takes splash_block's choice for T (256 here): the explicit block wins, and the
    derived one applies only without it."""
    assert splash_grid(128) == (2, 2, 2)  # (heads, query blocks, key blocks)
    assert splash_grid(256) == (2, 1, 1)
    assert splash_block(256) == 256 and splash_grid(0) == splash_grid(256)


# ----------------------------------------------------------------------------- explicit against the hardware


@pytest.mark.parametrize("impl, tpu, want", [
    ("auto", True, "splash"), ("auto", False, "recompute"),  # the hardware's choice, without a flag
    ("recompute", True, "recompute"), ("xla", True, "xla"),  # an explicit kernel wins on a TPU
    ("splash", False, "splash"),  # ... and off it (Pallas interpret mode)
])
def test_an_explicit_attention_kernel_wins_over_the_hardwares_default(impl, tpu, want):
    if tpu:
        with layers.compiling_for("tpu"):
            got = layers.attention_kernel(impl, jnp.bfloat16)
    else:
        got = layers.attention_kernel(impl, jnp.bfloat16)
    assert got == want


def test_device_memory_gib_wins_over_the_accelerators_bytes_limit_and_the_limit_applies_without_it(monkeypatch):
    chip = types.SimpleNamespace(device_kind="TPU v5 lite", memory_stats=lambda: {"bytes_limit": 16 * fit.GIB})
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [chip])
    monkeypatch.setattr(fit, "_flag", lambda name, default=None: default)
    assert fit.limit(after_compile=True) == (16 * fit.GIB, "TPU v5 lite's bytes_limit")
    monkeypatch.setattr(fit, "_flag", lambda name, default=None: 2.0 if name == "device_memory_gib" else default)
    assert fit.limit(after_compile=True) == (2 * fit.GIB, "--device_memory_gib=2")
