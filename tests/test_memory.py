"""The cost model's bytes per device against XLA's memory_analysis(), every strategy and twin.

A compiled train step (state donated) reports per device: arguments (the state and
the local batch), outputs (aliased to the donated state) and temporaries. On tiny and
small (f32, remat none), for single device and every strategy x twin. "tiny" is
tests/runners.py's CFG and MESHES (num_heads 8, every strategy on 8 devices): the train
steps test_data_tensor compiles, loaded here from the compilation cache.

- arguments: the params and the optimizer state are exactly the model's
  (`topology.argument_bytes` splits them; CPU stores arrays unpadded);
- temporaries: `Memory.temporaries` (gradients + saved activations + one layer's
  backward working set + gathered weights) against `temp_size_in_bytes`, within a band
  per twin. XLA's number is the PEAK of a buffer assignment, the model a sum of what
  is alive in the backward pass, so they agree only to a factor; measured (JAX 0.12.0.1,
  XLA:CPU, temp / model; tiny: num_heads 8, tp on tensor:8; small: tp on tensor:4):

      run           tiny   small      what the model leaves out
      single        1.00   0.92       (long, T = 1024: 1.01)
      manual dp     1.39   1.13       the gradients' all-reduce results (one more gradient-
                                      sized buffer; under remat full, where the activations
                                      no longer dwarf it, 1.56-1.77)
      manual fsdp   1.07   1.01
      manual tp     1.01   0.96       (long: 1.19, measured once)
      manual f_tp   0.96   0.94
      auto dp       1.68   1.34       GSPMD all-reduces each layer's gradient inside the
                                      backward loop (auto_parallel/dp.py): more live copies
      auto fsdp     1.64   1.33       GSPMD keeps every layer's gathered weights for the
                                      backward pass (no re-gather: auto_parallel/fsdp.py)
      auto tp       1.04   0.97
      auto f_tp     1.04   0.98

  (Measured with layers.recompute_attention, the default off-GPU: no layer saves a [T, T]
  array, and the model's backward working set counts the recomputed probabilities and their
  gradient, cost.attention_backward. Before it, autodiff of XLA's attention saved the
  scores and the probabilities, and the model's `none` count was exact on one device only:
  under TP it split two replicated [b, T, D] arrays by t; tests/test_remat.py now checks
  none in the manual tp twin too.)

The remat policies' temporaries are checked in tests/test_remat.py; TPU's per-chip
arguments (tile-padded) in tests/test_tpu_topology.py.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import auto_parallel
import manual_parallel
from twinshard import cost
from twinshard.hardware import topology
from twinshard.parallel import pipeline
from runners import CFG, MESHES
from twinshard.config import Config, preset
from twinshard.train.trainer import SingleDevice

# "long": tiny at T = 1024 (batch 4), where one layer's [T, T] attention arrays (recomputed in the
# backward pass: cost.attention_backward) outweigh the residuals; without that term the model
# counted 75 of XLA's 335 MiB here (measured, one device, 8 heads)
CONFIGS = {"tiny": CFG, "small": preset("small"),
           "long": Config(dataclasses.replace(CFG.model, context_length=1024), dataclasses.replace(CFG.train, batch_size=4))}
RUNS = [("single", None)] + [(s, impl) for s in MESHES for impl in ("auto", "manual")]
# small: single device and manual fsdp (the other small rows, measured once, are in the
# docstring; each small compile costs ~5 s of the suite's 10 minutes)
CASES = [("tiny", *r) for r in RUNS] + [("small", "single", None), ("small", "fsdp", "manual"), ("long", "single", None)]
# temp / model bands (module docstring): the manual twins and single device to ~25%; manual dp
# and the GSPMD twins hold buffers the model does not count (above)
BANDS = {"manual": (0.85, 1.35), "single": (0.85, 1.25), "manual_dp": (0.85, 1.8), "auto": (0.85, 1.75)}


@functools.cache
def compiled(name: str, strategy: str, impl: str | None):
    cfg: Config = CONFIGS[name]
    if strategy == "single":
        runner = SingleDevice(cfg.model, cfg.train)
    else:
        make = {"auto": auto_parallel, "manual": manual_parallel}[impl].make_runner
        runner = make(strategy, MESHES[strategy], cfg)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32,
                                  sharding=getattr(runner, "batch_sharding", None))
    state = runner.abstract_state()
    step = runner.train_step.lower(state, tokens, tokens).compile()
    mesh = getattr(runner, "sizes", {"data": 1, "tensor": 1})
    model = cost.memory(cfg.model, "dp" if strategy == "single" else strategy, mesh, cfg.train.batch_size,
                        cfg.model.context_length)
    return step, state, tokens, model


@pytest.mark.parametrize("name, strategy, impl", CASES)
def test_memory_analysis_beside_the_model(name, strategy, impl):
    step, state, tokens, model = compiled(name, strategy, impl)
    ma = step.memory_analysis()
    if strategy != "single":  # single device: one array per leaf, the same sums (not split here)
        args = topology.argument_bytes(step, state, tokens, tokens)
        assert args["params"]["bytes"] == model.params
        assert args["optimizer"]["bytes"] == model.optimizer
        assert args["total"]["bytes"] == args["total"]["padded"] == ma.argument_size_in_bytes
    low, high = BANDS["manual_dp" if (strategy, impl) == ("dp", "manual") else impl or "single"]
    ratio = ma.temp_size_in_bytes / model.temporaries
    assert low <= ratio <= high, (ratio, ma.temp_size_in_bytes, dataclasses.asdict(model))


def test_single_device_arguments_are_the_state_and_the_batch():
    step, state, tokens, model = compiled("tiny", "single", None)
    batch = 2 * tokens.shape[0] * tokens.shape[1] * 4
    counters = step.memory_analysis().argument_size_in_bytes - model.params - model.optimizer - batch
    assert 0 <= counters <= 64  # the step counter, Adam's count, the skip counter, the last norm


# ----------------------------------------------------------------------------- pipelines and context
# The compiled temporaries of pp/pp_fsdp and cp/fsdp_cp are compared with the model in
# tests/test_pipeline.py and tests/test_context.py, where those train steps are compiled; here
# the model's per-device terms are counted by hand from the config (float32, AdamW, remat none).

def hand_terms(m, b: int, seq: int) -> dict[str, int]:
    """Elements of one layer's residuals under remat none on b sequences of seq tokens (one
    device, no tensor split: 6 [b,T,D] + 5 attention [b,T,D] + 3 SwiGLU [b,T,F] + 4 norm
    statistics + the log-sum-exp per head), and its attention backward's [T, T] probabilities
    and their gradient (elements)."""
    d, f, h = m.d_model, m.d_ff, m.num_heads
    return {"layer": b * seq * (11 * d + 3 * f + 4 + h), "scores": 2 * b * h * seq * seq}


def head_bytes(m, rows: int, seq: int, loss: bool = True) -> int:
    """ln_final's input and output [rows, T, D] and the logits [rows, T, V], plus (loss) the f32 loss's exp."""
    return (2 * rows * seq * m.d_model + (1 + loss) * rows * seq * m.padded_vocab_size) * 4


@pytest.mark.parametrize("strategy", ["pp", "pp_fsdp"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "interleaved"])
def test_pipeline_memory_is_the_hand_count(strategy, schedule):
    """S = 2 stages of L/S = 2 layers, M = 4 micro-batches of b/M rows (pp_fsdp: data 2, b = B/2).
    GPipe saves a stage's layers in each of the M + S - 1 ticks and runs the head on all b rows;
    1F1B saves one micro-batch's layers, a ring of the S stage inputs it holds and one of the one
    gradient it waits to use [b/M, T, D] (and a spare slot each), the head per micro-batch (its
    backward alone, without the loss's f32 exp beside the logits: manual_parallel/pp.py `_output_grad`); zb_h1
    1F1B's and S + 1 stashes kept from B to W (manual_parallel/pp_split.py), each per token every
    block's tapped op's output gradient and its distinct operands (float32 here); interleaved
    (V = 2) one chunk's layer (a backward re-runs one chunk), the stage inputs of every chunk in flight
    (the table's peak, 5 on stage 0: its Megatron warm-up of (S-1) 2 + (V-1) S forwards and one) and 2
    gradients (stage 1 holds those of B0.1 and B1.1 when it runs B0.0). pp_fsdp: the matrices over
    data, gathered whole for the step (f32 under GPipe) with their f32 gradient."""
    m = dataclasses.replace(CFG.model, num_layers=4)
    B, T, S, M, D, F, V = 16, m.context_length, 2, 4, m.d_model, m.d_ff, m.padded_vocab_size
    data = 2 if strategy == "pp_fsdp" else 1
    b, Ls, hd = B // data, m.num_layers // S, m.num_heads * m.head_dim
    bm = b // M
    mats, norms = Ls * (4 * D * hd + 3 * D * F) + 2 * V * D, 2 * Ls * D + D
    params = (mats // data + norms) * 4
    one, v = hand_terms(m, bm, T), 2 if schedule == "interleaved" else 1
    in_flight = max(pipeline.build(schedule, S, M, v).in_flight())
    assert v == 1 or in_flight == (S - 1) * 2 + (v - 1) * S + 1  # Megatron's warm-up, and the first 1F1B pair's F
    saved = {"gpipe": Ls * one["layer"] * (M + S - 1), "1f1b": Ls * one["layer"] + (S + 1 + 2) * bm * T * D,
             "zb_h1": Ls * one["layer"] + (S + 1 + 2) * bm * T * D,
             "interleaved": Ls // v * one["layer"] + (in_flight + 2 + 2) * bm * T * D}[schedule]
    kv = m.kv_dim
    dys = (D + hd + kv + kv + D + D + F + F + D)  # ln1, q, k, v, wo, ln2, w1, w3, w2
    operands = (D + D + hd + D + D + F)  # x^ of ln1, its output (q, k, v), wo's input, x^ of ln2, its output, the gate
    kept = (S + 1) * bm * T * Ls * (dys + operands) * 4 if schedule == "zb_h1" else 0  # the blocks' alone
    gpipe = schedule == "gpipe"
    want = {"params": params, "grads": params, "optimizer": 2 * params,
            "activations": saved * 4 + kept + (head_bytes(m, b, T) if gpipe else head_bytes(m, bm, T, loss=False)),
            "gathered_weights": mats * 4 if data > 1 else 0, "accumulator": mats * 4 if data > 1 else 0,
            "backward_layer": (one["layer"] + one["scores"]) * 4, "master": 0}
    mesh = {"stage": S, "data": data, "tensor": 1}
    got = cost.memory(m, strategy, mesh, B, T, microbatches=M, schedule=schedule, virtual=v)
    assert dataclasses.asdict(got) == want
    assert dataclasses.asdict(cost.cost(m, strategy, mesh, B, microbatches=M, schedule=schedule,
                                        virtual_stages=v).memory) == want


@pytest.mark.parametrize("strategy", ["cp", "fsdp_cp"])
def test_context_memory_is_the_hand_count(strategy):
    """C = 4 (fsdp_cp: data 2 x context 4) shards of T/C tokens: each layer saves the residuals of
    T/C tokens, ring attention's C-1 received K and V blocks [b, H, T/C, dh] and its C steps'
    statistics (acc [b, H, T/C, dh], max and sum [b, H, T/C, 1]); the backward rebuilds one
    block's scores and probabilities [b, H, T/C, T/C]; the head runs on T/C tokens."""
    m = CFG.model
    B, T, C, D, F, V, L, H = 8, m.context_length, 4, m.d_model, m.d_ff, m.padded_vocab_size, m.num_layers, m.num_heads
    data = 2 if strategy == "fsdp_cp" else 1
    b, tc, hd = B // data, T // C, H * m.head_dim
    layer_mats = 4 * D * hd + 3 * D * F
    mats, norms = L * layer_mats + 2 * V * D, 2 * L * D + D
    params = (mats // data + norms) * 4
    ring = 2 * (C - 1) * b * tc * D + C * (b * tc * D + 2 * b * H * tc)
    one = hand_terms(m, b, tc)
    want = {"params": params, "grads": params, "optimizer": 2 * params,
            "activations": L * (one["layer"] + ring) * 4 + head_bytes(m, b, tc),
            "gathered_weights": max(layer_mats, V * D) * 4 if data > 1 else 0, "accumulator": 0,
            "backward_layer": (one["layer"] + ring + 2 * b * H * tc * tc) * 4, "master": 0}
    mesh = {"data": data, "context": C}
    assert dataclasses.asdict(cost.memory(m, strategy, {**mesh, "tensor": 1}, B, T)) == want
    assert dataclasses.asdict(cost.cost(m, strategy, mesh, B).memory) == want


def test_memory_rejects_an_unknown_schedule():
    with pytest.raises(ValueError, match=r"schedule='zbv' is not a pipeline schedule; choose one of gpipe, 1f1b, interleaved, zb_h1"):
        cost.memory(CFG.model, "pp", {"stage": 2, "data": 1}, 8, 32, microbatches=4, schedule="zbv")
