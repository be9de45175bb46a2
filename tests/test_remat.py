"""ModelConfig.remat: the jax.checkpoint policy of each scanned layer, in every twin.

One compiled `loss_and_grads` per (runner, policy) on the tiny preset (num_heads 8, so
tp can use all 8 devices) gives the gradients, the compiled program's collectives and
its `memory_analysis()`; tracing alone gives JAX's own list of saved residuals.

Measured here (JAX 0.12.0.1, XLA:CPU, opt level 0), the largest gradient difference as a
fraction of the largest entry of its leaf: against the same runner without remat, 0 on
one device (the recomputation repeats the same f32 operations) and 4.2e-7 in a twin (auto
tp, full); against single device without remat, 8.8e-7 (manual and auto fsdp: their
no-remat runs differ as much; the f32 sums add in another order). Tolerance 2e-6.

Temporary bytes of the compiled loss_and_grads (`memory_analysis().temp_size_in_bytes`,
per device; measured as above):
    runner         none       dots       dots_no_batch  full
    single         7285544    4491824    3562016        3201456
    manual fsdp    1156392     823856     747744         610672
    manual tp      2079720    1312432        -          1067640
    auto fsdp      1680960     986872        -           750200
    auto tp        2131008    1274608        -           995952
    manual cp      1258648    1270880        -           847720
    auto cp        1283608     887944        -           650376
The name policies (checkpoint_name; measured as above), temp bytes with full / save_qkv_proj /
minimal / none: single 2988472 / 3381776 / 3807800 / 4960000, manual fsdp 552304 / 601544 /
782520 / 858304 (no longer compiled: POLICIES says why), manual tp 1009272 / 1078928 / 1229560 / 1765248.
(cp on context:8: ring attention in the manual twin, GSPMD's gathered K and V in the auto one;
temp / the model's activations + grads + gathered weights: 0.74 .. 0.95 manual, 0.57 .. 0.88
auto: the model counts each ring step's statistics under every policy, which full recomputes)
(the entries marked - and the dots of auto fsdp, auto tp and both cp twins are not compiled by the
tests; manual cp's dots peaked ~1% above its none although it saves fewer residuals: each ring step's
scores [b, H, T/C, T/C/2] are saved too).
"""

import contextlib
import dataclasses
import functools
import io
import math
import re

import jax
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import manual_parallel
from launch import common
from runners import CFG, assert_ledger_without_optimizer, loss_and_grads, max_relative_diff, single_loss_and_grads
from runners import twin_runner
from twinshard import cost, hlo, testing
from twinshard.config import REMAT_POLICIES, Config, preset
from twinshard.parallel import strategies
from twinshard.train.trainer import create_params, loss_fn

# tests/runners.py's CFG (its grad_clip is the optimizer's, which loss_and_grads does not run): its
# remat=none single-device program is test_data_tensor's step-1 reference, traced once per process
B, T, L = CFG.train.batch_size, CFG.model.context_length, CFG.model.num_layers
MESHES = {"fsdp": "data:8,tensor:1", "tp": "data:1,tensor:8", "fsdp_tp": "data:2,tensor:4", "cp": "context:8"}
GRAD_RTOL = 2e-6
# memory_analysis() temp bytes / the cost model's activations + grads + gathered weights,
# measured: 1.16 (manual fsdp, none) .. 1.92 (auto fsdp, none); before the model counted the
# attention backward's [T, T] arrays (cost.attention_backward): 0.82 .. 2.24.
FACTOR = 2.2
# Policies compiled per runner (a cold compile takes ~2.5 s of CPU, manual cp's ~5 s): every policy
# on one device; none, full and dots (the ordering) for manual fsdp and tp, and the name policies
# (save_qkv_proj, save_dot_except_mlp, minimal) in manual tp, where they meet the twin's own rule (Megatron
# g's outputs saved: OUT_PROJ names a psum's output); none and full for cp (both twins) and the auto
# twins. A twin wraps any policy in the same rule (manual fsdp: RegathersWeights.never_gathered, cp:
# also_saving the ring's shifts, the auto twins: none, GSPMD partitions what autodiff left), so the cells
# left out repeated code others run: manual fsdp's name policies and both twins' cp dots (their temp
# bytes, measured, in the docstring). dots_no_batch in the twins is covered by tracing alone (the
# saved-residual tests below), as is the manual fsdp_tp composition.
POLICIES = {"single": tuple(REMAT_POLICIES), "manual fsdp": ("none", "full", "dots"),
            "manual tp": ("none", "full", "dots", "save_qkv_proj", "save_dot_except_mlp", "minimal"), "auto fsdp": ("none", "full"), "auto tp": ("none", "full"),
            "manual cp": ("none", "full"), "auto cp": ("none", "full")}
RUNNERS = tuple(POLICIES)
# the manual twins whose ledger is compared under each of their POLICIES (their loss_and_grads, compiled
# above for the gradients and temp bytes)
EVERY_POLICY = ("fsdp", "tp", "cp")


def config(policy: str) -> Config:
    return Config(dataclasses.replace(CFG.model, remat=policy), CFG.train)


def make_runner(name: str, policy: str):
    return twin_runner(name, config(policy), MESHES)


@functools.cache
def run(name: str, policy: str) -> dict:
    """Compile the runner's loss_and_grads once; its gradients, temp bytes and ledger."""
    if name == "single":
        return single_loss_and_grads(config(policy))
    return loss_and_grads(make_runner(name, policy), CFG)


@pytest.mark.parametrize("name", RUNNERS)
def test_gradients_equal_the_no_remat_run(name):
    """Each policy recomputes, never changes the math: the runner's gradients equal its own
    remat=none gradients and the single-device ones."""
    for policy in POLICIES[name]:
        grads = run(name, policy)["grads"]
        assert max_relative_diff(grads, run(name, "none")["grads"]) < GRAD_RTOL, policy
        assert max_relative_diff(grads, run("single", "none")["grads"]) < GRAD_RTOL, policy


@pytest.mark.parametrize("name", RUNNERS)
def test_temp_bytes_follow_the_policy(name):
    """memory_analysis() temp bytes: full < dots <= none (and dots_no_batch <= dots), and
    within a factor FACTOR of the cost model's activations + gradients + gathered weights.

    Why only a factor: temp also holds the backward pass's own temporaries (the f32
    logits' gradient [b,T,V], one layer's weight gradients before the scatter or the
    mean), which the model does not count (its `none` residuals are exactly what JAX saves,
    11D + 3F + 4 + H per token and layer on one device; twinshard/cost/memory.py): measured
    1.16x (manual fsdp, none) to 1.92x (auto fsdp, none), 1.79x under full on one device."""
    temps = {p: run(name, p)["temp"] for p in POLICIES[name]}
    assert temps["full"] < temps.get("dots", temps["none"]) <= temps["none"], temps
    assert temps.get("dots_no_batch", 0) <= temps.get("dots", math.inf), temps
    # the name policies: full < save_qkv_proj <= save_dot_except_mlp <= minimal <= none (each a superset)
    if "minimal" in temps:
        assert temps["full"] < temps["save_qkv_proj"] <= temps["save_dot_except_mlp"] <= temps["minimal"] <= temps["none"], temps
    strategy = "dp" if name == "single" else name.split()[1]
    mesh = {"data": 1, "tensor": 1} if name == "single" else run(name, "none")["runner"].sizes
    for policy, temp in temps.items():
        m = cost.memory(CFG.model, strategy, mesh, B, T, remat=policy)
        ratio = temp / (m.activations + m.grads + m.gathered_weights)
        assert 1 / FACTOR <= ratio <= FACTOR, (policy, ratio)


@pytest.mark.fsdp
@pytest.mark.tp
@pytest.mark.cp
def test_manual_collectives_equal_the_cost_model_under_every_policy():
    """The manual twin runs the same collectives under every policy, and the cost model's
    rows (but the optimizer's, which loss_and_grads does not run) say exactly which: FSDP
    gathers each layer's 7 matrices in the forward loop and again in the backward loop
    (multiplicity L each; a gathered weight is never saved), the lm_head again outside;
    TP saves Megatron g's outputs, so no all-reduce is recomputed; cp's ring saves each received
    K/V block, so no forward permute runs again in the backward loop."""
    m = CFG.model
    per_layer = [(m.d_model, m.d_model)] * 4 + [(m.d_model, m.d_ff)] * 2 + [(m.d_ff, m.d_model)]
    for name in (f"manual {s}" for s in EVERY_POLICY):
        for policy in POLICIES[name]:
            led, r = run(name, policy)["ledger"], run(name, policy)["runner"]
            rows = cost.cost(CFG.model, name.split()[1], r.sizes, B, remat=policy).collectives
            model = cost.summarize([row for row in rows if row.phase != "optimizer"])
            assert all(c["match"] for c in cost.compare(led.summary(), model)), (name, policy, led.table())
            if name == "manual fsdp":
                in_loop = [g.shape for g in led.filter(op="all-gather", axes="data") if g.multiplicity == L]
                assert sorted(in_loop) == sorted(per_layer * 2), (policy, in_loop)
                assert led.count("all-gather", "data") == 2 * (7 * L + 2) - 1, policy


# Every other strategy's manual twin under --remat=full (fsdp, tp and cp: their policies, above), on CFG
# and its default mesh of 8 devices but where a family needs more: the experts' model, a pipeline's
# micro-batches, a mesh the default does not give (tiny's 2 layers over 2 stages, its 4 experts).
# Its compiled loss_and_grads, as above: remat changes the forward and backward, never the optimizer's
# rows (the train step is loss_and_grads then the update, manual_parallel/runner.py), and a train
# step compiles in ~2x loss_and_grads' CPU seconds (measured, XLA:CPU).
# ulysses: tests/test_ulysses.py::test_remat_full_saves_the_all_to_alls holds its step under full to the
# cost model (and to single device, and its all-to-alls to 8 a layer, counted by hand).
REMAT_LEDGERS = [s for s in strategies.NAMES if s not in (*EVERY_POLICY, "ulysses")]
REMAT_MESHES = {"pp": "stage:2", "pp_fsdp": "stage:2,data:4", "ep": "data:2,expert:4"}


@pytest.mark.parametrize("strategy", REMAT_LEDGERS)
def test_manual_ledger_under_full_remat_equals_the_cost_model(strategy):
    """A checkpointed layer's backward recomputes its math, never its communication: the compiled
    loss_and_grads' collectives under full are the cost model's rows but the optimizer's, row for row
    (fsdp_cp's ring saves each received K/V block: no forward permute runs again in the backward loop;
    ep's and fsdp_ep's layer policy saves the exchanged buffers: 4 all_to_alls a MoE layer, where
    recomputing the forward pair would make 6; test_experts' test_remat_never_repeats_an_exchange,
    which compiled ep's train step under full for that count, merged here)."""
    family = strategies.get(strategy).family
    model = preset("tiny_moe").model if family == "experts" else CFG.model
    train = dataclasses.replace(CFG.train, microbatches=2) if family == "pipeline" else CFG.train
    cfg = Config(dataclasses.replace(model, remat="full"), train)
    mesh = REMAT_MESHES.get(strategy)
    n = math.prod(int(p.split(":")[1]) for p in mesh.split(",")) if mesh else jax.device_count()
    run = common.resolve_run(strategy, "manual", mesh, cfg, jax.devices()[:n])
    runner = common.runner_of(run)
    tokens = jax.ShapeDtypeStruct((train.batch_size, model.context_length), np.int32, sharding=runner.batch_sharding)
    led = hlo.ledger(runner.loss_and_grads.lower(runner.abstract_state().params, tokens, tokens).compile(), runner.mesh)
    assert_ledger_without_optimizer(led, cost.of_run(run))
    if family == "experts":
        testing.expect_collectives(led, "all-to-all", ("expert",), count=4 * model.moe_layers)


def test_auto_twins_recompute_collectives_under_remat():
    """GSPMD partitions AFTER autodiff applied the policy, so what a policy recomputes, XLA
    communicates again (not in the cost model, which describes the manual twin): auto
    fsdp keeps its gathered weights without remat (7L+2 all-gathers) and re-gathers the 7
    block matrices in the backward loop under full (+7L; measured the same under dots and
    dots_no_batch); auto tp under full recomputes one Megatron g per layer (the attention
    block's, which rebuilds the residual stream: +L all-reduces of [b,T,D]; none more
    under dots, measured)."""
    gathers = {p: run("auto fsdp", p)["ledger"].count("all-gather", "data") for p in ("none", "full")}
    assert gathers == {"none": 7 * L + 2, "full": 14 * L + 2}, gathers
    reduces = {p: run("auto tp", p)["ledger"].count("all-reduce", "tensor") for p in ("none", "full")}
    assert reduces["full"] == reduces["none"] + L, reduces


_RESIDUAL = re.compile(r"(\w+)\[([\d,]*)\]\S* (.*)")  # f32[2,8,32,64]{V:tensor} output of scan from ...
_BYTES = {"f32": 4, "i32": 4, "bf16": 2, "bool": 1}


def residuals(fn, *args) -> list[tuple[tuple[int, ...], int, str]]:
    """(shape, bytes, where) of each residual `jax.ad_checkpoint.print_saved_residuals`
    reports for fn's gradient: JAX's own list of what the forward pass saves."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(fn, *args)
    found = []
    for m in filter(None, map(_RESIDUAL.match, text.getvalue().splitlines())):
        shape = tuple(int(n) for n in m[2].split(",") if n)
        found.append((shape, _BYTES[m[1]] * math.prod(shape), m[3]))
    return found


def local_residuals(strategy: str, policy: str):
    """The residuals of the manual twin's per-device loss (traced inside its shard_map)."""
    return runner_residuals(manual_parallel.make_runner(strategy, MESHES[strategy], config(policy)))


def runner_residuals(r):
    """The residuals of manual runner r's per-device loss (traced inside its shard_map)."""
    found = []

    def body(p, x, y):
        found.extend(residuals(lambda q: r._local_loss(q, x, y), p))
        return x

    tokens = jax.ShapeDtypeStruct((B, T), np.int32, sharding=r.batch_sharding)
    jax.eval_shape(jax.shard_map(body, mesh=r.mesh, in_specs=(r.param_specs, r.batch_spec, r.batch_spec),
                                 out_specs=r.batch_spec, check_vma=True),
                   r.abstract_state().params, tokens, tokens)
    return found


def single_residuals(policy: str):
    m = config(policy).model
    tokens = jax.ShapeDtypeStruct((B, T), np.int32)
    return residuals(functools.partial(loss_fn, cfg=m), jax.eval_shape(lambda: create_params(m, 0)),
                     tokens, tokens)


@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_saved_residuals_per_layer_equal_the_model(policy):
    """What the layer scan hands to the backward pass (JAX's own list, stacked [L, ...]) is
    exactly L x cost.saved_per_layer, plus the last layer's output [b,T,D] (ln_final's
    input): on one device, and per device in the manual tp twin (t=8, where the policy
    also saves Megatron g's output). Under none, the model leaves out the norms' two gains
    [L, 1, 1, D] (so that the activations scale with the batch)."""
    d = CFG.model.d_model
    for saved, t in ((single_residuals(policy), 1), (local_residuals("tp", policy), 8)):
        scan = sum(n for shape, n, where in saved if "output of scan" in where and shape[1:] != (1, 1, d))
        assert scan == 4 * (L * cost.saved_per_layer(CFG.model, policy, B, T, t) + B * T * d), (policy, t)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_tp"])
def test_no_gathered_weight_is_saved(strategy):
    """The manual FSDP twins' saved residuals (per device) hold no gathered weight under
    any policy: no array ends in a whole weight's [in, out] (fsdp_tp: its tensor shard)."""
    m, t = CFG.model, 4 if strategy == "fsdp_tp" else 1
    hd, f, v = m.num_heads * m.head_dim // t, m.d_ff // t, m.padded_vocab_size // t
    gathered = {(m.d_model, hd), (hd, m.d_model), (m.d_model, f), (f, m.d_model), (m.d_model, v)}
    for policy in REMAT_POLICIES:
        saved = local_residuals(strategy, policy)
        assert any("output of scan" in where for *_, where in saved)  # the layers saved something
        weights = [(shape, where) for shape, _, where in saved if shape[-2:] in gathered]
        assert not weights, (policy, weights)


def test_cost_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match=r"remat='selective'.*none, full, dots, dots_no_batch"):
        cost.cost(CFG.model, "fsdp", {"data": 8}, B, remat="selective")
