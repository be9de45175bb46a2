"""The train step's XLA:TPU options (twinshard/train/xla_options.py): each one a name the locked libtpu
accepts (it refuses an unknown one at compile time), together what turns a synchronous all-reduce
into an asynchronous one with compute scheduled beside it, on by default and recorded where the
launchers report a compile.

Needs libtpu (the `tpu` extra), as tests/test_tpu_topology.py; the compiles are of one small
program for 4 v5e chips (~1-7 s of CPU each), each set of options compiled once."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from twinshard import hlo
from twinshard.config import preset
from twinshard.hardware import topology
from twinshard.train import trainer, xla_options

needs_libtpu = pytest.mark.skipif(not topology.libtpu_installed(),
                                  reason="needs libtpu: uv run --locked --extra tpu pytest")
TINY = preset("tiny").model


def _matmuls(b):
    """[D, D] -> [D, D]: four matmuls (convolution fusions on TPU)."""
    z = jnp.tanh(b @ b) @ b
    return jnp.tanh(z @ b) @ b


def _elementwise(b):
    """[D, D] -> [D, D]: elementwise only (one kLoop fusion on TPU)."""
    return jnp.tanh(b) * jnp.exp(b) + jnp.sin(b)


def _reduction_beside(options: dict[str, str] | None, independent=_matmuls):
    """A gradient-like all-reduce over 4 v5e chips with `independent` compute that does not need it,
    compiled ahead of time with `options`: its schedule (hlo.schedule). Compiled once per (options,
    independent) for the module (each compile ~1-7 s of CPU)."""
    return _schedule_beside(tuple(sorted((options or {}).items())), independent)


@functools.cache
def _schedule_beside(options: tuple[tuple[str, str], ...], independent):
    options = dict(options) or None
    devs = topology.devices("v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))

    def step(a, b):
        reduced = jax.lax.psum(a @ a, "data")      # [D, D]: nothing below reads it
        return reduced, independent(b)             # independent compute to hide it behind

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False)
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = topology.compile_for_pod(jax.jit(f, compiler_options=options).lower(x, x))
    return hlo.schedule(compiled, {"data": 4})


# Pure (no compile), first: a limit libtpu cannot take aborts the process in the compiles below.
def test_the_options_are_tpu_options_of_a_mesh_on_by_default():
    assert TINY.async_collectives
    assert trainer.compiler_options(TINY, "tpu", 16) == xla_options.ASYNC_COLLECTIVES
    assert trainer.compiler_options(TINY, "tpu", 1) is None  # one chip: no collective to hide
    assert trainer.compiler_options(TINY, "cpu", 16) is None  # XLA:CPU refuses TPU options
    assert trainer.compiler_options(dataclasses.replace(TINY, async_collectives=False), "tpu", 16) is None
    # a scoped VMEM limit asked for in the config: the larger of it and the reduce-scatter fusion's 32 MiB
    for asked, got in ((16384, "32768"), (98304, "98304")):
        options = trainer.compiler_options(dataclasses.replace(TINY, xla_tpu_scoped_vmem_limit_kib=asked), "tpu", 16)
        assert options == {**xla_options.ASYNC_COLLECTIVES, "xla_tpu_scoped_vmem_limit_kib": got}
    # the limit alone where the async set is off: one chip, or async_collectives=False; nothing off a TPU
    asked = dataclasses.replace(TINY, xla_tpu_scoped_vmem_limit_kib=16384)
    for cfg, devices in ((asked, 1), (dataclasses.replace(asked, async_collectives=False), 16)):
        assert trainer.compiler_options(cfg, "tpu", devices) == {"xla_tpu_scoped_vmem_limit_kib": "16384"}
    assert trainer.compiler_options(asked, "gpu", 16) is None and trainer.compiler_options(asked, "cpu", 1) is None


@needs_libtpu
def test_libtpu_accepts_each_option_and_refuses_an_unknown_one():
    # One compile with every option (the one the next test reads): libtpu refuses a whole compile for any
    # one name it does not know, as the plausible name below shows.
    _reduction_beside(xla_options.ASYNC_COLLECTIVES)
    with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
        _reduction_beside({"xla_tpu_enable_async_all_reduce": "true"})  # a plausible name that is not one


@needs_libtpu
def test_the_options_make_the_all_reduce_asynchronous_with_compute_beside_it():
    """The compiler's defaults: the all-reduce is synchronous (a window of zero width). The train
    step's options: issued, then matmuls scheduled, then completed."""
    (plain,) = [w for w in _reduction_beside(None).windows() if w.op == "all-reduce"]
    assert plain.synchronous and not plain.inside
    options = trainer.compiler_options(TINY, "tpu", 2)
    (overlapped,) = [w for w in _reduction_beside(options).windows() if w.op == "all-reduce"]
    assert not overlapped.synchronous and overlapped.inside


@needs_libtpu
def test_an_elementwise_fusion_runs_beside_the_all_reduce_only_with_the_kloop_option():
    """Without xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions only matmul fusions are
    scheduled beside an all-reduce: with nothing else independent it stays synchronous."""
    kloop = "xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions"
    without = {k: v for k, v in xla_options.ASYNC_COLLECTIVES.items() if k != kloop}
    for options, hidden in ((without, False), (xla_options.ASYNC_COLLECTIVES, True)):
        (window,) = [w for w in _reduction_beside(options, _elementwise).windows() if w.op == "all-reduce"]
        assert window.synchronous != hidden and bool(window.inside) == hidden


def _auto_fsdp_tp_gradient_reductions(options: dict[str, str]) -> list:
    """The data-axis windows of the auto fsdp_tp step (tiny, bf16, data:8,tensor:2 of a v5e:4x4) compiled
    with `options` as the train step's async set: its reduce-scatters and its all-reduces of matrices."""
    import auto_parallel
    from twinshard.config import Config

    pod = topology.devices("v5e:4x4", (2, 2, 1))
    base = preset("tiny")
    cfg = Config(dataclasses.replace(base.model, dtype="bfloat16"), dataclasses.replace(base.train, batch_size=16))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xla_options, "ASYNC_COLLECTIVES", options)
        runner = auto_parallel.make_runner("fsdp_tp", "data:8,tensor:2", cfg,
                                           devices=topology.mesh_devices({"data": 8, "tensor": 2}, pod))
        tokens = jax.ShapeDtypeStruct((16, cfg.model.context_length), jnp.int32, sharding=runner.batch_sharding)
        compiled = topology.compile_for_pod(runner.train_step.lower(runner.abstract_state(), tokens, tokens))
    windows = hlo.schedule(compiled, runner.mesh).windows()
    return [w for w in windows if w.axes == ("data",) and len(w.records[0].shape) == 2
            and w.op in ("reduce-scatter", "all-reduce") and 2 not in w.records[0].shape]


@needs_libtpu
def test_gradient_reduce_scatters_stay_reduce_scatters_and_asynchronous_with_the_scatter_options():
    """Without the reduce-scatter options XLA:TPU compiled the embedding's and lm_head's gradient
    reduce-scatters over data:8 of a v5e:4x4 as synchronous all-reduces of the full [64, 192] / [192, 64]
    gradient (+ a slice); with them, asynchronous reduce-scatters with compute beside them (measured)."""
    scatter = ("xla_enable_async_reduce_scatter_fusion", "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter")
    without = {k: v for k, v in xla_options.ASYNC_COLLECTIVES.items() if k not in scatter}
    before = _auto_fsdp_tp_gradient_reductions(without)
    after = _auto_fsdp_tp_gradient_reductions(xla_options.ASYNC_COLLECTIVES)
    full = [w for w in before if w.op == "all-reduce" and w.synchronous and 192 in w.records[0].shape]
    assert len(full) == 2 and not [w for w in before if w.op == "reduce-scatter"]
    scattered = [w for w in after if w.op == "reduce-scatter"]
    assert len(scattered) == 2 and all(not w.synchronous and w.inside for w in scattered)
    assert not [w for w in after if w.op == "all-reduce" and 192 in w.records[0].shape]


def test_the_reported_options_are_the_jits_and_those_given_to_the_compile():
    """launch.collectives' record of the step's XLA options (step_options): those the jit was given, then those
    given only to the compile (a --topology's compile_for_pod options), the compile's value where both name one.
    Lowered on the host's CPU, never compiled: the names are only read back."""
    from launch.collectives import step_options

    jitted = jax.jit(lambda x: x + 1, compiler_options={"xla_from_the_jit": "1", "xla_in_both": "jit"})
    lowered = jitted.lower(jax.ShapeDtypeStruct((4,), jnp.float32))
    assert step_options(lowered, None) == step_options(lowered, {}) == {"xla_from_the_jit": "1", "xla_in_both": "jit"}
    at_compile = {"xla_at_compile_only": 32768, "xla_in_both": "compile"}
    assert step_options(lowered, at_compile) == {"xla_from_the_jit": "1", "xla_in_both": "compile",
                                                 "xla_at_compile_only": "32768"}
    plain = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((4,), jnp.float32))
    assert step_options(plain, {"xla_at_compile_only": "true"}) == {"xla_at_compile_only": "true"}


@needs_libtpu
def test_a_layers_gradient_all_reduces_stay_separate_and_asynchronous():
    """Three chained matmul layers' weight gradients (each [128, 128], bf16), each all-reduced over 4 v5e chips
    as soon as it is computed, compiled under the train step's options: three all-reduces, each its own
    window, each but the last (nothing is left to compute beside it) asynchronous with compute inside.
    The all-reduce combiner (left on) merges them into one synchronous all-reduce issued after the last
    gradient (measured: one window of three records, zero width). ~2 s."""
    devs = topology.devices("v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))

    def grads(x, w1, w2, w3):  # x: [B/4, D] per chip; w: [D, D]
        h1 = jnp.tanh(x @ w1)
        h2 = jnp.tanh(h1 @ w2)
        h3 = jnp.tanh(h2 @ w3)
        g3 = jax.lax.psum(h2.T @ h3, "data")  # issued first: the backward pass runs last layer first
        g2 = jax.lax.psum(h1.T @ h2, "data")
        g1 = jax.lax.psum(x.T @ h1, "data")
        return g1, g2, g3

    f = jax.shard_map(grads, mesh=mesh, in_specs=(P("data"), P(), P(), P()), out_specs=(P(),) * 3, check_vma=False)
    x = jax.ShapeDtypeStruct((512, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((128, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    options = trainer.compiler_options(TINY, "tpu", 4)
    compiled = topology.compile_for_pod(jax.jit(f, compiler_options=options).lower(x, w, w, w))
    windows = sorted((w for w in hlo.schedule(compiled, {"data": 4}).windows() if w.op == "all-reduce"),
                     key=lambda w: w.issue)
    assert [[r.shape for r in w.records] for w in windows] == [[(128, 128)]] * 3
    assert all(not w.synchronous and w.inside for w in windows[:-1])
