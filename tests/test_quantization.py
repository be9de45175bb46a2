"""ModelConfig.quantization="int8" and "int8_dw" (twinshard/model/quantize.py): the blocks' projections as
int8 x int8 -> int32 dots, forward and for dx (int8_dw: and dW), with per-channel absmax scales.

- the product equals its definition (numpy: each operand rounded per channel, then multiplied); dx is g
  times w's column scales rounded per token, against the forward's int8 w; dW is the unquantized x^T g
  (int8) or x and g rounded per column over the tokens (int8_dw);
- the traced step holds 7 int8 dots with int32 sums per layer forward and 7 backward (q, k, v, o, w1,
  w3, w2), the dW dots and the LM head in the compute dtype, and the compiled step keeps them;
- each twin's loss and gradients equal single device's under int8 and int8_dw to float32 rounding (int8_dw:
  dW's absmax a maximum over every token, a pmax in the manual twins); int8 leaves each ledger unchanged,
  int8_dw adds the cost model's pmaxes; pipelines round dW per micro-batch, alike in both twins; tensor
  parallelism, which would split a quantized contraction, is refused before anything is built. Each twin's
  gradient program is compiled once (gradients()): the twin and the ledger tests read the same executable;

- the loss stays within a stated band of bf16's over training steps on the embedded corpus.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter

import jax
import numpy as np
import pytest

import auto_parallel
import explicit_parallel
import manual_parallel
import reference
from runners import CFG, MESHES as RUNNER_MESHES, initial_params, loss_and_grads
from traced import gradient_step_equations
from twinshard import cost
from twinshard.config import Config
from twinshard.model import matmuls
from twinshard.train import trainer

INT8 = Config(dataclasses.replace(CFG.model, quantization="int8"), CFG.train)
PER_LAYER = 7  # q, k, v, o, w1, w3, w2


def int8_scale(v: np.ndarray, axis: int) -> np.ndarray:
    """The int8 scale of each channel of v: its absmax along `axis` over 127, in float32."""
    return np.abs(v).max(axis=axis, keepdims=True).astype(np.float32) / np.float32(127)


def int8_rounded(v: np.ndarray, axis: int) -> np.ndarray:
    """v quantized to int8 by the absmax along `axis` (one scale per channel of the other axis), dequantized;
    round half to even."""
    scale = int8_scale(v, axis)
    return np.clip(np.round(v / scale), -127, 127) * scale


def operand(rng, shape: tuple[int, int], channel_axis: int) -> np.ndarray:
    """Normal values times 2^(0..3) per channel along `channel_axis`: channels of different magnitude
    tell per-channel scales from one scale per tensor."""
    powers = 2.0 ** (np.arange(shape[channel_axis]) % 4)
    return (rng.normal(size=shape) * (powers[:, None] if channel_axis == 0 else powers[None, :])).astype(np.float32)


@pytest.mark.parametrize("mode", ["int8", "int8_dw"])
def test_the_product_and_its_gradients_are_per_channel_int8(mode):
    rng = np.random.default_rng(0)
    x, g, w = operand(rng, (16, 24), 0), operand(rng, (16, 40), 0), operand(rng, (24, 40), 1)
    y, vjp = jax.vjp(lambda x, w: matmuls.matmul(x, w, mode), x, w)
    dx, dw = vjp(g)
    w_int8 = int8_rounded(w, 0)  # w per output column, over `in`
    np.testing.assert_allclose(y, int8_rounded(x, 1) @ w_int8, rtol=1e-5, atol=1e-4)  # x per token
    s_w = int8_scale(w, 0)  # [1, out]: dx = (g s_w)_int8 (w_int8 / s_w)^T, the forward's int8 w
    np.testing.assert_allclose(dx, int8_rounded(g * s_w, 1) @ (w_int8 / s_w).T, rtol=1e-5, atol=1e-4)
    if mode == "int8":
        np.testing.assert_allclose(dw, x.T @ g, rtol=1e-5, atol=1e-5)  # dW unquantized
    else:  # x and g per column, each over the tokens
        np.testing.assert_allclose(dw, int8_rounded(x, 0).T @ int8_rounded(g, 0), rtol=1e-5, atol=1e-4)
        assert float(np.abs(dw - x.T @ g).max()) > 1e-2
    assert float(np.abs(y - x @ w).max()) > 1e-2 and float(np.abs(dx - g @ w.T).max()) > 1e-2  # rounded: can fail


@functools.cache
def dots(cfg) -> list[tuple]:
    """(input dtypes, output dtype, output shape) of every dot_general of the traced gradient step, scans
    and custom rules included; with scan_unroll 1 each scanned layer's dots appear once. Traced once per
    config (a test reads it twice)."""
    return [(tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype), eqn.outvars[0].aval.shape)
            for eqn in gradient_step_equations(cfg, CFG.train.batch_size) if eqn.primitive.name == "dot_general"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_layer_runs_its_projections_as_int8_dots_forward_and_backward(dtype):
    m = dataclasses.replace(INT8.model, dtype=dtype)
    d, f, kv, rows = m.d_model, m.d_ff, m.kv_dim, CFG.train.batch_size * m.context_length
    int8 = sorted(shape for ins, out, shape in dots(m) if ins == ("int8", "int8") and out == "int32")
    # forward [rows, out]: q, o [D], k, v [kv], w1, w3 [F], w2 [D]; backward dx [rows, in]: q, k, v, w1, w3 [D], o [D], w2 [F]
    forward = [(rows, n) for n in (d, kv, kv, d, f, f, d)]
    backward = [(rows, n) for n in (d, d, d, d, d, d, f)]
    assert int8 == sorted(forward + backward) and len(int8) == 2 * PER_LAYER
    plain = [(ins, shape) for ins, out, shape in dots(m) if ins != ("int8", "int8")]
    assert sum(shape in ((d, d), (d, kv), (d, f), (f, d)) for _, shape in plain) == PER_LAYER  # the dW dots
    assert all(ins == (dtype, dtype) for ins, _ in plain)  # attention, the LM head, dW: unquantized
    assert not [s for ins, out, s in dots(dataclasses.replace(m, quantization="none")) if "int8" in ins]


def test_the_compiled_step_keeps_the_int8_dots():
    """XLA keeps them: 14 dots into s32 (7 in the forward loop's body, 7 in the backward's), each fed
    by two s8 operands (the parameters of their fused computations), in the compiled single-device
    gradient program (the train step's forward and backward; the one the twin tests compile)."""
    import re

    r = gradients("single", "", "int8")["runner"]
    (x, y), = reference.random_batches(CFG.train.batch_size, CFG.model.context_length, CFG.model.vocab_size, 1)
    text = r.loss_and_grads.lower(initial_params(INT8), x, y).compile().as_text()  # (the persistent cache's)
    assert len(re.findall(r"= s32\[[\d,]+\]\{[\d,]*\} dot\(", text)) == 2 * PER_LAYER
    assert len(re.findall(r"%param\S* = s8\[", text)) == 4 * PER_LAYER


# --- the twins ---------------------------------------------------------------------------------

TWINS = {"auto": auto_parallel, "manual": manual_parallel, "explicit": explicit_parallel}
# the strategies a quantized contraction is whole on every device of (tensor parallelism is refused):
# dp and fsdp split the batch (fsdp gathers each weight before its product), cp and ulysses the sequence
# (pp and ep, measured alike: their losses within 1e-5 of single device over 2 steps). dp and fsdp on
# tests/runners.py's meshes: their unquantized programs are the other twin tests' (one compile for the suite)
MESHES = {"dp": RUNNER_MESHES["dp"], "fsdp": RUNNER_MESHES["fsdp"], "cp": "context:8", "ulysses": "context:8"}
# int8_dw: the pmax over data (manual dp), over context (manual cp), Explicit mode's reduced scales (explicit
# fsdp); GSPMD's max over a split axis is the ledger test's and the pipeline test's. These three run int8's
# forward and dx too (int8's dW is the unquantized einsum every other test runs): int8 itself on GSPMD's and
# the manual fsdp (the gathered weight rounded per device), measured alike on all six it ran on (explicit
# ulysses too: every gradient within 1.5e-8 of single device; manual cp 3.2e-5)
DW_CASES = [("manual", "dp"), ("explicit", "fsdp"), ("manual", "cp")]
CASES = [("auto", "fsdp"), ("manual", "fsdp")]
TWIN_CASES = [(i, s, "int8") for i, s in CASES] + [(i, s, "int8_dw") for i, s in DW_CASES]


def quantized(mode: str) -> Config:
    return Config(dataclasses.replace(CFG.model, quantization=mode), CFG.train)


@functools.cache
def gradients(impl: str, strategy: str, mode: str) -> dict:
    """The gradient program (loss_and_grads) of `impl` ('single', or a twin on MESHES[strategy]) under
    quantization `mode`, compiled once at the single-device initial params and the first random batch
    (tests/runners.py): its loss, gradients and ledger. One compile serves the twin test and the ledger
    tests: the train step adds the optimizer's update to this program, whose collectives (the global
    norm's sum) read the gradients, not how they were computed."""
    cfg = quantized(mode)
    r = trainer.SingleDevice(cfg.model, cfg.train) if impl == "single" else \
        TWINS[impl].make_runner(strategy, MESHES[strategy], cfg)
    return loss_and_grads(r, cfg)


# Measured (tiny, float32, step 1, every case, int8 and int8_dw): loss within 9.6e-7 and gradients within
# 1.5e-8 (max abs) of single device, manual cp's within 3.2e-5 (int8) and 6.4e-5 (int8_dw): the int8 values
# and their int32 sums are exact, and its ring attention's float32 sums, in another order, move a value
# across a rounding boundary (a bucket is 1/127 of its channel's absmax). int8_dw with each device's own
# absmax for dW (no pmax over the token axes) is off by 1.7e-4 to 1.8e-4 in the manual twins: GRAD_ATOL
# tells the two apart. Training on from here is each strategy's twin test's (tests/test_data_tensor.py,
# tests/test_context.py: multi-step, unquantized; quantization changes the products, not the update) and,
# quantized, test_int8_loss_stays_within_a_band_of_bf16_on_the_corpus's.
LOSS1_ATOL, GRAD_ATOL = 1e-5, 1e-4


@pytest.mark.parametrize("impl, strategy, mode", TWIN_CASES, ids=["-".join(c) for c in TWIN_CASES])
def test_twins_equal_single_device_under_int8(impl, strategy, mode):
    got, want = gradients(impl, strategy, mode), gradients("single", "", mode)
    assert abs(got["loss"] - want["loss"]) < LOSS1_ATOL
    assert reference.max_diff(got["grads"], want["grads"]) < GRAD_ATOL


def test_a_pipelines_twins_round_dw_alike_per_micro_batch():
    """Pipelines quantize each micro-batch's dW over its own tokens (not one device's whole batch: 1.8e-4
    off single device, measured): pp_fsdp's manual twin, which names its token axes for the pmax as every
    manual runner does, equals GSPMD's within 9.3e-10 (1.6e-4 with each device's own absmax, measured)."""
    cfg = quantized("int8_dw")
    cfg = Config(cfg.model, dataclasses.replace(cfg.train, microbatches=2))
    # the step's gradient program alone, from the single-device init placed (no train step, no init compiled)
    manual, auto = (loss_and_grads(twin.make_runner("pp_fsdp", "data:4,stage:2", cfg), cfg)
                    for twin in (manual_parallel, auto_parallel))
    assert reference.max_diff(manual["grads"], auto["grads"]) < 1e-6 and abs(manual["loss"] - auto["loss"]) < 1e-5


@functools.cache
def collectives(impl: str, strategy: str, quantization: str) -> tuple[tuple, ...]:
    """The gradient program's ledger (gradients()) as (op, dtype, shape, mesh axes, count) rows, sorted."""
    led = gradients(impl, strategy, quantization)["ledger"]
    return tuple(sorted((c.op, c.dtype, c.shape, c.axes, c.multiplicity) for c in led))


# Each twin once. (manual cp went: int8's scales are each product's own on any token split, the code
# manual fsdp runs; int8_dw's pmax over context is test_int8_dw_adds_the_cost_models_pmax_of_each_absmax[cp]'s.)
@pytest.mark.parametrize("impl, strategy", [("manual", "fsdp"), ("auto", "fsdp"), ("explicit", "fsdp")])
def test_int8_leaves_the_ledger_unchanged(impl, strategy):
    """The scales are the per-device product's own (after FSDP's all-gather): int8 adds, removes and
    resizes no collective, so the cost model's ledger holds as it is."""
    plain = collectives(impl, strategy, "none")
    assert plain and collectives(impl, strategy, "int8") == plain


def added_rows(impl: str, strategy: str) -> dict[tuple, tuple[int, int]]:
    """(op, dtype, axes) -> (collectives, bytes) that int8_dw's gradient program runs beyond the unquantized
    one's; asserts it removes none."""
    plain, dw = Counter(collectives(impl, strategy, "none")), Counter(collectives(impl, strategy, "int8_dw"))
    assert not plain - dw, plain - dw
    out: dict[tuple, tuple[int, int]] = {}
    for (op, dtype, shape, axes, runs), n in (dw - plain).items():
        count, size = out.get((op, dtype, axes), (0, 0))
        out[(op, dtype, axes)] = (count + n * runs, size + n * runs * math.prod(shape) * 4)
    return out


# The pmax over data (dp) and over context (cp). (fsdp went: its pmax is dp's, over data, on the gathered
# weights; GSPMD's fsdp is test_int8_dw_under_gspmd_sums_dw_in_int32_and_takes_the_max_itself's.)
@pytest.mark.parametrize("strategy", ["dp", "cp"])
def test_int8_dw_adds_the_cost_models_pmax_of_each_absmax(strategy):
    """The manual twins' int8_dw program runs the unquantized one's collectives and, per quantized operand, a
    pmax of its [1, channels] absmax over the token axes: the rows twinshard/cost/rows.py int8_dw_rows prices."""
    cfg = quantized("int8_dw")
    mesh = dict(gradients("manual", strategy, "int8_dw")["runner"].mesh.shape)
    rows = [r for r in cost.cost(cfg.model, strategy, mesh, cfg.train.batch_size).collectives
            if "dW's int8 absmax" in r.what]
    model: dict[tuple, tuple[int, int]] = {}
    for r in rows:
        count, size = model.get(("all-reduce", "f32", r.axes), (0, 0))
        model[("all-reduce", "f32", r.axes)] = (count + r.count, size + r.bytes)
    # tiny: 2 layers x (8 of [1, 64] + 3 of [1, 192]) = 22 pmaxes, 22 x 4 bytes x the channels
    assert added_rows("manual", strategy) == model and sum(c for c, _ in model.values()) == 22


def test_int8_dw_under_gspmd_sums_dw_in_int32_and_takes_the_max_itself():
    """GSPMD (auto fsdp) places the maxima over `data` itself, one per product and operand ([channels] each:
    2 layers x 7 products x 2 = 28, the shared inputs' not merged as the manual twin's 22 are), and sums each
    dW's partial products over the devices as int32 before the scales, in place of the float32 all-reduce of
    the unquantized dW: 7 per layer, the same shapes."""
    plain = Counter(collectives("auto", "fsdp", "none"))
    dw = Counter(collectives("auto", "fsdp", "int8_dw"))
    as_int32 = Counter({(op, "s32", shape, axes, runs): n for (op, dtype, shape, axes, runs), n in (plain - dw).items()})
    assert sum(n * runs for (_, _, _, _, runs), n in as_int32.items()) == 2 * PER_LAYER
    maxima = dw - plain - as_int32
    assert (dw - plain) - maxima == as_int32
    assert sum(n * runs for (*_, runs), n in maxima.items()) == 2 * PER_LAYER * 2
    assert all(op == "all-reduce" and dtype == "f32" and len(shape) == 1 for (op, dtype, shape, _, _) in maxima)


# --- refused: a split contraction --------------------------------------------------------------------

@pytest.mark.parametrize("impl, strategy, mesh", [("manual", "tp", "data:1,tensor:8"), ("auto", "fsdp_tp", "data:2,tensor:4"),
                                                  ("explicit", "tp_sp", "tensor:8")])
def test_tensor_parallelism_is_refused_before_anything_is_built(impl, strategy, mesh):
    with pytest.raises(ValueError, match=f"^--quantization=int8 with --strategy={strategy}: its `tensor` axis splits"):
        TWINS[impl].make_runner(strategy, mesh, INT8)


# --- the loss against bf16 ---------------------------------------------------------------------------

# Measured (tiny, bf16 compute, 20 AdamW steps on the embedded corpus, single device): the int8 loss within
# 1.4e-3 of bf16's at every step while both fall from 5.84 to 3.58. The band is ~7x that.
BAND, CURVE_STEPS = 1e-2, 20


def test_int8_loss_stays_within_a_band_of_bf16_on_the_corpus(tmp_path):
    from launch import common
    from twinshard.train import data

    cfg = Config(dataclasses.replace(CFG.model, num_heads=4, dtype="bfloat16"), CFG.train)
    tokens, _ = common.load_splits(cfg, None, str(tmp_path))
    t = cfg.train
    batches = [data.get_batch(tokens, t.batch_size, cfg.model.context_length, t.seed, s) for s in range(CURVE_STEPS)]

    def losses(quantization: str) -> np.ndarray:
        r = trainer.SingleDevice(dataclasses.replace(cfg.model, quantization=quantization), t)
        state, out = r.init_state(t.seed), []
        for x, y in batches:
            state, m = r.train_step(state, x, y)
            out.append(float(m["loss"]))
        return np.array(out)

    bf16, int8 = losses("none"), losses("int8")
    assert bf16[0] - bf16[-1] > 1.5  # a run that learns
    np.testing.assert_allclose(int8, bf16, atol=BAND, rtol=0)
    assert not np.array_equal(int8, bf16)  # int8 ran


# --- tools/loss_curves.py: int8 against bf16 from two training runs' metrics.jsonl --------------------

def test_loss_curves_plot_two_runs_and_refuse_bad_input_in_one_line(tmp_path):
    import json

    from cli import assert_user_error, run

    for label, shift in (("bf16", 0.0), ("int8", 0.01)):
        (tmp_path / label).mkdir()
        records = [{"step": s, "loss": 5.0 - s / 100 + shift} for s in range(10, 110, 10)] + [{"step": 100, "eval_loss": 4.2}]
        (tmp_path / label / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "curves.png"
    runs = [f"--run=bf16={tmp_path / 'bf16'}", f"--run=int8={tmp_path / 'int8'}"]
    proc = run("tools/loss_curves.py", *runs, f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "int8: max |loss - bf16| 0.0100 over 10 steps, last held-out loss 4.2000 (step 100)" in proc.stdout
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert_user_error(run("tools/loss_curves.py", *runs, f"--out={out}"), f"--out={out} exists; pass --force")
    assert_user_error(run("tools/loss_curves.py", f"--run=x={tmp_path / 'none'}", f"--out={tmp_path / 'x.png'}"),
                      "metrics.jsonl; train into it first")
    assert not (tmp_path / "x.png").exists()
