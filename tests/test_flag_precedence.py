"""Each launcher flag over every other source of the same value (launch/common.py, launch/bench.py,
launch/plan.py, launch/fit.py).

- A model or train flag given wins over the preset, whatever its value (False and 0 too), and moves
  nothing else; a flag not given leaves the preset as it is, so every such flag's default is None
  (a pinned default would silently replace a bf16 or remat preset's value). Checked for
  launch.train's config (common.config_from_flags), launch.bench's and launch.plan's.
- The memory a step is checked against: --device_memory_gib over a topology's chips (launch.collectives
  and --compile pass their HBM), over the accelerator's bytes_limit, over the host's memory (before
  compiling; nothing after it on a CPU), in the model check and in the compiled check.
- --mfu over the chip's measured matmul efficiency over the datasheet peak: tests/test_plan.py; an
  explicit attention kernel over the hardware's default: tests/test_options.py.
"""

from __future__ import annotations

import dataclasses
import os
import types

import jax
import pytest
from absl import flags

from launch import bench, common, fit, plan as planner
from twinshard.config import preset
from twinshard.parallel.resolve import single_run

# A value of each model flag that differs from its preset's (tiny, or tiny_moe for the MoE flags);
# False, 0 and 0.0 among them: a given flag wins by being given, not by being truthy.
MODEL_VALUES = {
    "dtype": "bfloat16", "weight_dtype": "bfloat16", "remat": "dots", "attention": "xla", "attention_block": 128,
    "scan_unroll": 2, "collective_matmul": True, "tp_overlap_chunks": 2, "loss_chunks": 2, "logits_dtype": "compute",
    "loss_recompute": False, "norm_dtype": "compute", "qkv_layout": "heads", "quantization": "int8",
    "splash_fused_bwd": False, "xla_tpu_scoped_vmem_limit_kib": 32768, "async_collectives": False,
    "vocab_size": 300, "d_model": 96, "num_layers": 3, "num_heads": 2, "num_kv_heads": 2, "d_ff": 128,
    "context_length": 64, "num_experts": 8, "first_dense_layers": 1, "experts_per_token": 1,
    "capacity_factor": 0.0, "moe_group_size": 16, "router_aux_loss": 0.0, "router_z_loss": 0.001,
    "expert_d_ff": 96, "moe_dispatch": "ragged"}
assert set(MODEL_VALUES) == set(common.MODEL_FLAGS)
TOGETHER = {"moe_dispatch": {"capacity_factor": 0.0}}  # ragged is dropless: ModelConfig asks for both
DERIVED = {"d_model": {"d_ff"}}  # a new width re-derives d_ff (common.with_model_flags)
# Each launcher's train flags (None: the preset's) and a value of each that differs from tiny's.
TRAIN_VALUES = {"steps": 7, "batch_size": 4, "lr": 1e-3, "seed": 7, "optimizer": "lion", "grad_accum": 2,
                "grad_accum_dtype": "weight", "microbatches": 2, "schedule": "1f1b", "cp_layout": "contiguous", "virtual_stages": 2}
TRAIN_FLAGS = {"train": tuple(TRAIN_VALUES), "bench": ("batch_size", "seed", "grad_accum", "grad_accum_dtype"),
               "plan": ("batch_size", "optimizer")}
PLAN_DEFAULTS = {"optimizer": "adamw"}  # launch.plan's own flag default (not None: the planner needs one)


def flag_values(launcher: str, preset_name: str, **given) -> types.SimpleNamespace:
    """The flags as the launcher reads them, none given but `given`."""
    values = {"preset": preset_name, "devices": 8, "tokenizer": None, **dict.fromkeys(TRAIN_VALUES),
              **dict.fromkeys(common.MODEL_FLAGS), **(PLAN_DEFAULTS if launcher == "plan" else {})}
    return types.SimpleNamespace(**{**values, **given})


def config(launcher: str, values: types.SimpleNamespace, monkeypatch):
    if launcher == "train":
        return common.config_from_flags(values)
    module = {"bench": bench, "plan": planner}[launcher]
    monkeypatch.setattr(module, "FLAGS", values)
    return module.config_from_flags()


LAUNCHERS = tuple(TRAIN_FLAGS)
# a float32 preset, a bf16 one under remat full, a bf16 mixture of experts, one with attention_block set
PRESETS = ("tiny", "llama_v5e", "mixtral_8x7b", "maxtext_v5e_16b")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_no_flag_given_leaves_the_preset_as_it_is(launcher: str, monkeypatch) -> None:
    for name in PRESETS:
        assert config(launcher, flag_values(launcher, name), monkeypatch) == preset(name), name


def changed(got, want) -> dict:
    a, b = dataclasses.asdict(got), dataclasses.asdict(want)
    return {k: a[k] for k in a if a[k] != b[k]}


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("name", common.MODEL_FLAGS)
def test_a_model_flag_given_wins_over_the_preset_and_moves_nothing_else(launcher: str, name: str,
                                                                        monkeypatch) -> None:
    base = "tiny_moe" if name in common.MOE_FLAGS else "tiny"
    given = {name: MODEL_VALUES[name], **TOGETHER.get(name, {})}
    want = preset(base)
    assert all(getattr(want.model, k) != v for k, v in given.items() if k != "capacity_factor" or name != "moe_dispatch")
    got = config(launcher, flag_values(launcher, base, **given), monkeypatch)
    moved = changed(got.model, want.model)
    assert {k: moved.get(k) for k in given} == given and set(moved) - set(given) <= DERIVED.get(name, set()), moved
    assert got.train == want.train


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_train_flag_given_wins_over_the_preset_and_moves_nothing_else(launcher: str, monkeypatch) -> None:
    want = preset("tiny")
    for name in TRAIN_FLAGS[launcher]:
        value = TRAIN_VALUES[name]
        assert getattr(want.train, name) != value
        got = config(launcher, flag_values(launcher, "tiny", **{name: value}), monkeypatch)
        moved = changed(got.train, want.train)
        # --steps caps the warm-up; --lr keeps the preset's lr / min_lr ratio (common.config_from_flags)
        follows = {"steps": {"warmup_steps"}, "lr": {"min_lr"}}.get(name, set())
        assert moved.get(name) == value and set(moved) - {name} <= follows, (name, moved)
        if name == "steps":
            assert got.train.warmup_steps == min(want.train.warmup_steps, value)
        if name == "lr":
            assert got.train.min_lr == pytest.approx(want.train.min_lr * value / want.train.lr)
        assert got.model == want.model, name


def test_every_model_flags_default_is_none_so_the_preset_decides() -> None:
    """absl's defaults of the flags every launcher shares (defined by launch.train's import here)."""
    import launch.train  # noqa: F401  (defines the model flags, as `python -m launch.train` does)

    assert {name: flags.FLAGS[name].default for name in common.MODEL_FLAGS} == dict.fromkeys(common.MODEL_FLAGS)


# ----------------------------------------------------------------------------- the memory limit

GIB = fit.GIB


@pytest.fixture
def sources(monkeypatch):
    """Every source of a device's memory present (--device_memory_gib 2, a v5e's bytes_limit of 16 GiB)
    and a step that needs 100 GiB: `remove(name)` takes one away."""
    chip = types.SimpleNamespace(device_kind="TPU v5 lite", memory_stats=lambda: {"bytes_limit": 16 * GIB})
    present = {"flag": 2.0, "accelerator": chip}
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [present["accelerator"]])
    monkeypatch.setattr(fit, "_flag", lambda name, default=None: present["flag"] if name == "device_memory_gib" else default)
    need = dataclasses.replace(fit.model_memory(single_run(preset("tiny"))), params=100 * GIB)
    monkeypatch.setattr(fit, "model_memory", lambda run: need)
    return present


TOPOLOGY = (32 * GIB, "v5p's HBM")
HOST = "this host's"


@pytest.mark.parametrize("absent, topology, named", [
    ((), TOPOLOGY, "--device_memory_gib=2"),  # the flag over a topology's chips and the accelerator
    (("flag",), TOPOLOGY, "v5p's HBM"),  # a topology's chips over this host's accelerator
    (("flag",), None, "TPU v5 lite's bytes_limit"),  # the accelerator over the host
    (("flag", "accelerator"), None, HOST)])
def test_the_model_check_takes_the_first_memory_source_present(sources, absent, topology, named) -> None:
    for name in absent:
        sources[name] = None if name == "flag" else types.SimpleNamespace(device_kind="cpu", memory_stats=lambda: None)
    with pytest.raises(ValueError, match=r"and a device has [\d.]+ GiB \(" + named):
        fit.check_model(single_run(preset("tiny")), topology)



def test_each_memory_source_gives_its_own_bytes(sources, monkeypatch) -> None:
    """fit.limit's bytes per device from each source, exactly: --device_memory_gib=2 is 2 GiB (2^31 B, not
    2e9), the accelerator's bytes_limit as it is, and on a CPU host of 8 simulated devices each its eighth
    of the host's memory (nothing after compiling: XLA:CPU allocates from the host as it goes)."""
    assert fit.limit(after_compile=False) == (2 * 2**30, "--device_memory_gib=2")
    sources["flag"] = None
    assert fit.limit(after_compile=False) == (16 * GIB, "TPU v5 lite's bytes_limit")
    cpu = types.SimpleNamespace(device_kind="cpu", memory_stats=lambda: None)
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [cpu] * 8)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert fit.limit(after_compile=False) == (host // 8, f"this host's {host / GIB:.1f} GiB shared by 8 device(s)")
    assert fit.limit(after_compile=True) is None


class Compiled:
    """A compiled step whose memory_analysis() asks a peak of 40 GiB (arguments 8, temporaries 32)."""

    def memory_analysis(self):
        return types.SimpleNamespace(argument_size_in_bytes=8 * GIB, output_size_in_bytes=0, alias_size_in_bytes=0,
                                     temp_size_in_bytes=32 * GIB)


@pytest.mark.parametrize("absent, topology, named", [
    ((), TOPOLOGY, "--device_memory_gib=2"), (("flag",), TOPOLOGY, "v5p's HBM"),
    (("flag",), None, "TPU v5 lite's bytes_limit")])
def test_the_compiled_check_takes_the_first_memory_source_present(sources, absent, topology, named) -> None:
    for name in absent:
        sources[name] = None
    with pytest.raises(ValueError, match=r"needs 40.00 GiB per device .* and a device has [\d.]+ GiB \(" + named):
        fit.check_compiled(Compiled(), single_run(preset("tiny")), topology)


def test_on_a_cpu_nothing_bounds_the_compiled_step_but_the_flag(sources) -> None:
    sources["accelerator"] = types.SimpleNamespace(device_kind="cpu", memory_stats=lambda: None)
    sources["flag"] = None
    fit.check_compiled(Compiled(), single_run(preset("tiny")))  # no limit after compiling on a CPU
    sources["flag"] = 2.0
    with pytest.raises(ValueError, match=r"\(--device_memory_gib=2\)"):
        fit.check_compiled(Compiled(), single_run(preset("tiny")))
