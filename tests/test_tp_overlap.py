"""ModelConfig.tp_overlap_chunks (batch-split overlap, twinshard/model/transformer.py scan_stacked): the
layer scan carries the residual stream as N chunks of the batch, so one chunk's Megatron all-reduces can
run beside another chunk's matmuls. The same loss and gradients as without chunks, in both twins that run
it; the manual twin's collectives are the cost model's rows (2N all-reduces per layer each way, 1/N the
bytes each); GSPMD's move the same bytes over `tensor`.

Measured (JAX 0.12.0.1, XLA:CPU, opt level 0; tests/runners.py's CFG, 2 chunks): the chunked
weight gradients are the sum of two half-batch products, so they differ from the unchunked ones
by float32 rounding only (max |a - b| / max |b| per leaf below 1e-6).
"""

import dataclasses
import functools

import numpy as np
import pytest

import manual_parallel
from runners import CFG, MESHES, loss_and_grads, max_relative_diff, twin_runner
from twinshard import cost
from twinshard.config import Config, preset
from twinshard.model import layers

B, T, L = CFG.train.batch_size, CFG.model.context_length, CFG.model.num_layers
CHUNKS = 2
# Each twin once, on fsdp_tp: the chunked scan is the same code under tp and fsdp_tp, and fsdp_tp adds
# FSDP's weights fetched once for all chunks. manual tp and auto tp went for suite time (4 cold compiles,
# ~20 s of CPU); their claims (Megatron's f and g per chunk, the same bytes) are fsdp_tp's tests' too.
RUNNERS = ("single", "manual fsdp_tp", "auto fsdp_tp")
RTOL = 1e-6


def config(chunks: int) -> Config:
    return Config(dataclasses.replace(CFG.model, tp_overlap_chunks=chunks), CFG.train)


@functools.cache
def run(name: str, chunks: int) -> dict:
    """The runner's loss_and_grads compiled once: loss, gradients, ledger (None on one device)."""
    return loss_and_grads(twin_runner(name, config(chunks)), CFG)


def test_chunks_split_and_merge_the_batch_in_strides():
    x = np.arange(6 * 2).reshape(6, 2)
    a, b = layers.batch_chunks(x, 2)
    np.testing.assert_array_equal(a, x[0::2])  # sequences 0, 2, 4
    np.testing.assert_array_equal(b, x[1::2])
    np.testing.assert_array_equal(layers.merge_chunks((a, b)), x)


@pytest.mark.parametrize("name", RUNNERS)
def test_twins_with_chunks_equal_single_device(name):
    """Loss of each twin with 2 chunks: the single-device loss without chunks; its gradients: the same
    twin's without chunks (a weight's gradient is now the sum of the chunks' products)."""
    got, want = run(name, CHUNKS), run(name, 1)
    assert abs(got["loss"] - run("single", 1)["loss"]) < 2e-6 * abs(want["loss"]), (got["loss"], want["loss"])
    assert max_relative_diff(got["grads"], want["grads"]) < RTOL


@pytest.mark.parametrize("name", ["manual fsdp_tp"])
def test_manual_collectives_equal_the_cost_model(name):
    """The chunked program's collectives are the cost model's rows exactly: Megatron's f and g once per
    chunk (2 x 2 per layer each way, each half the bytes); FSDP's gathers and scatters once per layer,
    as without chunks (the block's weights fetched once for both chunks)."""
    led, r = run(name, CHUNKS)["ledger"], run(name, CHUNKS)["runner"]
    rows = cost.cost(config(CHUNKS).model, name.split()[1], r.sizes, B).collectives
    model = cost.summarize([row for row in rows if row.phase != "optimizer"])
    assert all(c["match"] for c in cost.compare(led.summary(), model)), led.table()
    unchunked = run(name, 1)["ledger"]
    assert led.count("all-reduce", "tensor") == unchunked.count("all-reduce", "tensor") + 2 * 2 * L * (CHUNKS - 1)
    assert led.total_bytes("tensor", "all-reduce") == unchunked.total_bytes("tensor", "all-reduce")
    if "fsdp" in name:
        for op in ("all-gather", "reduce-scatter"):
            assert led.count(op, "data") == unchunked.count(op, "data")
            assert led.total_bytes("data", op) == unchunked.total_bytes("data", op)


@pytest.mark.parametrize("name", ["auto fsdp_tp"])
def test_auto_moves_the_same_bytes_in_more_all_reduces(name):
    """GSPMD derives the chunks' all-reduces over `tensor` itself: more of them, the same bytes."""
    led, unchunked = run(name, CHUNKS)["ledger"], run(name, 1)["ledger"]
    assert led.count("all-reduce", "tensor") > unchunked.count("all-reduce", "tensor")
    assert led.total_bytes("tensor", "all-reduce") == unchunked.total_bytes("tensor", "all-reduce")


def test_bad_chunk_counts_are_refused_before_compiling():
    with pytest.raises(ValueError, match=r"tp_overlap_chunks=0 .*must be >= 1"):
        config(0)
    with pytest.raises(ValueError, match=r"tp_overlap_chunks=3 .*8 sequences of a micro-batch.*divisor of 8"):
        config(3)
    with pytest.raises(ValueError, match=r"tp_overlap_chunks=8 does not divide the 4 sequences of a device's"):
        manual_parallel.make_runner("fsdp_tp", MESHES["fsdp_tp"], config(8))  # data:2: 4 sequences per device
    with pytest.raises(ValueError, match=r"tp_overlap_chunks=2 .*not --strategy=fsdp --impl=manual"):
        manual_parallel.make_runner("fsdp", MESHES["fsdp"], config(2))
    with pytest.raises(ValueError, match=r"tp_overlap_chunks=2 .*not --strategy=tp --impl=explicit"):
        import explicit_parallel
        explicit_parallel.make_runner("tp", MESHES["tp"], config(2))
    with pytest.raises(ValueError, match=r"tp_overlap_chunks=2 .*chunks dense blocks only"):
        dataclasses.replace(preset("tiny_moe").model, tp_overlap_chunks=2)
    with pytest.raises(ValueError, match=r"tp_overlap_chunks=2 chunks Megatron's all-reduces, which strategy fsdp"):
        cost.cost(config(2).model, "fsdp", {"data": 8, "tensor": 1}, B)
