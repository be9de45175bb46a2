"""hsdp across two slices of 4 devices (--dcn_mesh=data:2 --mesh=fsdp:4; one process: mesh.hybrid_mesh
splits the 8 simulated devices in order into 2 slices): both twins equal single device; across slices
(the `data` axis, DCN) only the gradients' all-reduce travels, each a parameter's shard, with the cost
model's bytes; the manual ledger equals the model; slices come from slice_index where devices have one;
bad input is one line before anything compiles.

Two compiled programs (each twin's loss_and_grads on the shared CFG), and the single device's, which
tests/runners.py caches for the other twin tests."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import numpy as np
import pytest

import auto_parallel
import manual_parallel
from runners import CFG, loss_and_grads, max_relative_diff, twin_runner
from twinshard import cost
from twinshard.parallel import mesh as mesh_lib, resolve

pytestmark = pytest.mark.hsdp  # every test here is a proof of hsdp (tests/test_proofs.py)

TWINS = {"auto": auto_parallel, "manual": manual_parallel}
ICI, DCN = "fsdp:4", "data:2"


@functools.cache
def twin(impl: str) -> dict:
    run = resolve.resolve_run("hsdp", impl, ICI, CFG, dcn_spec=DCN)
    return {"run": run, **loss_and_grads(TWINS[impl].runner_of(run), CFG)}


@functools.cache
def single() -> dict:
    return loss_and_grads(twin_runner("single", CFG), CFG)


def _model(run) -> cost.Cost:
    return cost.of_run(run)


def _step_rows(run) -> list:
    """The model's rows of loss_and_grads (the train step's without the optimizer's: no clipping norm)."""
    return [r for r in _model(run).collectives if r.phase != "optimizer"]


@pytest.mark.parametrize("impl", TWINS)
def test_the_twins_across_two_slices_equal_single_device(impl):
    got, want = twin(impl), single()
    assert dict(got["run"].mesh) == {"data": 2, "fsdp": 4} and dict(got["run"].dcn) == {"data": 2}
    # the DCN axis outermost: slice 0 is devices 0-3, slice 1 devices 4-7 (the simulated split)
    ids = np.vectorize(lambda d: d.id)(got["runner"].mesh.devices)
    assert ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert max_relative_diff(got["grads"], want["grads"]) < 1e-5  # measured 8.8e-7 in both twins


def _param_shards(impl: str) -> set[tuple[int, ...]]:
    """Each parameter's shard shape on one device ([L, D/fsdp, F], the norm gains whole) and one
    layer's of it ([D/fsdp, F]: the manual twin reduces each layer's shard in the layer loop)."""
    shardings = twin(impl)["runner"].state_shardings.params
    shapes = jax.eval_shape(lambda p: p, twin(impl)["grads"])
    shards = {tuple(s.shard_shape(a.shape)) for a, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings))}
    return shards | {shape[1:] for shape in shards if len(shape) == 3}


@pytest.mark.parametrize("impl", TWINS)
def test_only_the_gradient_shards_all_reduce_crosses_slices(impl):
    """Every collective over `data` (the axis across slices) is an all-reduce of a parameter's own
    shard (or the loss scalar), and their bytes are the cost model's across-slice rows: no weight
    gather, no activation and no whole gradient crosses DCN."""
    r = twin(impl)
    across = [c for c in r["ledger"].records if "data" in c.axes]
    assert across and {c.op for c in across} == {"all-reduce"}
    shapes = {c.shape for c in across if c.shape}  # the scalars: the loss's mean
    assert shapes <= _param_shards(impl), shapes - _param_shards(impl)
    measured = sum(s["bytes"] for (_, axes), s in r["ledger"].summary().items() if "data" in axes)
    modelled = sum(row.bytes for row in _step_rows(r["run"]) if "data" in row.axes)
    assert measured == modelled
    # the matrices' shards are 1/fsdp of their gradients: the model prices what a whole one would be
    whole = sum(row.bytes * 4 for row in _step_rows(r["run"]) if row.axes == ("data",) and "shard" in row.what)
    assert measured < whole / 3


def test_manual_ledger_equals_the_cost_model_exactly():
    r = twin("manual")
    rows = cost.compare(r["ledger"].summary(), cost.summarize(_step_rows(r["run"])))
    assert not [row for row in rows if not row["match"]], cost.compare_table(rows) + "\n" + r["ledger"].table()


def test_each_cost_row_moves_its_tensors_dtype_under_bf16_weights():
    """The cost model's hsdp step for CFG's model with bf16 weights and float32 compute, on data:2 (DCN) x
    fsdp:4, counted by hand. The manual twin casts each matrix's shard to the compute dtype before gathering
    it (manual_parallel/fsdp.py), so its gathers, its gradient's reduce-scatter and the scattered shard's
    mean across slices move float32 (4 B); the norm gains are never gathered, so their means (over fsdp,
    then over data) move the weight dtype (2 B); the global norm and the loss are float32 scalars."""
    model = dataclasses.replace(CFG.model, weight_dtype="bfloat16")
    v, d, f, layers = model.padded_vocab_size, model.d_model, model.d_ff, model.num_layers  # 384, 64, 192, 2
    # (name, leaves x layers, elements of one): the embedding is not gathered again in the backward
    matrices = [("token_embeddings", 1, v * d), ("q", layers, d * d), ("k, v", 2 * layers, d * d),
                ("o", layers, d * d), ("w1, w3", 2 * layers, d * f), ("w2", layers, f * d), ("lm_head", 1, d * v)]
    gains = [(2, layers * d), (1, d)]  # (leaves, elements of one): ln1 and ln2, each [L, D]; ln_final [D]
    f32, bf16, fsdp = 4, 2, 4
    want = [("forward", "all-gather", ("fsdp",), n, n * size * f32) for _, n, size in matrices]
    want += [("backward", "all-gather", ("fsdp",), n, n * size * f32) for name, n, size in matrices
             if name != "token_embeddings"]
    want += [("backward", "reduce-scatter", ("fsdp",), n, n * size * f32 // fsdp) for _, n, size in matrices]
    want += [("backward", "all-reduce", ("fsdp",), n, n * size * bf16) for n, size in gains]
    want += [("backward", "all-reduce", ("data",), n, n * size * f32 // fsdp) for _, n, size in matrices]
    want += [("backward", "all-reduce", ("data",), n, n * size * bf16) for n, size in gains]
    want += [("optimizer", "all-reduce", ("fsdp",), 1, f32), ("metrics", "all-reduce", ("data", "fsdp"), 1, f32)]
    rows = cost.cost(model, "hsdp", {"data": 2, "fsdp": 4}, CFG.train.batch_size).collectives
    assert sorted((r.phase, r.op, r.axes, r.count, r.bytes) for r in rows) == sorted(want)


@dataclass(frozen=True)
class _Chip:
    """A device as a TPU slice reports it: its slice_index (on CPU devices have none)."""

    id: int
    slice_index: int
    process_index: int = 0
    platform: str = "cpu"
    device_kind: str = "cpu"


def test_slices_come_from_slice_index():
    """Devices of interleaved slices (even ids slice 0, odd slice 1): each row of the mesh is one slice."""
    chips = [_Chip(i, i % 2) for i in range(8)]
    grid = mesh_lib.hybrid_mesh({"data": 2, "fsdp": 4}, {"data": 2}, chips)
    assert [[c.id for c in row] for row in grid] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match=r"^--dcn_mesh=data:4 spans 4 slices but the 8 devices are in 2 \(by "
                                         r"slice_index\); write --dcn_mesh=data:2\.$"):
        mesh_lib.hybrid_mesh({"data": 4, "fsdp": 2}, {"data": 4}, chips)


@pytest.mark.parametrize("strategy, mesh, dcn, message", [
    ("fsdp", None, "data:2", r"^--dcn_mesh=data:2: strategy fsdp cannot cross slices .*the strategies that can "
                             r"are hsdp, e\.g\. --strategy=hsdp --dcn_mesh=data:2 --mesh=fsdp:4\.$"),
    ("hsdp", "data:2,fsdp:4", "data:2", r"^axis 'data' is named in both --dcn_mesh=data:2 and --mesh=data:2,fsdp:4"
                                        r".*drop it from --mesh \(--mesh=fsdp:4\)\.$"),
    ("hsdp", None, "fsdp:2", r"^bad --dcn_mesh='fsdp:2' at 'fsdp:2': axis 'fsdp' cannot cross slices under hsdp"),
    ("hsdp", None, "data:3", r"^--dcn_mesh=data:3 splits this process's 8 devices into 3 simulated slices, "
                             r"unevenly; choose data from \[2, 4, 8\]\.$"),
])
def test_bad_dcn_input_is_one_line_before_compiling(strategy, mesh, dcn, message):
    with pytest.raises(ValueError, match=message) as e:
        resolve.resolve_run(strategy, "manual", mesh, CFG, dcn_spec=dcn)
    assert "\n" not in str(e.value)


def test_the_default_inner_mesh_fills_each_slice():
    run = resolve.resolve_run("hsdp", "auto", None, CFG, dcn_spec="data:4")
    assert dict(run.mesh) == {"data": 4, "fsdp": 2} and math.prod(run.mesh.values()) == 8
