"""The scanned layer stack: the compiled program does not grow with depth.

The L blocks are one `Block` with [L, ...] params run by `jax.lax.scan`
(twinshard/model/transformer.py), so the train step and the init compile ONE block body
whatever L is. Structural tests, not timing tests: the compiled HLO's
instruction count at L=2 and L=8 (tiny width), and, for the manual FSDP twin,
where its collectives sit (inside the layer loop, once per layer).

Measured (XLA:CPU, opt level 0, tiny width, 8 simulated devices; instructions
at L=2 -> L=8): single-device step 3532 -> 3532, manual fsdp step 4220 -> 4169,
init 4251 -> 4251. Before the stack (a Python loop over blocks, commit d83ba27):
4686 -> 15978, 5744 -> 19859 and 6668 -> 24110.
"""

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

import manual_parallel
from twinshard import cost, hlo
from twinshard.config import Config, preset
from twinshard.train.trainer import SingleDevice, create_params, init_key

BASE = preset("tiny")
DEPTHS = (2, 8)
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*\S", re.M)


def config(num_layers: int) -> Config:
    return Config(dataclasses.replace(BASE.model, num_layers=num_layers), BASE.train)


def instructions(compiled) -> int:
    """Number of HLO instructions in every computation of the compiled module."""
    return len(_INSTRUCTION.findall(compiled.as_text()))


def compile_step(runner, cfg: Config):
    xs = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32,
                              sharding=getattr(runner, "batch_sharding", None))
    return runner.train_step.lower(runner.abstract_state(), xs, xs).compile()


@functools.cache
def manual_fsdp(num_layers: int):
    cfg = config(num_layers)
    runner = manual_parallel.make_runner("fsdp", "data:8,tensor:1", cfg)
    return cfg, runner, compile_step(runner, cfg)


def test_single_device_step_does_not_grow_with_depth():
    sizes = [instructions(compile_step(SingleDevice(config(n).model, BASE.train), config(n))) for n in DEPTHS]
    assert sizes[1] == pytest.approx(sizes[0], rel=0.02), sizes


def test_manual_fsdp_step_does_not_grow_with_depth():
    sizes = [instructions(manual_fsdp(n)[2]) for n in DEPTHS]
    assert sizes[1] == pytest.approx(sizes[0], rel=0.02), sizes


def test_init_does_not_grow_with_depth():
    """One random call per stacked weight kind, of shape [L, ...], not one per layer. The init with its key
    as an argument (trainer.init_key), as the runners take it: at L = 2 the program init_on_host
    draws in the last test (one compile for both)."""
    sizes = [instructions(jax.jit(functools.partial(create_params, config(n).model)).lower(init_key(0)).compile())
             for n in DEPTHS]
    assert sizes[1] == pytest.approx(sizes[0], rel=0.02), sizes


def test_manual_fsdp_gathers_one_layer_per_iteration_inside_the_loop():
    """Forward: the 7 block matrices gathered in the layer loop body (trip count L), one
    layer's [in, out] each; backward: re-gathered in the backward loop (remat never saves a
    gathered weight) and reduce-scattered there. Outside the loops: the embedding and
    lm_head gathers (lm_head re-gathered) and scatters. The whole ledger equals the cost model."""
    L = DEPTHS[-1]
    cfg, runner, compiled = manual_fsdp(L)
    led = hlo.ledger(compiled, runner.mesh)
    m = cfg.model
    per_layer = sorted([(m.d_model, m.d_model)] * 4 + [(m.d_model, m.d_ff)] * 2 + [(m.d_ff, m.d_model)])
    in_loop = [r for r in led.filter(op="all-gather", axes="data") if r.multiplicity == L]
    assert sorted(r.shape for r in in_loop) == sorted(per_layer * 2)  # forward + backward re-gather
    scattered = [r for r in led.filter(op="reduce-scatter", axes="data") if r.multiplicity == L]
    assert len(scattered) == 7
    assert led.count("all-gather", "data") == 2 * (7 * L + 2) - 1
    model = cost.cost(m, "fsdp", runner.sizes, cfg.train.batch_size)
    assert all(r["match"] for r in cost.compare(led.summary(), model.summary()))


def test_unrolled_scan_is_the_same_training_and_the_same_collectives():
    """scan_unroll=L (the CPU speed knob): the same loss and gradients as the rolled loop,
    no layer loop left in the step, and the manual FSDP ledger still equals the cost model
    (each collective appears L times instead of once in a loop of trip count L). At L = 2, the depth
    whose init the next test compiles (the same program: the key is an argument)."""
    L = 2
    rolled, unrolled = config(L), Config(dataclasses.replace(config(L).model, scan_unroll=L), BASE.train)
    rng = np.random.default_rng(0)
    b = rng.integers(0, BASE.model.vocab_size, (BASE.train.batch_size, BASE.model.context_length + 1))
    x, y = b[:, :-1].astype(np.int32), b[:, 1:].astype(np.int32)
    params = SingleDevice(rolled.model, rolled.train).init_state(0).params
    (l0, g0), (l1, g1) = (SingleDevice(c.model, c.train).loss_and_grads(params, x, y) for c in (rolled, unrolled))
    assert abs(float(l0) - float(l1)) < 1e-6
    assert max(float(np.max(np.abs(a - c))) for a, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g1))) < 1e-7
    runner = manual_parallel.make_runner("fsdp", "data:8,tensor:1", unrolled)
    led = hlo.ledger(compile_step(runner, unrolled), runner.mesh)
    assert all(r.multiplicity == 1 for r in led)  # no collective inside a loop
    model = cost.cost(unrolled.model, "fsdp", runner.sizes, unrolled.train.batch_size)
    assert all(r["match"] for r in cost.compare(led.summary(), model.summary())), led.table()


def test_init_takes_its_key_as_an_argument_and_draws_on_the_host_for_one_tpu_chip():
    """trainer.init_key: the compiled init gets the key as an argument (a constant key is folded at
    compile time). On one TPU chip the params are drawn by the host CPU (trainer.draws_on_host) and
    copied over: the same values, params and optimizer state, as the init compiled for the device."""
    from types import SimpleNamespace

    from twinshard.train.trainer import draws_on_host, init_on_host, init_state

    tpu, cpu = SimpleNamespace(platform="tpu"), SimpleNamespace(platform="cpu")
    assert draws_on_host([tpu]) and not draws_on_host([tpu, tpu]) and not draws_on_host([cpu])
    cfg = config(2)
    single = SingleDevice(cfg.model, cfg.train)
    lowered = jax.jit(functools.partial(init_state, cfg.model, single.tx)).lower(init_key(0))
    assert len(lowered.args_info[0]) == 1 and "threefry" in lowered.as_text()
    on_device, via_host = single.init_state(3), init_on_host(cfg.model, single.tx, 3, single.sharding)
    assert jax.tree.structure(on_device) == jax.tree.structure(via_host)
    elsewhere = jax.sharding.SingleDeviceSharding(jax.devices()[1])  # not the host's device
    to_elsewhere = init_on_host(cfg.model, single.tx, 3, elsewhere)
    for a, b, c in zip(jax.tree.leaves(on_device), jax.tree.leaves(via_host), jax.tree.leaves(to_elsewhere)):
        assert b.sharding == single.sharding and c.sharding == elsewhere
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
