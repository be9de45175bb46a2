"""The analytic cost model (twinshard/cost/) against numbers derived by hand.

tiny preset: V = 384 (257 padded), D = 64, L = 2, H = 4, dh = 16, F = 192,
T = 32, B = 8. Per-weight bytes (f32):

    embedding [384,64] 98304   q/k/v [64,64] 16384 (x6)   o [64,64] 16384 (x2)
    w1/w3 [64,192] 49152 (x4)  w2 [192,64] 49152 (x2)     lm_head [64,384] 98304
    norms [64] 256 (x5)

    matrices M = 98304 + 6*16384 + 2*16384 + 4*49152 + 2*49152 + 98304 = 622592
    norms      = 5 * 256 = 1280;     M + norms = 623872 = 4 * num_params (155968)
"""

import dataclasses
import functools
import json
from collections import Counter

import jax
import pytest

from twinshard import cost
from twinshard.config import preset
from twinshard.parallel import mesh as mesh_lib, pipeline, resolve

CFG = preset("tiny").model
B, T = 8, 32
M, NORMS, EMB = 622592, 1280, 98304  # matrix bytes, norm bytes, one embedding-sized matrix
A = B * T * 64 * 4  # one [8, 32, 64] f32 activation = 65536


def test_tiny_constants_are_what_the_docstring_says():
    assert (CFG.padded_vocab_size, CFG.d_model, CFG.num_layers, CFG.num_heads, CFG.d_ff,
            CFG.context_length) == (384, 64, 2, 4, 192, 32)
    assert M + NORMS == 4 * CFG.num_params() == 623872


def test_weights_match_the_real_parameter_tree():
    from twinshard.train import trainer

    shapes = jax.eval_shape(functools.partial(trainer.create_params, CFG, 0))
    axes = trainer.logical_axes(CFG)
    real = Counter((tuple(s.shape), a) for s, a in zip(
        jax.tree.leaves(shapes), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))))
    model = Counter()
    for w in cost.weights(CFG):  # block weights are stacked leaves [L, ...] ('layers', ...)
        model[(w.leaf_shape, w.leaf_axes)] += w.leaves
    assert model == real
    assert sum(w.count * w.size for w in cost.weights(CFG)) == CFG.num_params()
    assert sum(w.count for w in cost.weights(CFG) if w.is_matrix) == 7 * 2 + 2  # 7L + 2
    assert sum(w.count for w in cost.weights(CFG) if not w.is_matrix) == 2 * 2 + 1  # 2L + 1


def test_dp_all_reduces_every_parameter_once():
    c = cost.cost(CFG, "dp", {"data": 8, "tensor": 1}, B)
    # 12 gradient leaves (9 stacked [L, ...] block leaves + embedding, ln_final, lm_head)
    # + the loss; bytes = all params + 4.
    assert c.summary() == {("all-reduce", ("data",)): {
        "count": 13, "bytes": 623876, "ring_bytes": 2 * 7 / 8 * 623876}}
    grads = [r for r in c.collectives if r.phase == "backward"]
    assert sum(r.bytes for r in grads) == CFG.num_params() * 4
    assert sum(r.count for r in grads) == 9 + 3
    assert not [r for r in c.collectives if r.phase == "optimizer"]


def test_fsdp_gathers_twice_and_scatters_once():
    c = cost.cost(CFG, "fsdp", {"data": 8}, B)  # a missing axis is 1
    assert c.summary() == {
        # forward 16 gathers (M) + backward 15 re-gathers (M minus the embedding, whose
        # gradient is a scatter-add that never reads the gathered table).
        ("all-gather", ("data",)): {"count": 31, "bytes": 2 * M - EMB, "ring_bytes": 7 / 8 * (2 * M - EMB)},
        ("reduce-scatter", ("data",)): {"count": 16, "bytes": M // 8, "ring_bytes": 7 * M // 8},
        # 3 norm gradient leaves (ln1, ln2 [L, D], ln_final [D]: 1280) + the squared-norm scalar + the loss
        ("all-reduce", ("data",)): {"count": 5, "bytes": NORMS + 8, "ring_bytes": 2 * 7 / 8 * (NORMS + 8)},
    }
    assert [r.phase for r in c.collectives if r.op == "all-reduce"][-2:] == ["optimizer", "metrics"]


def test_tp_is_megatron():
    c = cost.cost(CFG, "tp", {"data": 1, "tensor": 4}, B)
    # forward: embedding psum + 2 per layer (A each) + 3 CE statistics [8,32] f32 (1024 each);
    # backward: 2 per layer + before lm_head; optimizer: the squared-norm scalar.
    count, nbytes = (1 + 4 + 3) + (4 + 1) + 1, (1 + 4 + 4 + 1) * A + 3 * 1024 + 4
    assert (count, nbytes) == (14, 658436)
    assert c.summary() == {("all-reduce", ("tensor",)): {
        "count": count, "bytes": nbytes, "ring_bytes": 2 * 3 / 4 * nbytes}}
    assert not [r for r in c.collectives if r.phase == "metrics"]


def test_fsdp_tp_combines_both_on_local_shapes():
    c = cost.cost(CFG, "fsdp_tp", {"data": 2, "tensor": 4}, B)
    a = A // 2  # per-device batch B/d = 4
    assert c.summary() == {
        ("all-gather", ("data",)): {"count": 31, "bytes": (2 * M - EMB) // 4,
                                    "ring_bytes": 1 / 2 * (2 * M - EMB) // 4},
        ("reduce-scatter", ("data",)): {"count": 16, "bytes": M // 8, "ring_bytes": M // 8},
        # 3 norm gradient leaves (ln1, ln2 [L, D], ln_final) + the loss
        ("all-reduce", ("data",)): {"count": 4, "bytes": NORMS + 4, "ring_bytes": NORMS + 4},
        ("all-reduce", ("tensor",)): {"count": 13, "bytes": 10 * a + 3 * 512,
                                      "ring_bytes": 1.5 * (10 * a + 3 * 512)},
        ("all-reduce", ("data", "tensor")): {"count": 1, "bytes": 4, "ring_bytes": 2 * 7 / 8 * 4},
    }
    assert c.by_axes()[("data",)]["count"] == 31 + 16 + 4


def test_ring_bytes_follow_the_ledger_convention():
    c = cost.cost(CFG, "fsdp", {"data": 4, "tensor": 1}, B)
    for r in c.collectives:
        n = 4
        want = {"all-gather": (n - 1) / n * r.bytes, "reduce-scatter": (n - 1) * r.bytes,
                "all-reduce": 2 * (n - 1) / n * r.bytes}[r.op]
        assert r.ring_bytes == pytest.approx(want)


def test_flops_hand_count():
    f = cost.flops(CFG, B, T)
    n_mm = CFG.num_params() - 384 * 64 - 5 * 64  # no matmul: embedding lookup, norm gains
    assert f.matmul_params == n_mm == 131072
    attention = 2 * 2 * 2 * B * T * T * 64  # L * (QK^T + AV) * 2BT^2D, causal half included
    assert f.forward == 2 * B * T * n_mm + attention == 67108864 + 4194304
    assert f.total == 3 * f.forward == 6 * n_mm * B * T + 3 * attention
    # 6 N tokens (N with the embedding) overestimates by the embedding + norms, ~16% here.
    assert 6 * CFG.num_params() * B * T == pytest.approx(f.total, rel=0.2)
    assert cost.cost(CFG, "fsdp_tp", {"data": 2, "tensor": 4}, B).flops.per_device == f.total / 8
    # MFU's FLOPs: the masked half of causal attention is not counted (flash/splash skip it)
    assert f.model_total == 6 * n_mm * B * T + 3 * attention // 2 == 3 * (67108864 + 2097152)
    assert cost.cost(CFG, "fsdp_tp", {"data": 2, "tensor": 4}, B).flops.model_per_device == f.model_total / 8


def test_flops_match_xlas_count():
    """XLA's cost analysis of the single-device step (it also counts elementwise ops: +3%).

    Measured (XLA:CPU, JAX 0.12): cost_analysis() counts a `while` body ONCE, whatever its
    trip count, so with the scanned layer stack it reports the flops of a 1-layer model
    (tiny, L=2: 129.7M where the model says 213.9M). Compare on L=1, where once is right.
    """
    import dataclasses

    import jax.numpy as jnp

    from twinshard.train import trainer

    cfg = dataclasses.replace(CFG, num_layers=1)
    params = jax.eval_shape(functools.partial(trainer.create_params, cfg, 0))
    x = jax.ShapeDtypeStruct((B, T), jnp.int32)
    loss = functools.partial(trainer.loss_fn, cfg=cfg)
    xla = jax.jit(jax.value_and_grad(loss)).lower(params, x, x).compile().cost_analysis()["flops"]
    assert xla == pytest.approx(cost.flops(cfg, B, T).total, rel=0.05)


def test_memory_per_device():
    dp = cost.cost(CFG, "dp", {"data": 8, "tensor": 1}, B).memory
    assert dp.params == dp.grads == M + NORMS and dp.optimizer == 2 * (M + NORMS)
    # b = 1, per layer (what autodiff saves): 32*(6*64 + 5*64 + 3*192 + 4 + 4) = 41216 (no [T, T]
    # array: layers.recompute_attention keeps o and the log-sum-exp); final 2*32*64 + 2*32*384 = 28672
    assert dp.activations == 4 * (2 * 41216 + 28672) == 444416
    assert dp.gathered_weights == 0
    fsdp = cost.cost(CFG, "fsdp", {"data": 8, "tensor": 1}, B).memory
    assert fsdp.params == M // 8 + NORMS == 79104
    assert fsdp.gathered_weights == 4 * max(4 * 64 * 64 + 3 * 64 * 192, 384 * 64)
    tp = cost.cost(CFG, "tp", {"data": 1, "tensor": 4}, B).memory
    assert tp.params == M // 4 + NORMS
    fsdp_tp = cost.cost(CFG, "fsdp_tp", {"data": 2, "tensor": 4}, B).memory
    assert fsdp_tp.params == M // 8 + NORMS and fsdp_tp.total > fsdp_tp.params * 4


def test_of_run_prices_a_gpu_run_and_the_single_device_reference():
    """cost.of_run, what the launchers price a resolved run with: on a GPU (attention auto in bf16:
    cuDNN flash attention, no [T, T] working set) and for the single-device reference (dp's memory
    on one device, no collectives)."""
    cfg = preset("tiny")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"),
                              train=dataclasses.replace(cfg.train, batch_size=B, grad_accum=2))
    run = resolve.resolve_run("dp", "manual", "data:4,tensor:1", cfg, jax.devices()[:4])
    gpu = cost.of_run(run, gpu=True)
    assert gpu.memory == cost.cost(cfg.model, "dp", {"data": 4}, B, grad_accum=2, gpu=True).memory
    assert gpu.memory.backward_layer < cost.of_run(run).memory.backward_layer
    one = cost.of_run(resolve.single_run(cfg), gpu=True)
    assert one.collectives == [] and one.flops == cost.flops(cfg.model, B, T, 1)
    assert one.memory == cost.memory(cfg.model, "dp", {"data": 1, "tensor": 1}, B, T, 2, grad_accum=2, gpu=True)


def test_of_run_checks_nothing_the_resolved_run_checked(monkeypatch):
    """A resolved run was checked once (resolve.resolve_run): pricing it re-parses and re-checks nothing."""
    cfg = dataclasses.replace(preset("tiny"), train=dataclasses.replace(preset("tiny").train, microbatches=2))
    runs = [resolve.resolve_run(s, "manual", spec, cfg, jax.devices()[:4])
            for s, spec in (("fsdp_tp", "data:2,tensor:2"), ("pp_fsdp", "stage:2,data:2"), ("cp", "context:4"))]
    priced = [cost.of_run(run) for run in runs]

    def checked(*_, **__):
        raise AssertionError("a check ran again")
    for owner, name in ((cost, "_normalize_mesh"), (mesh_lib, "check_mesh"), (mesh_lib, "check_divisible"),
                        (mesh_lib, "parse_mesh"), (pipeline, "check"), (resolve, "check_experts")):
        monkeypatch.setattr(owner, name, checked)
    assert [cost.of_run(run) for run in runs] == priced
    with pytest.raises(AssertionError, match="ran again"):  # the checks `cost` itself makes
        cost.cost(cfg.model, "fsdp_tp", {"data": 2, "tensor": 2}, B)


@pytest.mark.parametrize("strategy, mesh, kwargs, match", [
    ("zero3", {"data": 8}, {}, r"unknown strategy 'zero3'.*dp, fsdp, tp, fsdp_tp"),
    ("tp", {"data": 2, "tensor": 4}, {}, r"tp needs data = 1.*--mesh=data:1,tensor:8"),
    ("dp", {"data": 1}, {}, r"dp needs data > 1"),
    ("tp", {"tensor": 8}, {}, r"heads=4 is not divisible by mesh axis tensor=8; .*run on 4: --devices=4 --mesh=data:1,tensor:4"),
    ("fsdp", {"data": 3}, {}, r"batch=8 is not divisible by mesh axis data=3"),
    ("dp", {"data": 2, "pipeline": 2}, {}, r"mesh axis 'pipeline' is not one of"),
    ("dp", {"data": 2}, {"seq_len": 64}, r"seq_len=64 must be in \[1, context_length=32\]"),
    ("dp", {"data": 2}, {"dtype_bytes": 3}, r"dtype_bytes=3"),
    ("pp", {"stage": 2}, {"grad_accum": 2, "microbatches": 2},
     r"grad_accum=2: a pipeline already accumulates .* use --microbatches instead"),
])
def test_bad_input_names_the_value_and_the_fix(strategy, mesh, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cost.cost(CFG, strategy, mesh, B, **kwargs)


def test_shorter_sequence_and_bf16_scale():
    full = cost.cost(CFG, "tp", {"data": 1, "tensor": 2}, B)
    half = cost.cost(CFG, "tp", {"data": 1, "tensor": 2}, B, seq_len=16, dtype_bytes=2)
    act = next(r for r in half.collectives if "Megatron g" in r.what)
    assert act.count == 4 and act.bytes == 4 * (B * 16 * 64) * 2  # 2 per layer x L=2, [8,16,64] x 2 bytes
    assert half.flops.forward_attention * 4 == full.flops.forward_attention


def test_text_json_and_compare():
    c = cost.cost(CFG, "fsdp_tp", {"data": 2, "tensor": 4}, B)
    text = c.table()
    assert "reduce-scatter" in text and "total over tensor" in text and "flops/step" in text
    doc = json.loads(c.to_json())
    assert doc["summary"] and doc["collectives"][0]["phase"] == "forward"
    assert [r["phase"] for r in doc["collectives"]] == sorted(
        (r["phase"] for r in doc["collectives"]), key=cost.PHASES.index)
    measured = {k: dict(v) for k, v in c.summary().items()}
    assert all(r["match"] for r in cost.compare(measured, c.summary()))
    del measured[("reduce-scatter", ("data",))]
    measured[("all-to-all", ("tensor",))] = {"count": 1, "bytes": 8, "ring_bytes": 4.0}
    rows = {(r["op"], tuple(r["axes"])): r for r in cost.compare(measured, c.summary())}
    assert not rows[("reduce-scatter", ("data",))]["match"]
    assert rows[("all-to-all", ("tensor",))]["model_count"] == 0
    table = cost.compare_table(list(rows.values()))
    assert "DIFFERS" in table and "TOTAL" in table


@pytest.mark.parametrize("field, value, match", [("count", 4, False), ("bytes", 1024 + 2, False),
                                                 ("ring_bytes", 1.0, True), ("count", 3, True)])
def test_compare_matches_a_row_on_its_count_and_its_bytes_each(field, value, match):
    """A measured row matches the model's when its count AND its bytes agree, each on its own (3 all-reduces
    of 1024 B; ring bytes are derived, reported, not compared): one more collective, or two bytes more of
    the same count, is a row that DIFFERS."""
    model = {("all-reduce", ("data",)): {"count": 3, "bytes": 1024, "ring_bytes": 1536.0}}
    measured = {("all-reduce", ("data",)): {**model["all-reduce", ("data",)], field: value}}
    (row,) = cost.compare(measured, model)
    assert row["match"] is match and row[f"measured_{field}"] == value
    assert ("DIFFERS" in cost.compare_table([row])) is not match


def test_permute_rows_say_who_sends_to_whom():
    """pp on stage:2 with M=4 (GPipe, M+S-1 = 5 ticks): one hop per tick one stage on, the last
    stage sending nothing (a line), and one back; cp's ring over context:4 forward, the reverse
    ring backward, 2(C-1) L = 12 of each. A measured summary whose hops go the wrong way
    (here: the forward wraps around, last stage to first) no longer matches, and says so."""
    pp = cost.cost(CFG, "pp", {"stage": 2}, B, microbatches=4)
    want = {"stage +1": 5, "stage -1": 5}
    assert pp.summary()[("collective-permute", ("stage",))]["patterns"] == want
    assert "collective-permute  stage -1  5" in pp.table()
    cp = cost.cost(CFG, "cp", {"context": 4}, B)
    assert cp.summary()[("collective-permute", ("context",))]["patterns"] == {
        "context ring +1": 12, "context ring -1": 12}
    two = cost.cost(CFG, "fsdp_cp", {"data": 2, "context": 2}, B)  # on 2 devices one ring, printed +1
    assert two.summary()[("collective-permute", ("context",))]["patterns"] == {"context ring +1": 8}
    measured = {k: dict(v) for k, v in pp.summary().items()}
    assert all(r["match"] for r in cost.compare(measured, pp.summary()))
    measured[("collective-permute", ("stage",))]["patterns"] = {"stage ring +1": 5, "stage -1": 5}
    rows = cost.compare(measured, pp.summary())
    bad = [r for r in rows if not r["match"]]
    assert [(r["op"], r["measured_count"], r["model_count"]) for r in bad] == [("collective-permute", 10, 10)]
    assert f"DIFFERS who sends to whom: measured {measured[bad[0]['op'], ('stage',)]['patterns']}, model {want}" \
        in cost.compare_table(rows)


def test_memory_at_tensor_greater_than_one():
    """Per-device activation and gathered-weight bytes at tensor > 1, by hand (tiny, B=8, T=32)."""
    tp = cost.cost(CFG, "tp", {"data": 1, "tensor": 4}, B).memory
    # b = 8 (tp keeps the whole batch), t = 4: per layer 8*32*(6*64 + 5*64/4 + 3*192/4 + 4 + 4/4)
    # (the replicated residual stream and matmul inputs, the head-split attention and SwiGLU
    # arrays, the norm statistics, the log-sum-exp of H/t = 1 head)
    per_layer = 8 * 32 * (384 + 80 + 144 + 4 + 1)
    final = 2 * 8 * 32 * 64 + 2 * 8 * 32 * 384 // 4
    # = 156928 and 81920
    assert tp.activations == 4 * (2 * per_layer + final) == 1583104
    assert tp.gathered_weights == 0
    ftp = cost.cost(CFG, "fsdp_tp", {"data": 2, "tensor": 4}, B).memory
    # b = 8/2 = 4: half of tp's per-layer and final terms
    assert ftp.activations == 4 * (2 * 78464 + 40960) == 791552
    # one layer's matrices (q,k,v,o: 4*64*64, w1,w2,w3: 3*64*192 = 53248 elements) beat the
    # embedding (384*64 = 24576); each device gathers only its tensor shard: /4
    assert ftp.gathered_weights == 4 * 53248 // 4 == 53248


def test_bf16_sizes_activations_but_not_the_float32_statistics():
    """dtype_bytes=2 (bf16 compute): activation collectives, FSDP gathers and scatters halve;
    the cross-entropy statistics, the loss, the squared-norm scalar, the norm gains' gradient
    mean and the master params / grads / moments stay float32 (4 bytes)."""
    f32, bf16 = (cost.cost(CFG, "fsdp_tp", {"data": 2, "tensor": 4}, B, dtype_bytes=s) for s in (4, 2))
    stats = [r for r in bf16.collectives if "cross-entropy" in r.what]
    assert sorted((r.count, r.bytes) for r in stats) == [(1, 4 * 32 * 4), (2, 2 * 4 * 32 * 4)]  # [B/d, T] f32
    scalars = [r for r in bf16.collectives if r.phase in ("optimizer", "metrics")]
    assert [(r.count, r.bytes) for r in scalars] == [(1, 4), (1, 4)]
    g = next(r for r in bf16.collectives if "Megatron g" in r.what)
    assert g.bytes == 2 * 2 * (4 * 32 * 64) * 2  # 2 per layer x L=2, [4,32,64] x 2 bytes
    norms = [r for r in bf16.collectives if "norm gains" in r.what]
    # one pmean per leaf: ln1, ln2 ([L, D] stacks) and ln_final [D], 2L+1 f32 vectors in all
    assert sum(r.count for r in norms) == 3 and sum(r.bytes for r in norms) == 5 * 64 * 4
    for op, f32_bytes in (("all-gather", (2 * M - EMB) // 4), ("reduce-scatter", M // 8)):
        assert bf16.summary()[(op, ("data",))]["bytes"] * 2 == f32_bytes == f32.summary()[(op, ("data",))]["bytes"]
    # b = 4, t = 4: 2 layers x 78464 elements x 2 bytes + ln_final in/out and logits (bf16)
    # + exp(z - max) of the f32 loss
    assert bf16.memory.activations == (2 * 78464 + 2 * 4 * 32 * 64 + 4 * 32 * 96) * 2 + 4 * 32 * 96 * 4 == 420352
    assert bf16.memory.gathered_weights * 2 == f32.memory.gathered_weights
    assert (bf16.memory.params, bf16.memory.grads, bf16.memory.optimizer) == (
        f32.memory.params, f32.memory.grads, f32.memory.optimizer) == (M // 8 + NORMS, M // 8 + NORMS, 2 * (M // 8 + NORMS))
    dp = cost.cost(CFG, "dp", {"data": 8}, B, dtype_bytes=2)
    assert dp.summary()[("all-reduce", ("data",))]["bytes"] == 4 * CFG.num_params() + 4  # f32 master grads
