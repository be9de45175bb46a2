"""launch/fit.py: every launcher refuses a step that cannot fit in one line, before writing anything.

A CPU has no memory limit of its own after compiling, so each test injects one with
--device_memory_gib: 0.0001 GiB is below anything tiny needs, refused by the cost model before
compiling (a); `BETWEEN` is above the cost model's sure bound and below what XLA's compiled step
asks (tiny on one device, measured: model 7.28 MiB, sure bound 4.53 MiB, memory_analysis 7.32 MiB),
refused after compiling, from memory_analysis() (b).
"""

import dataclasses

import jax
import pytest

from cli import assert_user_error, run
from launch import fit
from runners import BASE
from twinshard import cost
from twinshard.parallel.resolve import resolve_run, single_run

GIB = 2 ** 30


def between(strategy: str, mesh_spec: str | None) -> str:
    """A limit above the model's sure bound (fit.SURE of its temporaries) and below XLA's peak
    (temporaries at >= 0.85 of the model's: tests/test_memory.py): 0.75 of the temporaries."""
    m = cost.of_run(resolve_run(strategy, "manual" if mesh_spec else "single", mesh_spec, BASE)).memory
    return f"{(m.params + m.optimizer + 0.75 * m.temporaries) / GIB:.6f}"


def launch(name: str, tmp_path, limit: str):
    """(process, the paths it must not have written) for launcher `name` on tiny with --device_memory_gib."""
    out = tmp_path / "out"
    common = ("--preset=tiny", f"--device_memory_gib={limit}")
    argv = {
        "train": ("-m", "launch.train", "--steps=2", f"--workdir={out}"),
        "bench": ("-m", "launch.bench", "--strategies=single", "--steps=1", "--matmul_size=64", f"--json={out}"),
        "compare": ("-m", "launch.compare", "--strategy=dp", "--steps=1", f"--json={out}"),
        "collectives": ("-m", "launch.collectives", "--strategy=fsdp", "--impl=manual", f"--json={out}"),
        "step_profile": ("tools/step_profile.py", "--steps=1"),
    }[name]
    return run(*argv, *common), out


LAUNCHERS = ("train", "bench", "compare", "collectives", "step_profile")


@pytest.mark.parametrize("name", LAUNCHERS)
def test_the_cost_model_refuses_before_compiling(name, tmp_path):
    proc, out = launch(name, tmp_path, "0.0001")
    err = assert_user_error(proc, "by the cost model (saved activations", "--device_memory_gib=0.0001",
                            "--remat=full", "--grad_accum=K", "--skip_memory_check compiles anyway")
    lines = err.strip().splitlines()  # the line (and, but for launch.bench, where the traceback is)
    assert proc.returncode == 1 and "--skip_memory_check" in lines[0] and len(lines) <= 2, err
    assert not out.exists()


@pytest.mark.parametrize("name", LAUNCHERS)
def test_memory_analysis_refuses_after_compiling(name, tmp_path):
    strategy, mesh = ("fsdp", "data:8,tensor:1") if name == "collectives" else ("single", None)
    proc, out = launch(name, tmp_path, between(strategy, mesh))
    assert_user_error(proc, "the compiled step needs", "XLA's memory_analysis: temporaries",
                      "the cost model's largest part: saved activations", "--skip_memory_check runs anyway")
    assert proc.returncode == 1 and not out.exists()


class FakeLowered:
    """A lowered step whose compile fails as XLA:TPU's does for gpt2_350m at 16x1024 on a v5e."""

    def compile(self):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
            "Used 27.10G of 15.75G hbm. Exceeded hbm capacity by 11.35G.")


class FakeAotLowered:
    """A lowered step whose compile for a v5e topology fails as maxtext_v5e_16b's did at 12 sequences per chip."""

    def compile(self):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
            "for HLO temporaries (17.26G) exceeds available HBM (15.75G). HLO module: jit__train_step.")


@pytest.mark.parametrize(("lowered", "used", "have"), [(FakeLowered(), "27.10G", "15.75G (hbm)"),
                                                        (FakeAotLowered(), "17.26G", "15.75G (HBM)")],
                         ids=["on_chip", "ahead_of_time"])
def test_xlas_resource_exhausted_becomes_one_line(lowered, used, have):
    cfg = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, dtype="bfloat16"))
    with pytest.raises(ValueError) as e:
        fit.compile_checked(lowered, single_run(cfg))
    text = str(e.value)
    assert "\n" not in text and f"needs {used} per device" in text and f"has {have}" in text
    assert "RESOURCE_EXHAUSTED" in text and "saved activations" in text and "--remat=full" in text


class FakeVmemLowered:
    """A lowered step whose compile fails as XLA:TPU's did for maxtext_v5e_16b with 1024-token splash blocks."""

    def compile(self):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory space vmem while "
            "allocating on stack for %splash_mha_dkv_no_residuals.9 = (bf16[6,2,20,2048,256]) custom-call(...). "
            "Scoped allocation with size 16.39M and limit 16.00M exceeded scoped vmem limit by 404.0K.")


def test_a_kernels_vmem_overflow_names_the_kernel_not_the_steps_memory():
    """... and the largest splash block below the one that overflowed that fits by splash_blocks.splash_vmem_bytes."""
    head_dim_256 = dataclasses.replace(BASE.model, context_length=2048, d_model=512, num_heads=2, attention_block=1024)
    with pytest.raises(ValueError) as e:
        fit.compile_checked(FakeVmemLowered(), single_run(dataclasses.replace(BASE, model=head_dim_256)))
    text = str(e.value)
    assert "\n" not in text and "splash_mha_dkv_no_residuals: 16.39M of 16.00M" in text
    assert "scoped VMEM" in text and "the splash block is 1024 at head_dim 256; pass --attention_block=512" in text
    assert "per device" not in text
    with pytest.raises(ValueError, match="the splash block is 128 at head_dim 16; no smaller splash block exists"):
        fit.compile_checked(FakeVmemLowered(), single_run(BASE))


class FakeCompiled:
    """A compiled step whose memory_analysis() asks 18 GiB."""

    def memory_analysis(self):
        return type("MA", (), {"argument_size_in_bytes": 2 * GIB, "output_size_in_bytes": 2 * GIB,
                               "alias_size_in_bytes": 2 * GIB, "temp_size_in_bytes": 16 * GIB})()


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
def test_a_topologys_tpu_compile_is_the_compilers_verdict(platform):
    """Compiled ahead of time for a TPU topology, XLA:TPU's own refusal stands (it compiled: it fits),
    not memory_analysis()'s overstated peak; for other devices the bound refuses it."""
    device = type("Device", (), {"platform": platform})()
    run = dataclasses.replace(single_run(BASE), devices=(device,))
    bound = (16 * GIB, "v5e's HBM")
    if platform == "tpu":
        fit.check_compiled(FakeCompiled(), run, bound)
    else:
        with pytest.raises(ValueError, match="needs 18.00 GiB per device"):
            fit.check_compiled(FakeCompiled(), run, bound)


def test_a_cpu_has_no_limit_after_compiling():
    assert fit.limit(after_compile=True) is None  # nothing is compiled twice on a CPU: check_step returns None
    have, what = fit.limit(after_compile=False)
    assert have > 0 and "host" in what


def test_llama_v5e_fits_one_v5e_with_float32_state():
    """The preset's step by the cost model: its exact state plus 1.25 x its temporaries (the top of
    tests/test_memory.py's single-device band) below a v5e's usable HBM (13.7 GiB estimated, 14.96 at
    the band's top); Llama's shape rules hold."""
    from twinshard.config import preset

    cfg = preset("llama_v5e")
    m = cfg.model
    assert m.head_dim == 128 and m.kv_heads < m.num_heads and m.vocab_size % 256 == 0 and m.context_length == 2048
    assert m.weight_dtype == "float32" and cfg.train.optimizer == "adamw" and 0.5e9 < m.num_params() < 1e9
    need = cost.of_run(single_run(cfg)).memory
    worst = need.total - need.temporaries + 1.25 * need.temporaries
    assert worst < 15.75 * GIB, worst / GIB  # a v5e's bytes_limit (of its 16 GiB HBM)
