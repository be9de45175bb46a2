"""The mixture-of-experts feed-forward against the float64 reference; the dense model unchanged.

The block (twinshard/model/moe.py) in float32 against tests/reference.py's token-by-token
NumPy float64 `moe_ffn` (routing, top-k, renormalised weights, choice-major capacity, drops,
expert SwiGLU, combine, aux, z, counts), for k = 1 and 2, dropless and dropping; its gradients
against float64 central differences of the reference; the whole tiny_moe model against the
reference LM (also with the first layer dense); capacity per group; the CS336 state dict; remat; config and flag errors; and 20
training steps on one device.
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import reference as ref
from launch import common
from twinshard.config import ModelConfig, preset
from twinshard.model import TransformerLM, load_state_dict, moe, state_dict
from twinshard.train.trainer import SingleDevice, create_params, graphdef

TINY_MOE = preset("tiny_moe")
# the block tests' shapes: B=2 rows of T=16 tokens, groups of S=8 (G=4), D=16, E=4 experts of F=24
B, T, D, E, F, S = 2, 16, 16, 4, 24, 8
RTOL, ATOL = 1e-5, 1e-6  # float32 block vs float64 reference


def capacity(k: int, capacity_factor: float) -> int:
    cfg = ModelConfig(vocab_size=8, context_length=T, d_model=D, num_layers=1, num_heads=1, num_experts=E,
                      experts_per_token=k, capacity_factor=capacity_factor, moe_group_size=S)
    return cfg.expert_capacity


@functools.cache
def block(k: int, cap: int, group: int = S):
    """The jitted float32 block (x, router [D, E], w1, w2, w3 in the model's layout) -> (y, stats)."""
    return jax.jit(functools.partial(moe.moe_ffn, experts_per_token=k, capacity=cap, group_size=group))


def weights(seed: int, rows: int = B):
    """x [rows, T, D] and the torch-layout float64 weights (router [E, D], w1/w3 [E, F, D],
    w2 [E, D, F]) of float32 values, so both sides see the same numbers."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32).astype(np.float64)  # noqa: E731
    return f32(rows, T, D), f32(E, D), f32(E, F, D) / 4, f32(E, D, F) / 5, f32(E, F, D) / 4


def ours(router, w1, w2, w3):
    """The torch layout -> the model's: router [D, E], w1/w3 [E, D, F], w2 [E, F, D] (float32)."""
    return [jnp.asarray(np.swapaxes(w, -1, -2), jnp.float32) for w in (router, w1, w2, w3)]


CASES = [(1, 0.0), (2, 0.0), (1, 0.5), (2, 0.5)]  # (k, capacity_factor): dropless, then C = 1 and 2


@pytest.mark.parametrize("k, capacity_factor", CASES)
def test_block_matches_float64_reference(k, capacity_factor):
    cap = capacity(k, capacity_factor)
    x, *w = weights(seed=k)
    y, stats = block(k, cap)(jnp.asarray(x, jnp.float32), *ours(*w))
    want, want_stats = ref.moe_ffn(x, *w, k=k, capacity=cap, group_size=S)
    y = np.asarray(y)
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)  # measured max |err| 5.4e-7, |y| <= 2.7
    np.testing.assert_allclose(float(stats["aux"]), want_stats["aux"], rtol=RTOL)
    np.testing.assert_allclose(float(stats["z"]), want_stats["z"], rtol=RTOL)
    np.testing.assert_array_equal(stats["tokens_per_expert"], want_stats["tokens_per_expert"])
    assert int(stats["dropped"]) == want_stats["dropped"]
    assert int(np.sum(stats["tokens_per_expert"])) + int(stats["dropped"]) == k * B * T
    if capacity_factor == 0:
        assert cap == S and want_stats["dropped"] == 0
    else:
        assert cap == k and want_stats["dropped"] > 0 and want_stats["lost"].any()
        # a token dropped at every expert it chose: exactly zero output (the residual carries it)
        assert np.all(y[want_stats["lost"]] == 0.0)
        assert np.all(np.any(y[~want_stats["lost"]] != 0.0, axis=-1))


def test_top1_weight_is_one_and_aux_is_one_when_uniform():
    """k = 1: the renormalised weight is 1, so the output is the chosen expert's SwiGLU itself;
    a zero router (uniform probabilities) gives aux = E * sum_i f_i / E = 1 exactly."""
    x, router, w1, w2, w3 = weights(seed=5)
    y, stats = block(1, S)(jnp.asarray(x, jnp.float32), *ours(np.zeros_like(router), w1, w2, w3))
    assert float(stats["aux"]) == pytest.approx(1.0, abs=1e-6)
    assert float(stats["z"]) == pytest.approx(np.log(E) ** 2, rel=1e-6)
    # ties: top_k picks expert 0 for every token, whose 8 slots hold the whole group
    np.testing.assert_array_equal(stats["tokens_per_expert"], [B * T, 0, 0, 0])
    np.testing.assert_allclose(y, ref.swiglu(x, w1[0], w2[0], w3[0]), rtol=RTOL, atol=ATOL)


def objective(y, stats, c):
    """What the gradient test differentiates: <y, c> + 0.3 aux + 0.2 z."""
    return (y * c).sum() + 0.3 * stats["aux"] + 0.2 * stats["z"]


def test_gradients_match_float64_central_differences():
    """Through the combine weights (router), the kept experts' SwiGLUs (w1, w2, w3, x), aux and z,
    with drops (k = 2, C = 2). 6 entries of each input against (f(+h) - f(-h)) / 2h in float64."""
    k, cap = 2, capacity(2, 0.5)
    x, *w = weights(seed=7)
    c = np.random.default_rng(8).normal(size=x.shape).astype(np.float32).astype(np.float64)

    def ours_loss(x32, router, w1, w2, w3):
        return objective(*moe.moe_ffn(x32, router, w1, w2, w3, experts_per_token=k, capacity=cap,
                                      group_size=S), jnp.asarray(c, jnp.float32))

    grads = jax.jit(jax.grad(ours_loss, argnums=(0, 1, 2, 3, 4)))(jnp.asarray(x, jnp.float32), *ours(*w))
    # back to the torch layout of the reference's arguments
    grads = [np.asarray(grads[0])] + [np.swapaxes(np.asarray(g), -1, -2) for g in grads[1:]]
    inputs = [x, *w]
    rng = np.random.default_rng(9)
    h, worst = 1e-6, 0.0
    for i, (arg, grad) in enumerate(zip(inputs, grads)):
        assert np.all(np.isfinite(grad)) and np.any(grad != 0)
        for flat in rng.choice(arg.size, 6, replace=False):
            idx = np.unravel_index(flat, arg.shape)
            values = []
            for step in (h, -h):
                moved = [a.copy() for a in inputs]
                moved[i][idx] += step
                y, stats = ref.moe_ffn(*moved, k=k, capacity=cap, group_size=S)
                values.append(objective(y, stats, c))
            fd = (values[0] - values[1]) / (2 * h)
            worst = max(worst, abs(grad[idx] - fd) / max(1.0, abs(fd)))
    assert worst < 1e-5, worst  # measured 5.0e-7


def test_capacity_is_per_group_batch_or_row_by_row():
    """A group is S tokens of one sequence: the full batch and each row alone (a data shard's
    share) route, drop and output the same, token for token."""
    k, cap = 2, capacity(2, 0.5)
    x, *w = weights(seed=11, rows=4)
    params = ours(*w)
    run = block(k, cap)
    y, stats = run(jnp.asarray(x, jnp.float32), *params)
    rows = [run(jnp.asarray(x[b:b + 1], jnp.float32), *params) for b in range(4)]
    np.testing.assert_allclose(y, np.concatenate([r[0] for r in rows]), rtol=1e-6, atol=1e-7)
    assert np.array_equal(np.asarray(y) == 0, np.concatenate([np.asarray(r[0]) == 0 for r in rows]))
    assert int(stats["dropped"]) == sum(int(r[1]["dropped"]) for r in rows) > 0
    np.testing.assert_array_equal(stats["tokens_per_expert"], sum(np.asarray(r[1]["tokens_per_expert"]) for r in rows))
    # aux and z are means over equal-sized groups: the batch's is the rows' mean
    for name in ("aux", "z"):
        assert float(stats[name]) == pytest.approx(np.mean([float(r[1][name]) for r in rows]), rel=1e-6)
    # a whole-sequence group (S = T) has other capacity boundaries: other drops
    _, whole = block(k, capacity(2, 0.5) * 2, T)(jnp.asarray(x, jnp.float32), *params)
    assert int(whole["dropped"]) != int(stats["dropped"])


# ---------------------------------------------------------------------------------------------
# The model: tiny_moe with drops (capacity_factor 0.5: C = 8 of S = 32) and a z-loss term.
# ---------------------------------------------------------------------------------------------

MODEL_CFG = dataclasses.replace(TINY_MOE.model, capacity_factor=0.5, router_z_loss=1e-3)


@functools.cache
def params():
    return create_params(MODEL_CFG, 0)


@pytest.fixture(scope="module")
def model():
    return nnx.merge(graphdef(MODEL_CFG), params())


# layers.0 keeps the dense SwiGLU (ModelConfig.first_dense_layers), layers.1 and layers.2 are MoE
FIRST_DENSE_CFG = dataclasses.replace(MODEL_CFG, num_layers=3, first_dense_layers=1)


@pytest.mark.parametrize("cfg", [MODEL_CFG, FIRST_DENSE_CFG], ids=["every_layer", "first_dense"])
def test_model_matches_float64_reference(cfg, model):
    model = model if cfg == MODEL_CFG else nnx.merge(graphdef(cfg), create_params(cfg, 0))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, cfg.context_length + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss, stats = jax.jit(lambda t, u: model.loss_and_stats(t, u))(jnp.asarray(x), jnp.asarray(y))
    sd64 = {k: v.astype(np.float64) for k, v in state_dict(model).items()}
    layer_stats = []

    def ffn(i, h):
        p = lambda n: sd64[f"layers.{i}.ffn.{n}.weight"]  # noqa: E731
        if i < cfg.first_dense_layers:
            return ref.swiglu(h, p("w1"), p("w2"), p("w3"))
        out, st = ref.moe_ffn(h, p("router"), p("experts.w1"), p("experts.w2"), p("experts.w3"),
                              k=cfg.experts_per_token, capacity=cfg.expert_capacity, group_size=cfg.moe_group)
        layer_stats.append(st)
        return out

    logits = ref.transformer_lm(sd64, x, cfg.num_layers, cfg.num_heads, cfg.rope_theta, ffn=ffn)
    assert len(layer_stats) == cfg.moe_layers == len(stats["aux"])
    ce = ref.cross_entropy(logits, y)
    np.testing.assert_allclose(float(stats["ce"]), ce, rtol=1e-5)
    for name in ("aux", "z"):
        np.testing.assert_allclose(stats[name], [s[name] for s in layer_stats], rtol=1e-4)
    np.testing.assert_array_equal(stats["tokens_per_expert"], [s["tokens_per_expert"] for s in layer_stats])
    np.testing.assert_array_equal(stats["dropped"], [s["dropped"] for s in layer_stats])
    assert min(s["dropped"] for s in layer_stats) > 0 and int(stats["assignments"]) == 2 * x.size
    want = ce + cfg.router_aux_loss * np.mean([s["aux"] for s in layer_stats]) \
        + cfg.router_z_loss * np.mean([s["z"] for s in layer_stats])
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(model.loss(jnp.asarray(x), jnp.asarray(y))), float(loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(x)))[..., :cfg.vocab_size], logits,
                               rtol=2e-4, atol=2e-4)


def test_state_dict_names_layout_and_round_trip(model):
    sd = state_dict(model)
    cfg = MODEL_CFG
    f = cfg.expert_ff
    assert sd["layers.1.ffn.router.weight"].shape == (E, cfg.d_model)
    assert sd["layers.1.ffn.experts.w1.weight"].shape == sd["layers.1.ffn.experts.w3.weight"].shape == (E, f, 64)
    assert sd["layers.1.ffn.experts.w2.weight"].shape == (E, 64, f)
    assert not any(n.startswith("layers.0.ffn.w") for n in sd)
    w1 = np.asarray(model.layers.ffn.w1.weight[...])  # [L, E, D, F]
    np.testing.assert_array_equal(sd["layers.1.ffn.experts.w1.weight"][2], w1[1, 2].T)
    np.testing.assert_array_equal(sd["layers.0.ffn.router.weight"], np.asarray(model.layers.ffn.router.weight[0]).T)
    other = nnx.merge(graphdef(cfg), jax.tree.map(jnp.zeros_like, params()))
    load_state_dict(other, sd)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(other, nnx.Param))):
        np.testing.assert_array_equal(a, b)


@functools.cache
def model_value_and_grad(remat: str):
    """(loss, gradients) of the MODEL_CFG model (seed 0) under `remat`, on one fixed batch."""
    cfg = dataclasses.replace(MODEL_CFG, remat=remat)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 257, (2, 33)))
    loss = lambda p: nnx.merge(graphdef(cfg), p).loss(tokens[:, :-1], tokens[:, 1:])  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params())


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_loss_and_gradients(remat):
    """The checkpointed body returns (x, stats): the same loss and gradients as without remat."""
    (l0, g0), (l1, g1) = model_value_and_grad("none"), model_value_and_grad(remat)
    assert np.isfinite(float(l0)) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(g0))
    assert float(l1) == pytest.approx(float(l0), rel=1e-6)
    assert ref.max_diff(g0, g1) < 1e-6


# ---------------------------------------------------------------------------------------------
# Parameters: the dense tree unchanged, the MoE tree, num_params
# ---------------------------------------------------------------------------------------------

DENSE_TREE = {  # preset("tiny").model's params before the mixture of experts existed
    "lm_head.weight": (64, 384), "ln_final.weight": (64,), "token_embeddings.weight": (384, 64),
    "layers.attn.k_proj.weight": (2, 64, 64), "layers.attn.output_proj.weight": (2, 64, 64),
    "layers.attn.q_proj.weight": (2, 64, 64), "layers.attn.v_proj.weight": (2, 64, 64),
    "layers.ffn.w1.weight": (2, 64, 192), "layers.ffn.w2.weight": (2, 192, 64), "layers.ffn.w3.weight": (2, 64, 192),
    "layers.ln1.weight": (2, 64), "layers.ln2.weight": (2, 64),
}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
    return {".".join(map(str, path)): tuple(v.shape) for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def test_dense_tree_unchanged_and_num_params():
    assert param_shapes(preset("tiny").model) == DENSE_TREE
    moe_cfg = dataclasses.replace(TINY_MOE.model, num_experts=3, experts_per_token=1, expert_d_ff=96)
    shapes = param_shapes(moe_cfg)
    assert {k: v for k, v in shapes.items() if ".ffn." not in k} == \
        {k: v for k, v in DENSE_TREE.items() if ".ffn." not in k}
    assert {k: v for k, v in shapes.items() if ".ffn." in k} == {
        "layers.ffn.router.weight": (2, 64, 3), "layers.ffn.w1.weight": (2, 3, 64, 96),
        "layers.ffn.w2.weight": (2, 3, 96, 64), "layers.ffn.w3.weight": (2, 3, 64, 96)}
    for cfg in (preset("tiny").model, TINY_MOE.model, moe_cfg, preset("mixtral_8x7b").model, FIRST_DENSE_CFG):
        assert sum(np.prod(s) for s in param_shapes(cfg).values()) == cfg.num_params()


def test_first_dense_layers_are_a_dense_stack_before_the_moe_stack():
    """first_dense_layers=1 of 3: `dense_layers` holds layer 0 [1, ...] as the dense tree does, `layers`
    the two MoE layers [2, ...]; the state dict numbers them in running order, and loads back."""
    shapes = param_shapes(FIRST_DENSE_CFG)
    f, fe = FIRST_DENSE_CFG.d_ff, FIRST_DENSE_CFG.expert_ff
    assert shapes["dense_layers.ffn.w1.weight"] == (1, 64, f) and shapes["dense_layers.ln1.weight"] == (1, 64)
    assert shapes["layers.ffn.w1.weight"] == (2, E, 64, fe) and shapes["layers.attn.q_proj.weight"] == (2, 64, 64)
    model = nnx.merge(graphdef(FIRST_DENSE_CFG), create_params(FIRST_DENSE_CFG, 0))
    sd = state_dict(model)
    assert sd["layers.0.ffn.w1.weight"].shape == (f, 64) and "layers.0.ffn.router.weight" not in sd
    assert sd["layers.2.ffn.experts.w1.weight"].shape == (E, fe, 64) and "layers.3.ln1.weight" not in sd
    np.testing.assert_array_equal(sd["layers.2.attn.q_proj.weight"], np.asarray(model.layers.attn.q_proj.weight[1]).T)
    np.testing.assert_array_equal(sd["layers.0.ln2.weight"], np.asarray(model.dense_layers.ln2.weight[0]))
    other = nnx.merge(graphdef(FIRST_DENSE_CFG), jax.tree.map(jnp.zeros_like, create_params(FIRST_DENSE_CFG, 0)))
    load_state_dict(other, sd)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(other, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    assert preset("mixtral_8x7b").model.num_params() / 1e9 == pytest.approx(46.7, abs=0.05)  # Mistral's count


def test_init_scales(model):
    """Each expert's weights as a Linear's (std sqrt(2 / (in + out)), cut at 3 std), the router
    as Linear(D, E)'s; every expert and layer its own draw."""
    ffn = model.layers.ffn
    d, f = MODEL_CFG.d_model, MODEL_CFG.expert_ff
    for w, std, tol in ((ffn.w1, np.sqrt(2 / (d + f)), 0.02), (ffn.w2, np.sqrt(2 / (d + f)), 0.02),
                        (ffn.router, np.sqrt(2 / (d + E)), 0.06)):  # router: 512 samples
        w = np.asarray(w.weight[...])
        assert np.abs(w).max() <= 3 * std + 1e-6
        assert w.std() / std == pytest.approx(0.9866, abs=tol)  # std of N(0, 1) cut at +-3
    w1 = np.asarray(ffn.w1.weight[...])  # [L, E, D, F]
    assert not np.array_equal(w1[0, 0], w1[0, 1]) and not np.array_equal(w1[0, 0], w1[1, 0])


def test_expert_capacity():
    m = TINY_MOE.model
    assert m.expert_capacity == 20 and m.moe_group == 32  # ceil(2 * 32 * 1.25 / 4)
    assert dataclasses.replace(m, capacity_factor=0).expert_capacity == 32
    assert dataclasses.replace(m, capacity_factor=100).expert_capacity == 32  # at most S
    assert dataclasses.replace(m, moe_group_size=8, capacity_factor=1.0).expert_capacity == 4
    assert dataclasses.replace(m, num_experts=5, experts_per_token=1, capacity_factor=1.1,
                               moe_group_size=0).expert_capacity == 8  # ceil(7.04)
    assert preset("mixtral_8x7b").model.expert_capacity == 1280 and preset("tiny").model.expert_capacity == 0


# ---------------------------------------------------------------------------------------------
# Bad values: ModelConfig's ValueError names the field, the value and the fix; the flags' too.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("over, needles", [
    ({"num_experts": 1}, ["ModelConfig.num_experts=1", "0 for the dense", "at least 2"]),
    ({"num_experts": -4}, ["ModelConfig.num_experts=-4", "at least 2"]),
    ({"experts_per_token": 0}, ["ModelConfig.experts_per_token=0", "[1, num_experts=4]", "from 1 to 4"]),
    ({"experts_per_token": 5}, ["ModelConfig.experts_per_token=5", "from 1 to 4"]),
    ({"capacity_factor": -0.5}, ["ModelConfig.capacity_factor=-0.5", ">= 0", "0: dropless"]),
    ({"moe_group_size": 12}, ["ModelConfig.moe_group_size=12", "context_length=32", "[1, 2, 4, 8, 16, 32]"]),
    ({"moe_group_size": -1}, ["ModelConfig.moe_group_size=-1", ">= 0"]),
    ({"router_aux_loss": -0.01}, ["ModelConfig.router_aux_loss=-0.01", ">= 0"]),
    ({"router_z_loss": -1e-3}, ["ModelConfig.router_z_loss=-0.001", ">= 0"]),
    ({"expert_d_ff": -1}, ["ModelConfig.expert_d_ff=-1", ">= 0", "0: d_ff"]),
    ({"num_experts": 2.0}, ["ModelConfig.num_experts=2.0", "expected an int"]),
    ({"first_dense_layers": 2}, ["ModelConfig.first_dense_layers=2", "[0, num_layers=2)", "choose 0 to 1"]),
    ({"first_dense_layers": -1}, ["ModelConfig.first_dense_layers=-1", "choose 0 to 1"]),
    ({"num_experts": 0, "first_dense_layers": 1}, ["ModelConfig.first_dense_layers=1", "num_experts=0",
                                                   "--num_experts=4", "--first_dense_layers=0"]),
])
def test_bad_moe_config(over, needles):
    with pytest.raises(ValueError) as e:
        dataclasses.replace(TINY_MOE.model, **over)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_dense_ignores_k_but_not_a_bad_group():
    assert preset("tiny").model.experts_per_token == 2 and preset("tiny").model.num_experts == 0
    dataclasses.replace(preset("tiny").model, experts_per_token=9)  # unused without experts
    with pytest.raises(ValueError, match="moe_group_size=5 does not divide"):
        dataclasses.replace(preset("tiny").model, moe_group_size=5)


def flag_values(**given):
    names = ("dtype", "attention", "scan_unroll", "remat", "collective_matmul", *common.SHAPE_FLAGS, *common.MOE_FLAGS)
    return types.SimpleNamespace(**{n: given.get(n) for n in names})


def test_flags_override_the_preset_and_bad_values_fail_before_any_work():
    cfg = common.with_model_flags(preset("tiny"), flag_values(num_experts=8, experts_per_token=1,
                                                              capacity_factor=2.0, moe_group_size=16))
    m = cfg.model
    assert (m.num_experts, m.experts_per_token, m.capacity_factor, m.moe_group_size) == (8, 1, 2.0, 16)
    assert common.with_model_flags(TINY_MOE, flag_values()) is TINY_MOE
    with pytest.raises(ValueError, match=r"^--num_experts=4 --experts_per_token=7: ModelConfig.experts_per_token=7"):
        common.with_model_flags(preset("tiny"), flag_values(num_experts=4, experts_per_token=7))
    with pytest.raises(ValueError, match=r"^--capacity_factor=-1.0: ModelConfig.capacity_factor=-1.0 must be >= 0"):
        common.with_model_flags(TINY_MOE, flag_values(capacity_factor=-1.0))
    m = common.with_model_flags(TINY_MOE, flag_values(num_layers=3, first_dense_layers=1)).model
    assert (m.num_layers, m.first_dense_layers, m.moe_layers) == (3, 1, 2)
    with pytest.raises(ValueError, match=r"^--first_dense_layers=2: ModelConfig.first_dense_layers=2 \(--first_dense_layers\) must be in \[0, "):
        common.with_model_flags(TINY_MOE, flag_values(first_dense_layers=2))


# ---------------------------------------------------------------------------------------------
# Training on one device
# ---------------------------------------------------------------------------------------------

def test_tiny_moe_trains_on_one_device():
    """20 AdamW steps of tiny_moe on tokens drawn from 16 of the 257 ids (a unigram to learn:
    ln 16 = 2.77 nats at best, ln 257 = 5.55 at chance): the loss falls and the load-balancing loss
    keeps the routing balanced. On these 16 tokens the router learns to favour some experts: with
    the preset's router_aux_loss 0.01, aux rose from 1.19 to 1.25 and 1.56 (layers 0, 1) in the 20
    steps; at 0.1, used here, it fell to about 1.05 (measured)."""
    cfg = dataclasses.replace(TINY_MOE.model, router_aux_loss=0.1)
    runner = SingleDevice(cfg, TINY_MOE.train)
    rng = np.random.default_rng(0)
    state = runner.init_state(TINY_MOE.train.seed)
    losses = []
    for _ in range(TINY_MOE.train.steps):
        b = rng.integers(0, 16, (TINY_MOE.train.batch_size, cfg.context_length + 1)).astype(np.int32)
        state, metrics = runner.train_step(state, *runner.place_batch(b[:, :-1], b[:, 1:]))
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"]))
    assert losses[-1] < losses[0] - 1.5, losses  # measured 5.94 -> 3.22
    model = nnx.merge(graphdef(cfg), state.params)
    _, stats = jax.jit(model.loss_and_stats)(jnp.asarray(b[:, :-1]), jnp.asarray(b[:, 1:]))
    aux = np.asarray(stats["aux"])
    assert np.all(np.isfinite(aux)) and np.all(np.abs(aux - 1) < 0.15), aux
    assert int(stats["assignments"]) == 2 * b[:, :-1].size
    kept = np.asarray(stats["tokens_per_expert"]).sum(-1)  # [L]
    np.testing.assert_array_equal(kept + np.asarray(stats["dropped"]), [int(stats["assignments"])] * cfg.num_layers)
