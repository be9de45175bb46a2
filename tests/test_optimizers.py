"""--optimizer=adafactor|lion|sgd (twinshard/train/optim.py) in both twins.

- Adafactor written out with injectable block means equals optax.adafactor on one device.
- SGD and Lion follow their formulas (NumPy), as make_optimizer configures them.
- Both twins train like single device with Adafactor and Lion (on fsdp_tp, whose state is
  split over both axes; the other strategies' placement is checked abstractly, see CASES);
  the placed optimizer state carries the shardings derived from each param's logical
  axes and the dims each leaf keeps.
- state_specs matches the abstract state for every strategy, also where Adafactor
  factors the layer axis; cost.memory's optimizer bytes equal the real per-device bytes.

The models: the tiny preset with num_heads 8 (tp on 8 devices); for Adafactor,
d_model 128 (d_ff stays 192), so that block weights [L, 128, 192], the embedding
[384, 128] and lm_head are factored (optax factors two dims >= 128), and the
norms [L, 128] keep a full v.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import auto_parallel
import manual_parallel
import reference
from twinshard import cost
from twinshard import placed
from twinshard.parallel import mesh as mesh_lib, placement
from twinshard.train import optim, trainer
from twinshard.config import Config, preset

BASE = preset("tiny")
# grad_clip below the gradient norm (every step clipped, so the twins' global norms matter);
# warmup 0: every step moves the params (a warmup step 0 has lr 0).
TRAIN = dataclasses.replace(BASE.train, grad_clip=0.25, warmup_steps=0)
MODELS = {"adafactor": dataclasses.replace(BASE.model, num_heads=8, d_model=128),
          "lion": dataclasses.replace(BASE.model, num_heads=8),
          "sgd": dataclasses.replace(BASE.model, num_heads=8)}
MESHES = {"dp": "data:8,tensor:1", "fsdp": "data:8,tensor:1", "tp": "data:1,tensor:8",
          "fsdp_tp": "data:2,tensor:4"}
SIZES = {k: dict(mesh_lib.parse_mesh(v)) for k, v in MESHES.items()}
TWINS = {"manual": manual_parallel, "auto": auto_parallel}
STEPS = 3
# Params after 3 steps, max |twin - single| over strategies and twins, measured (XLA:CPU):
# adafactor 2.4e-7 (its means summed in another order; the update is ~lr x RMS(param));
# sgd 1.5e-8; lion 0.0 (every update is lr * sign(.) - exact wherever the signs agree,
# and they did: a flipped sign would cost 2 lr = 6e-3). AdamW needs 2e-5 (docs/design.md: its
# eps amplifies rounding where |g| ~ eps); these optimizers have no such amplifier: ~10x.
PARAM_ATOL = {"adafactor": 2e-6, "lion": 1e-6}


def config(optimizer: str, model=None) -> Config:
    return Config(model or MODELS[optimizer], dataclasses.replace(TRAIN, optimizer=optimizer))


def batches(cfg: Config):
    return reference.random_batches(cfg.train.batch_size, cfg.model.context_length, cfg.model.vocab_size,
                                    STEPS)


def train(runner, cfg: Config, state):
    for x, y in batches(cfg):
        state, _ = runner.train_step(state, *runner.place_batch(x, y))
    return state


@functools.cache
def single(optimizer: str):
    """One device's initial state (on the host) and its params after STEPS steps."""
    cfg = config(optimizer)
    runner = trainer.SingleDevice(cfg.model, cfg.train)
    state = runner.init_state(cfg.train.seed)
    start = jax.device_get(state)
    return start, jax.device_get(train(runner, cfg, state).params)


@functools.cache
def twin(optimizer: str, strategy: str, kind: str):
    """The twin trained from one device's initial state, placed from the host on its state shardings
    (compiles nothing; its own init would be one compile more, and is not what this module claims)."""
    cfg = config(optimizer)
    runner = TWINS[kind].make_runner(strategy, MESHES[strategy], cfg)
    start, _ = single(optimizer)
    return runner, train(runner, cfg, jax.device_put(start, runner.state_shardings))


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def trimmed(spec) -> tuple:
    """P('data', None) -> ('data',): specs equal up to trailing Nones place alike."""
    entries = tuple(spec)
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return entries


def named_leaves(tree) -> dict[str, object]:
    """'.inner[0].v_row['lm_head']['weight']' -> leaf (a PartitionSpec is a leaf here)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0]
    return {jax.tree_util.keystr(p): x for p, x in flat}


# --- Adafactor, SGD and Lion on one device -------------------------------------------------


def test_adafactor_is_optax_adafactor():
    """make_optimizer's Adafactor (its own code, full_mean) vs optax.adafactor with the same
    schedule and weight decay: same state structure, params and statistics after 3 updates.
    The shapes cover a factored layer axis ([130, 8, 128]: dims 0 and 2), a tie ([128, 128]),
    the embedding layout, a [L, D, F] block, a param too small to factor and a vector. The
    gradients grow 10x per step, so the block-RMS update clipping is active. Measured: bitwise."""
    shapes = {"stack": (130, 8, 128), "square": (128, 128), "emb": (384, 128), "block": (2, 128, 384),
              "small": (4, 200), "vec": (128,)}
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=s) * 0.02, jnp.float32) for k, s in shapes.items()}
    cfg = dataclasses.replace(TRAIN, optimizer="adafactor", grad_clip=0.0, warmup_steps=1)
    schedule = optim.lr_schedule(cfg)
    ours = optim.make_optimizer(cfg)
    theirs = optax.adafactor(schedule, weight_decay_rate=lambda t: cfg.weight_decay * schedule(t))
    ours_state, theirs_state = ours.init(params), theirs.init(params)
    assert jax.tree.structure(ours_state.inner) == jax.tree.structure(theirs_state)
    ours_p = theirs_p = params
    for step in range(3):
        grads = {k: jnp.asarray(rng.normal(size=s) * 10.0 ** (step - 1), jnp.float32) for k, s in shapes.items()}
        u, ours_state = jax.jit(ours.update)(grads, ours_state, ours_p)
        v, theirs_state = jax.jit(theirs.update)(grads, theirs_state, theirs_p)
        ours_p, theirs_p = optax.apply_updates(ours_p, u), optax.apply_updates(theirs_p, v)
    assert max_diff(ours_p, params) > 1e-4  # it trained
    for a, b in zip(jax.tree.leaves((ours_p, ours_state.inner)), jax.tree.leaves((theirs_p, theirs_state)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)


def _numpy_updates(optimizer: str, cfg, p, grads):
    """SGD (heavy ball, decoupled decay) and Lion from their formulas, float64."""
    m = np.zeros_like(p)
    for t, g in enumerate(grads):
        lr = float(optim.lr_schedule(cfg)(t))
        if optimizer == "sgd":
            m = g + cfg.beta1 * m
            p = p - lr * (m + cfg.weight_decay * p)
        else:
            p = p - lr * (np.sign(cfg.beta1 * m + (1 - cfg.beta1) * g) + cfg.weight_decay * p)
            m = cfg.beta2 * m + (1 - cfg.beta2) * g
    return p


@pytest.mark.parametrize("optimizer", ["sgd", "lion"])
def test_sgd_and_lion_follow_their_formulas(optimizer):
    cfg = dataclasses.replace(TRAIN, optimizer=optimizer, grad_clip=0.0, beta1=0.8, beta2=0.9,
                              weight_decay=0.5)
    rng = np.random.default_rng(1)
    p0 = rng.normal(size=(16, 8)).astype(np.float32)
    grads = [rng.normal(size=(16, 8)).astype(np.float32) for _ in range(3)]
    tx = optim.make_optimizer(cfg)
    p, state = jnp.asarray(p0), tx.init(jnp.asarray(p0))
    for g in grads:
        u, state = tx.update(jnp.asarray(g), state, p)
        p = optax.apply_updates(p, u)
    want = _numpy_updates(optimizer, cfg, p0.astype(np.float64), [g.astype(np.float64) for g in grads])
    np.testing.assert_allclose(np.asarray(p), want, rtol=0, atol=1e-6)


# --- state_specs against the abstract state; memory ----------------------------------------

# Deep enough that the layer axis is the largest dim: W1 [256, 128, 192] factors (F, L), so
# v_row (without L) keeps (embed, mlp) - split over data AND tensor in fsdp_tp - and v_col
# (without F) keeps (layers, embed). Abstract only (nothing is allocated or compiled).
DEEP = dataclasses.replace(MODELS["adafactor"], num_layers=256)
DEEP_W1 = {"v_row": ("embed", "mlp"), "v_col": ("layers", "embed")}


@functools.cache
def abstract_state(optimizer: str, model):
    cfg = config(optimizer, model)
    tx = optim.make_optimizer(cfg.train)
    return cfg, tx, trainer.abstract_state(cfg.model, tx).opt_state


def per_device_bytes(abstract, specs, sizes) -> dict[str, int]:
    """Real bytes per device of each leaf of size > 1 (O(1) counters and placeholders aside)."""
    mesh = mesh_lib.make_mesh(sizes)
    out = {}
    for (path, a), s in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                            jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)), strict=True):
        if a.size > 1:
            shard = NamedSharding(mesh, s).shard_shape(a.shape)  # raises if a dim does not divide
            out[jax.tree_util.keystr(path)] = int(np.prod(shard)) * a.dtype.itemsize
    return out


@pytest.mark.parametrize("strategy", MESHES)
def test_state_specs_fit_the_abstract_state_and_memory_counts_its_bytes(strategy):
    rules = cost.RULES[strategy]
    for model, optimizer in [(MODELS["adafactor"], o) for o in ("adamw", "adafactor", "lion", "sgd")] + \
            [(DEEP, "adafactor")]:
        cfg, tx, abstract = abstract_state(optimizer, model)
        specs = placed.state_specs(cfg, tx, rules).opt_state
        for (path, a), s in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                                jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)), strict=True):
            assert len(s) <= a.ndim, (jax.tree_util.keystr(path), a.shape, s)
        real = per_device_bytes(abstract, specs, SIZES[strategy])
        model_bytes = cost.memory(model, strategy, SIZES[strategy], 8, 32, optimizer=optimizer).optimizer
        assert model_bytes == sum(real.values()), (optimizer, model.num_layers)
        if optimizer == "adafactor" and model is DEEP:
            named = {k: trimmed(x) for k, x in named_leaves(specs).items()}
            for field, axes in DEEP_W1.items():
                assert named[f".inner[0].{field}['layers']['ffn']['w1']['weight']"] == \
                    trimmed(P(*(rules.get(a) for a in axes)))


def test_memory_by_optimizer():
    """adamw 2x params, lion and sgd 1x, adafactor far less; an unknown name is refused."""
    m = MODELS["adafactor"]
    mem = {o: cost.memory(m, "fsdp", SIZES["fsdp"], 8, 32, optimizer=o) for o in ("adamw", "lion", "sgd",
                                                                                  "adafactor")}
    params = mem["adamw"].params
    assert (mem["adamw"].optimizer, mem["lion"].optimizer, mem["sgd"].optimizer) == (2 * params, params, params)
    assert mem["adafactor"].optimizer < params / 10  # 8% here: 4 norms [L, 128] keep a full v
    with pytest.raises(ValueError, match="optimizer='adam'.*adamw, lion, sgd, adafactor"):
        cost.memory(m, "fsdp", SIZES["fsdp"], 8, 32, optimizer="adam")


def test_a_state_leaf_that_does_not_split_is_refused():
    """The derived placement is checked against the mesh before anything compiles: v_col [L, F]
    of a model whose d_ff (196) does not split over tensor=8 (the runner's mesh check would
    refuse the params first; the state check is the net for a statistic placed on its own)."""
    abstract = {"v_col": jax.ShapeDtypeStruct((2, 196), jnp.float32)}
    placement.check_state_divisible({"v_col": P(None, "tensor")}, abstract, {"data": 1, "tensor": 4})
    with pytest.raises(ValueError, match=r"\[.v_col.\] \(2, 196\) placed .*dim 196 does not split over 8"):
        placement.check_state_divisible({"v_col": P(None, "tensor")}, abstract, {"data": 1, "tensor": 8})


# --- both twins vs single device, and the placed state ------------------------------------

# Adafactor's statistics of four params, by hand from optax's rule (the two largest dims are
# factored; v_row drops the largest, v_col the second largest): logical axes of what each keeps.
# W1 [L, 128, 192] (layers, embed, mlp); embedding [384, 128] (vocab, embed); ln1 [L, 128].
ADAFACTOR_AXES = {
    "['layers']['ffn']['w1']['weight']": {"v_row": ("layers", "embed"), "v_col": ("layers", "mlp"), "v": None},
    "['token_embeddings']['weight']": {"v_row": ("embed",), "v_col": ("vocab",), "v": None},
    "['lm_head']['weight']": {"v_row": ("embed",), "v_col": ("vocab",), "v": None},
    "['layers']['ln1']['weight']": {"v_row": None, "v_col": None, "v": ("layers", "norm")},
}


def expected_adafactor_specs(strategy: str) -> dict[str, tuple]:
    """'.inner[0].v_row[...]' -> the expected trimmed spec (None: a (1,) placeholder, replicated)."""
    rules = cost.RULES[strategy]
    return {f".inner[0].{field}{param}": () if axes is None else trimmed(P(*(rules.get(a) for a in axes)))
            for param, fields in ADAFACTOR_AXES.items() for field, axes in fields.items()}


# Adafactor where its manual twin's block means need a pmean: fsdp_tp (each matrix split over
# data and tensor: row, column and whole-param means over different axes), both twins. dp, fsdp
# and tp pass too (2.4e-7) but pmean over fewer axes than fsdp_tp (tp: the tensor axis alone,
# which fsdp_tp splits the same dims over), so they are left out for suite time (6 cold
# compiles, ~63 s of CPU; fsdp_tp catches the adafactor-row-mean-local,
# -block-mean-first-dim-axes, -stats-swapped and -stat-on-wrong-axis mutants);
# their state placement is still checked abstractly by test_state_specs_*. Lion and SGD are
# elementwise, with one moment placed like its param (nothing strategy-specific but that
# placement): Lion's twins on fsdp_tp, whose state is split over both axes. SGD's twins (its
# momentum `trace` is the same case as Lion's `mu`) are left out for suite time (5 cold programs,
# ~22 s); SGD's update is checked against its formula above, its state specs abstractly.
CASES = ([("adafactor", "fsdp_tp", k) for k in TWINS]
         + [("lion", "fsdp_tp", k) for k in TWINS])


@pytest.mark.parametrize("optimizer,strategy,kind", CASES)
def test_twin_matches_single_device_and_places_the_state(optimizer, strategy, kind):
    runner, state = twin(optimizer, strategy, kind)
    assert max_diff(jax.device_get(state.params), single(optimizer)[1]) <= PARAM_ATOL[optimizer]
    placed = {k: trimmed(x.sharding.spec) for k, x in named_leaves(state.opt_state).items()}
    derived = {k: trimmed(s) for k, s in named_leaves(runner.state_specs.opt_state).items()}
    assert placed == derived  # every leaf is where state_specs put it, after 3 steps
    if optimizer == "adafactor":
        expected = expected_adafactor_specs(strategy)
        assert {k: placed[k] for k in expected} == expected
    else:  # Lion's mu, SGD's trace: each like its param
        moments = [x for x in named_leaves(state.opt_state).values() if x.ndim > 0]
        params = jax.tree.leaves(state.params)
        assert [trimmed(m.sharding.spec) for m in moments] == [trimmed(p.sharding.spec) for p in params]
