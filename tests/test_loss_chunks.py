"""ModelConfig.loss_chunks (vocabulary tiling, twinshard/model/loss.py chunked_token_cross_entropy):
the same loss and gradients as the loss from whole logits, in every twin that runs it, the same
collectives (the cost model's rows), and fewer temporary bytes where the logits dominate.

Measured (JAX 0.12.0.1, XLA:CPU, opt level 0; tests/runners.py's CFG, 4 chunks): loss within
1.5e-6 of single device without chunks; gradients within 8.8e-7 of the same twin without chunks
(max |a - b| / max |b| per leaf): the backward's softmax is exp(z - lse), not exp(z - m) / s.
Temporary bytes (`memory_analysis().temp_size_in_bytes`, one device, remat=none, batch 2):
gpt2_125m 2280301248 with whole logits, 1809400704 with 8 chunks.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runners import CFG, MESHES, loss_and_grads, max_relative_diff, twin_runner
from twinshard import cost
from twinshard.config import Config, preset
from twinshard.model import loss
from twinshard.train.trainer import SingleDevice

B, T, L = CFG.train.batch_size, CFG.model.context_length, CFG.model.num_layers
CHUNKS = 4  # 8 tokens per chunk on a fsdp device (B/8 x T = 32 tokens), 64 under tp
# One runner per code path of the chunked loss: the hooks' own (single), GSPMD's without and with its
# per-data-shard vmap (auto tp, auto fsdp), and the manual twin's vocabulary-parallel loss under FSDP's
# re-gathered lm_head (manual fsdp_tp: TensorParallel.chunked_token_loss inside RegathersWeights.head).
# manual tp and manual fsdp, each one half of manual fsdp_tp's path, went for suite time (4 cold
# compiles, ~20 s of CPU); manual fsdp_tp's tests hold their claims (the statistics all-reduces per chunk,
# the lm_head gathered once forward and once backward).
RUNNERS = ("single", "auto tp", "auto fsdp", "manual fsdp_tp")
RTOL = 1e-6


def config(chunks: int, model=CFG.model) -> Config:
    return Config(dataclasses.replace(model, loss_chunks=chunks), CFG.train)


@functools.cache
def run(name: str, chunks: int) -> dict:
    """The runner's loss_and_grads compiled once: loss, gradients, ledger (None on one device)."""
    return loss_and_grads(twin_runner(name, config(chunks)), CFG)


def test_chunked_loss_equals_the_loss_of_whole_logits():
    """The pure function: values and both gradients, on a vocabulary shard holding padding (global
    ids 96..127 of a 110-token vocabulary) and on one without."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 6, 16)), jnp.float32)  # [B, T, D]
    w = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)  # [D, V_local]
    y = jnp.asarray(rng.integers(0, 110, (2, 6)))
    for offset in (0, 96):
        whole = lambda x, w: jnp.sum(loss.token_cross_entropy(x @ w, y, 110, offset) * jnp.arange(12).reshape(2, 6))  # noqa: E731
        tiled = lambda x, w: jnp.sum(loss.chunked_token_cross_entropy(x, w, y, 110, 3, offset)  # noqa: E731
                                     * jnp.arange(12).reshape(2, 6))
        np.testing.assert_allclose(tiled(x, w), whole(x, w), rtol=RTOL)
        assert max_relative_diff(jax.grad(tiled, (0, 1))(x, w), jax.grad(whole, (0, 1))(x, w)) < RTOL


@pytest.mark.parametrize("name", RUNNERS)
def test_twins_equal_the_loss_of_whole_logits(name):
    """Loss and gradients of each twin with 4 chunks: the single-device loss without chunks, and the
    same twin's gradients without chunks (manual tp: pmax / psum per chunk, dx a partial sum that
    Megatron f's backward sums; fsdp: the lm_head weight gathered again for the backward pass)."""
    got, want = run(name, CHUNKS), run(name, 0)
    assert abs(got["loss"] - run("single", 0)["loss"]) < 2e-6 * abs(want["loss"]), (got["loss"], want["loss"])
    assert max_relative_diff(got["grads"], want["grads"]) < RTOL


@pytest.mark.parametrize("name", ["manual fsdp_tp"])
def test_manual_collectives_equal_the_cost_model(name):
    """The chunked program's collectives are the cost model's rows exactly: tp's 3 statistics
    all-reduces once per chunk (4 x 3, each a quarter of the bytes), none added in the backward
    pass; fsdp gathers the lm_head once forward and once backward as without chunks (the gathered
    weight is not saved: RegathersWeights.head checkpoints the chunked loss too)."""
    led, r = run(name, CHUNKS)["ledger"], run(name, CHUNKS)["runner"]
    rows = cost.cost(config(CHUNKS).model, name.split()[1], r.sizes, B).collectives
    model = cost.summarize([row for row in rows if row.phase != "optimizer"])
    assert all(c["match"] for c in cost.compare(led.summary(), model)), led.table()
    if "fsdp" in name:
        assert led.count("all-gather", "data") == run(name, 0)["ledger"].count("all-gather", "data")


def test_auto_fsdp_syncs_the_lm_head_gradient_once():
    """GSPMD runs each data shard's chunks under a vmap (GSPMD.chunked_token_loss): the ledger is the
    one without chunks, not one all-reduce of dW [D, V] per chunk."""
    assert run("auto fsdp", CHUNKS)["ledger"].summary() == run("auto fsdp", 0)["ledger"].summary()


def test_temp_bytes_fall_where_the_logits_dominate():
    """One device, a 8192-token vocabulary (logits [8, 32, 8192] f32 = 8 MiB): the compiled step's
    temporaries fall by about what the memory model's `final` term says, within 25%."""
    model = dataclasses.replace(CFG.model, vocab_size=8192)
    temps, modelled = {}, {}
    for chunks in (0, 8):
        c = config(chunks, model)
        r = SingleDevice(c.model, c.train)
        tokens = jax.ShapeDtypeStruct((B, T), np.int32)
        abstract = jax.eval_shape(lambda: r.init_state(0).params)
        temps[chunks] = r.loss_and_grads.lower(abstract, tokens, tokens).compile().memory_analysis().temp_size_in_bytes
        modelled[chunks] = cost.memory(c.model, "dp", {"data": 1, "tensor": 1}, B, T).activations
    saved, model_saved = temps[0] - temps[8], modelled[0] - modelled[8]
    assert 0.75 < saved / model_saved < 1.25, (temps, modelled)


def test_bad_chunk_counts_are_refused_before_compiling():
    with pytest.raises(ValueError, match=r"loss_chunks=3 .*does not divide batch_size x context_length = 256"):
        config(3)
    with pytest.raises(ValueError, match=r"loss_chunks=64 .*32 tokens of a device's batch.*divisor of 32"):
        run("manual fsdp", 64)  # 256 tokens overall, 32 per device
    with pytest.raises(ValueError, match=r"loss_chunks=4 .*--impl=explicit: use one of those, or --loss_chunks=0"):
        import explicit_parallel
        explicit_parallel.make_runner("fsdp", MESHES["fsdp"], config(4))
    with pytest.raises(ValueError, match=r"loss_chunks=-1 .*must be >= 0"):
        dataclasses.replace(preset("tiny").model, loss_chunks=-1)
