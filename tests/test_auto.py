"""The GSPMD twin (auto_parallel/) against single-device training, its physical
placement, and the collectives XLA inserts for each strategy.

Config: tests/runners.py's CFG, the tiny preset with num_heads=8 (head_dim 8), so
heads split over a tensor axis of 8, and grad_clip 0.25 (every AdamW step clipped);
test_manual trains the same auto runners, so their programs compile once per suite
(persistent compilation cache). Cases: dp, fsdp, tp on their default 8-device meshes, and
fsdp_tp on data:2,tensor:4 (not also its default data:4,tensor:2: the same annotations on
another split, ~13 s of CPU; the placement mutants that select this file are caught without
it). Each case
compiles its AdamW step once (module-scoped fixture), runs it from the compiled
executable, and compiles one SGD step.

Numerics (measured, JAX 0.12.0.1 XLA:CPU, 8 simulated devices, 5 steps, 4
batch/init seeds x 5 cases):
- init: bitwise equal to single-device init under every sharding.
- SGD (lr 1, no clipping: each update *is* the gradient): params within
  2.4e-7 of single-device (1-2 float32 ulps of values up to ~3).
- AdamW (the preset's lr 3e-3, warmup 2; measured with grad_clip 1.0, and 2.4e-7
  with CFG's 0.25 in tests/test_manual.py): params within 2.0e-6. AdamW divides
  by sqrt(nu) + eps, which amplifies the rounding noise of a different reduction
  order where |g| is small (docs/design.md, JAX facts).
- losses: up to 3.8e-6 apart already at step 0, where params are bitwise equal:
  that is the mean over B*T = 256 float32 token losses (~5.8, ulp 4.8e-7)
  summed in another order, not a training difference, so it bounds what any
  loss tolerance can be (1e-6 absolute is below it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import tempfile
from typing import Any

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import auto_parallel
from runners import CFG
from twinshard import hlo
from twinshard.train import optim, trainer
from twinshard.testing import expect_bytes, expect_collectives, expect_no_collective, expect_parsed

M = CFG.model
B, T, D, L = CFG.train.batch_size, M.context_length, M.d_model, M.num_layers
SEED, STEPS = 0, 5
SGD = optim.clip_and_guard(optax.sgd(1.0), max_norm=0.0, skip_nonfinite=False)

SGD_PARAM_ATOL = 1e-6  # measured max 2.4e-7
ADAMW_PARAM_ATOL = 2e-5  # ~10x the measured max 2.0e-6
LOSS_ATOL = 2e-5  # ~5x the measured max 3.8e-6 (reduction order of the mean; see above)

CASES = [("dp", None), ("fsdp", None), ("tp", None), ("fsdp_tp", "data:2,tensor:4")]

# The placement each strategy should have, written out by hand, independently of
# twinshard/parallel/strategies.py.
PLACEMENT = {
    "dp": {"w_in": P(None, None), "w_out": P(None, None), "embedding": P(None, None), "lm_head": P(None, None)},
    "fsdp": {"w_in": P("data", None), "w_out": P(None, "data"), "embedding": P(None, "data"),
             "lm_head": P("data", None)},
    "tp": {"w_in": P(None, "tensor"), "w_out": P("tensor", None), "embedding": P("tensor", None),
           "lm_head": P(None, "tensor")},
    "fsdp_tp": {"w_in": P("data", "tensor"), "w_out": P("tensor", "data"), "embedding": P("tensor", "data"),
                "lm_head": P("data", "tensor")},
}
KINDS = {"q_proj": "w_in", "k_proj": "w_in", "v_proj": "w_in", "w1": "w_in", "w3": "w_in",
         "output_proj": "w_out", "w2": "w_out", "token_embeddings": "embedding", "lm_head": "lm_head",
         "ln1": "norm", "ln2": "norm", "ln_final": "norm"}


def path_name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def expected_spec(strategy: str, name: str) -> P:
    kind = next(KINDS[part] for part in name.split(".") if part in KINDS)
    spec = P(None) if kind == "norm" else PLACEMENT[strategy][kind]
    # the blocks are one stack [L, ...]: its leading 'layers' axis is not split (no pipeline)
    return P(None, *spec) if name.startswith("layers.") else spec


def local_shape(shape: tuple[int, ...], spec: P, mesh: dict[str, int]) -> tuple[int, ...]:
    return tuple(n // (mesh[a] if a else 1) for n, a in zip(shape, tuple(spec) + (None,) * len(shape)))


ABSTRACT_PARAMS = jax.eval_shape(functools.partial(trainer.create_params, M, 0))
PARAMS = [(path_name(p), a.shape) for p, a in jax.tree_util.tree_flatten_with_path(ABSTRACT_PARAMS)[0]]
PARAM_BYTES = 4 * sum(math.prod(s) for _, s in PARAMS)


def use_shapes(strategy: str, mesh: dict[str, int], fsdp_only: bool) -> list[tuple[int, ...]]:
    """Per-device shape of each weight where it is used: FSDP's data split gathered, TP's tensor split kept.

    A stacked block leaf [L, ...] is used one layer at a time inside the scan body: L uses of [...].
    """
    out = []
    for name, shape in PARAMS:
        spec = expected_spec(strategy, name)
        if fsdp_only and "data" not in tuple(spec):
            continue
        use = local_shape(shape, P(*(a if a == "tensor" else None for a in spec)), mesh)
        out += [use[1:]] * use[0] if name.startswith("layers.") else [use]
    return sorted(out)


def weight_shape(r: hlo.Collective) -> tuple[int, ...]:
    """The weight an all-gather carries. Measured (XLA:CPU): inside the scan body GSPMD
    gathers a layer's weight as the [1, in, out] dynamic-slice of the stacked leaf (before
    the reshape to [in, out]), one record of multiplicity L."""
    return r.shape[1:] if len(r.shape) == 3 and r.shape[0] == 1 else r.shape


@contextlib.contextmanager
def stderr_to(path: str):
    """Redirect file descriptor 2 (where XLA's C++ logging writes) to `path`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def train(step, state, place, batches) -> tuple[np.ndarray, Any, Any]:
    losses = []
    for x, y in batches:
        state, metrics = step(state, *place(x, y))
        losses.append(float(metrics["loss"]))
    return np.array(losses), host(state.params), state


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, M.vocab_size, (B, T + 1), dtype=np.int32) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@dataclasses.dataclass
class Reference:
    init: Any
    adamw: tuple[np.ndarray, Any]
    sgd: tuple[np.ndarray, Any]


@pytest.fixture(scope="module")
def reference(batches) -> Reference:
    single = trainer.SingleDevice(M, CFG.train)
    init = host(single.init_state(SEED).params)
    adamw = train(single.train_step, single.init_state(SEED), single.place_batch, batches)[:2]
    sgd_step = jax.jit(functools.partial(trainer.train_step, cfg=M, train_cfg=CFG.train, tx=SGD))
    sgd = train(sgd_step, sgd_state(init), single.place_batch, batches)[:2]
    return Reference(init, adamw, sgd)


def sgd_state(params, shardings=None) -> trainer.TrainState:
    """The SGD train state from host params (saves compiling an init per runner:
    the AdamW runners' init is checked bitwise against single-device init)."""
    state = trainer.TrainState(params, SGD.init(params), np.zeros((), np.int32))
    return jax.device_put(state, shardings)


@dataclasses.dataclass
class Run:
    strategy: str
    runner: auto_parallel.AutoRunner
    mesh: dict[str, int]
    ledger: hlo.Ledger
    compile_log: str
    init: Any
    init_state: Any  # (name, sharding, shard shapes) of every array, before the first step
    adamw: tuple[np.ndarray, Any]
    final_state: trainer.TrainState
    sgd: tuple[np.ndarray, Any]


def placement(state: trainer.TrainState):
    """(group, name, sharding, shard shapes) of every param, mu and nu array."""
    groups = {"param": state.params, "mu": optax.tree_utils.tree_get(state.opt_state, "mu"),
              "nu": optax.tree_utils.tree_get(state.opt_state, "nu")}
    return [(group, path_name(p), a.shape, a.sharding, [s.data.shape for s in a.addressable_shards])
            for group, tree in groups.items() for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0] + (f"[{c[1]}]" if c[1] else ""))
def run(request, batches) -> Run:
    strategy, mesh_spec = request.param
    runner = auto_parallel.make_runner(strategy, mesh_spec, CFG)
    xs = jax.ShapeDtypeStruct((B, T), np.int32, sharding=runner.batch_sharding)
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        with stderr_to(log.name):
            compiled = runner.train_step.lower(runner.abstract_state(), xs, xs).compile()
        compile_log = log.read()
    state = runner.init_state(SEED)
    init, init_state = host(state.params), placement(state)
    *adamw, final = train(compiled, state, runner.place_batch, batches)  # donates `state`
    sgd_runner = auto_parallel.make_runner(strategy, mesh_spec, CFG, tx=SGD)
    sgd = train(sgd_runner.train_step, sgd_state(init, sgd_runner.state_shardings), sgd_runner.place_batch,
                batches)[:2]
    return Run(strategy, runner, dict(runner.mesh.shape), hlo.ledger(compiled, runner.mesh), compile_log,
               init, init_state, tuple(adamw), final, sgd)


# ----------------------------------------------------------------------------- numerics


def test_initial_params_are_bitwise_single_device(run, reference):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(run.init)[0], jax.tree.leaves(reference.init)):
        assert np.array_equal(a, b), path_name(path)


def test_sgd_matches_single_device(run, reference):
    losses, params = run.sgd
    np.testing.assert_allclose(losses, reference.sgd[0], rtol=0, atol=LOSS_ATOL)
    assert max_abs_diff(params, reference.sgd[1]) <= SGD_PARAM_ATOL
    assert losses[-1] < losses[0]  # the comparison is of a run that learns


def test_adamw_matches_single_device(run, reference):
    losses, params = run.adamw
    np.testing.assert_allclose(losses, reference.adamw[0], rtol=0, atol=LOSS_ATOL)
    assert max_abs_diff(params, reference.adamw[1]) <= ADAMW_PARAM_ATOL
    assert max_abs_diff(params, reference.init) > 1e-3  # the params did move


# ----------------------------------------------------------------------------- placement


@pytest.mark.parametrize("when", ["init", "after 5 steps"])
def test_params_and_moments_are_physically_sharded(run, when):
    rows = run.init_state if when == "init" else placement(run.final_state)
    assert {g for g, *_ in rows} == {"param", "mu", "nu"} and len(rows) == 3 * len(PARAMS)
    for group, name, shape, sharding, shard_shapes in rows:
        want = expected_spec(run.strategy, name)
        got = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        assert got == tuple(want), (group, name, sharding.spec, want)
        assert dict(sharding.mesh.shape) == run.mesh
        assert shard_shapes == [local_shape(shape, want, run.mesh)] * 8, (group, name, shard_shapes)


# ----------------------------------------------------------------------------- collectives


def shape_count(led: hlo.Ledger, op: str, axes, shape: tuple[int, ...]) -> int:
    return sum(r.multiplicity for r in led.filter(op=op, axes=axes) if r.shape == shape)


def expect_weight_gathers(run: Run) -> None:
    """One all-gather over data per FSDP-sharded weight, of that whole (TP-local) weight.

    GSPMD gathers each weight once, in the forward pass, and keeps it for the
    backward pass (no re-gather: nothing asks for rematerialization), unlike the
    manual twin, which re-gathers.
    """
    want = use_shapes(run.strategy, run.mesh, fsdp_only=True)
    assert len(want) == 7 * L + 2  # q, k, v, o, w1, w2, w3 per layer + embedding + lm_head
    gathers = expect_collectives(run.ledger, "all-gather", axes="data", count=len(want))
    assert sorted(weight_shape(r) for r in gathers for _ in range(r.multiplicity)) == want
    expect_no_collective(run.ledger, "all-gather", axes="tensor")


def expect_gradient_sync(run: Run) -> None:
    """Gradients reduced over data to their shards: XLA:CPU writes GSPMD's
    reduce-scatter as an all-reduce + dynamic-slice (docs/design.md); GPU/TPU emit reduce-scatter."""
    grad_bytes = 4 * sum(math.prod(s) for s in use_shapes(run.strategy, run.mesh, fsdp_only=False))
    if jax.default_backend() == "cpu":
        expect_no_collective(run.ledger, "reduce-scatter")
        # Every (TP-local) gradient once, plus 4 bytes: the loss's mean over data.
        expect_bytes(run.ledger, "data", bytes=grad_bytes, rel=1e-3, op="all-reduce")
        expect_gradients_in_weight_layout(run)
    else:
        expect_collectives(run.ledger, "reduce-scatter", axes="data")


def expect_gradients_in_weight_layout(run: Run) -> None:
    """Each weight's gradient crosses `data` in the weight's own [in, out] shape, a stacked
    leaf as L records of one layer (GSPMD syncs them inside the backward scan). With autodiff's
    plain dot transpose they crossed as [out, in] and AdamW read them transposed (slow on
    CPU: layers.matmul's docstring). The scalars (loss, norm partial sums) are left out."""
    assert synced_shapes(run.ledger, ("data",), min_rank=1) == use_shapes(run.strategy, run.mesh, fsdp_only=False)


def synced_shapes(led: hlo.Ledger, axes: tuple[str, ...], min_rank: int) -> list[tuple[int, ...]]:
    """Sorted shapes of the all-reduces over `axes` of rank >= min_rank, one per execution (a
    record inside the layer scan counts its multiplicity L): the gradients as they cross the mesh."""
    return sorted(r.shape for r in led.filter(op="all-reduce", axes=axes) if len(r.shape) >= min_rank
                  for _ in range(r.multiplicity))


def check_dp(run: Run) -> None:
    expect_collectives(run.ledger, "all-reduce", axes="data")
    # The gradient all-reduce moves every parameter once (measured: + 4 B, the loss mean).
    got = expect_bytes(run.ledger, "data", bytes=PARAM_BYTES, rel=1e-3, op="all-reduce")
    assert got - PARAM_BYTES == 4
    expect_gradients_in_weight_layout(run)
    expect_no_collective(run.ledger, "all-gather")
    assert {r.op for r in run.ledger} == {"all-reduce"}


def check_fsdp(run: Run) -> None:
    expect_weight_gathers(run)
    expect_gradient_sync(run)
    # Activations never move: no all-to-all or permute (the embedding lookup included).
    assert {r.op for r in run.ledger} <= {"all-gather", "all-reduce", "reduce-scatter"}


def expect_megatron_all_reduces(run: Run) -> None:
    """All-reduces over tensor of the [B/data, T, D] activations, nothing bigger.

    Forward: 1 (vocab-parallel embedding) + 2 per layer (after O, after W2).
    Backward: 1 (input gradient of the vocab-parallel lm_head) + 5 per layer:
    GSPMD all-reduces the input gradient of each column-parallel matmul (q, k,
    v, w1, w3) on its own, where Megatron's f sums them first (2 per layer).
    """
    act = (B // run.mesh["data"], T, D)
    expect_no_collective(run.ledger, axes="tensor", larger_than=4 * math.prod(act))
    # Measured: layers.linear runs as a 2-D dot on [B*T, in] (see its docstring), so GSPMD
    # all-reduces the matmul-side activations flattened, [B/data * T, D]; only the embedding
    # lookup's sum keeps [B/data, T, D]. The same bytes either way.
    flat = (act[0] * T, D)
    assert shape_count(run.ledger, "all-reduce", "tensor", act) == 1  # the embedding
    assert shape_count(run.ledger, "all-reduce", "tensor", flat) == 2 * L + (1 + 5 * L)
    # Vocab-parallel cross-entropy: max, sum of exp and the target logit, never the logits.
    stats = [r for r in run.ledger.filter(op="all-reduce", axes="tensor") if r.shape in (act[:2], act[:2] + (1,))]
    assert len(stats) == 3


def check_tp(run: Run) -> None:
    expect_megatron_all_reduces(run)
    expect_no_collective(run.ledger, "all-gather")  # no weight is ever gathered
    largest_activation = 4 * B * T * D  # [B, T, D] f32: no weight-sized collective
    expect_no_collective(run.ledger, larger_than=largest_activation)
    assert {r.axes for r in run.ledger} == {("tensor",)}


def check_fsdp_tp(run: Run) -> None:
    expect_weight_gathers(run)
    expect_megatron_all_reduces(run)
    expect_gradient_sync(run)
    assert {r.axes for r in run.ledger} == {("data",), ("tensor",)}  # nothing over both axes at once
    assert {r.op for r in run.ledger} <= {"all-gather", "all-reduce", "reduce-scatter"}


CHECKS = {"dp": check_dp, "fsdp": check_fsdp, "tp": check_tp, "fsdp_tp": check_fsdp_tp}


def test_collectives(run):
    expect_parsed(run.ledger)
    CHECKS[run.strategy](run)


def test_no_involuntary_rematerialization(run):
    """The plan regression of auto_parallel/fsdp_tp.py's docstring: without the weight
    layout pinned, GSPMD planned the vocab-sharded embedding lookup with gathered token
    ids, an all-to-all and a collective-permute, and fully rematerialized a tensor.

    The log check only bites on a real compile (a persistent-cache hit skips the SPMD
    partitioner); the HLO checks always do.
    """
    assert "Involuntary full rematerialization" not in run.compile_log
    expect_no_collective(run.ledger, "all-to-all")
    expect_no_collective(run.ledger, "collective-permute")
    assert all(r.dtype == "f32" for r in run.ledger)  # no token ids move
    weight_shapes = set(use_shapes(run.strategy, run.mesh, fsdp_only=False))
    assert all(weight_shape(r) in weight_shapes for r in run.ledger.filter(op="all-gather"))  # only weights
