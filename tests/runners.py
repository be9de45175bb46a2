"""The twin tests' canonical config and meshes, shared so that their programs are too.

A cold CI clone compiles every program of the suite (1-5 s each). Two test modules that
build a runner from the SAME config and mesh compile the same train step, and the second
loads it from the persistent compilation cache (tests/conftest.py) instead of compiling
it again; modules of one xdist group (conftest's SHARED_GROUPS) run one after the other,
so the cache is warm when the second one needs it. Use CFG and MESHES for a new twin test
unless it needs another config (and then say which field, and why, where it is defined).

CFG: the tiny preset with num_heads 8 (head_dim 8), so tp and fsdp_tp split the heads
over a tensor axis of 8 or 4; grad_clip 0.25 is below the gradient norm (~0.7 at init,
measured), so every step runs the clipped branch and the twins' global norms (manual: a
psum of partial squared norms) must agree with single device for the updates to agree.
"""

import dataclasses
import functools

import jax
import jax.extend
import numpy as np

import auto_parallel
import manual_parallel
import reference
from twinshard import cost, hlo
from twinshard.config import Config, preset
from twinshard.train.trainer import SingleDevice

BASE = preset("tiny")
CLIP = 0.25
CFG = Config(dataclasses.replace(BASE.model, num_heads=8), dataclasses.replace(BASE.train, grad_clip=CLIP))
# every strategy on all 8 devices (dp, fsdp, tp: the strategy's default mesh)
MESHES = {"dp": "data:8,tensor:1", "fsdp": "data:8,tensor:1", "tp": "data:1,tensor:8",
          "fsdp_tp": "data:2,tensor:4"}


def twin_runner(name: str, cfg: Config, meshes: dict[str, str] = MESHES):
    """The runner `name` names for cfg: 'single', or '<twin> <strategy>' ('manual tp', 'auto fsdp')
    on meshes[strategy]."""
    if name == "single":
        return SingleDevice(cfg.model, cfg.train)
    twin, strategy = name.split()
    return (manual_parallel if twin == "manual" else auto_parallel).make_runner(strategy, meshes[strategy], cfg)


@functools.cache
def initial_params(cfg: Config):
    """cfg's initial params (its seed), as NumPy arrays: what every runner of the tests starts from.
    On the host, so that placing them on a mesh compiles nothing (measured: jax.device_put of one
    device's arrays onto a mesh's shardings compiled a jit(_multi_slice) per sharded shape, 10 for
    CFG's fsdp and tp; from NumPy, none)."""
    return jax.device_get(SingleDevice(cfg.model, cfg.train).init_state(cfg.train.seed).params)


def loss_and_grads(runner, cfg: Config) -> dict:
    """The runner's loss_and_grads compiled once and run on cfg's initial params and first random
    batch: loss, gradients, temporary bytes and ledger (None on one device)."""
    x, y = reference.random_batches(cfg.train.batch_size, cfg.model.context_length, cfg.model.vocab_size, 1)[0]
    single = isinstance(runner, SingleDevice)
    params = initial_params(cfg)
    args = (params, x, y) if single else (jax.device_put(params, runner.state_shardings.params),
                                          *runner.place_batch(x, y))
    compiled = runner.loss_and_grads.lower(*args).compile()
    value, grads = compiled(*args)
    return {"loss": float(value), "grads": jax.device_get(grads), "runner": runner,
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "ledger": None if single else hlo.ledger(compiled, runner.mesh)}


@functools.cache
def single_loss_and_grads(cfg: Config) -> dict:
    """loss_and_grads of cfg's single-device runner, once per process: test_remat's remat=none cell,
    test_data_tensor's step-1 reference, and tiny_moe's dropless program that test_experts (both
    twins) and test_ragged compare with (one worker runs a SHARED_GROUPS group: it traces once)."""
    return loss_and_grads(SingleDevice(cfg.model, cfg.train), cfg)


def assert_ledger_without_optimizer(ledger: hlo.Ledger, model: cost.Cost) -> None:
    """A compiled loss_and_grads' ledger against the cost model's rows but the optimizer's (its global
    norm, run by the train step only), (op, axes) row by row: count and bytes."""
    rows = cost.compare(ledger.summary(), cost.summarize([r for r in model.collectives if r.phase != "optimizer"]))
    assert all(r["match"] for r in rows), cost.compare_table(rows) + "\n" + ledger.table()


def max_relative_diff(a, b) -> float:
    """max over leaves of max|a - b| / max|b| (each leaf scaled by its largest entry)."""
    return max(float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def scans(jaxpr):
    """Every scan equation of a jaxpr, at any depth (inside jit, shard_map, cond, other scans)."""
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                    yield from scans(getattr(sub, "jaxpr", sub))
