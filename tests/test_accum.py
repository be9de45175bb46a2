"""Gradient accumulation (TrainConfig.grad_accum = K): the same step as the full batch,
with every gradient sync once per step.

- single device: K = 2 and 4 give the full-batch loss and gradients (K = 1 is a plain
  `jax.value_and_grad`); the loss also matches the NumPy float64 model; micro-batches
  weigh by their tokens (a masked toy loss with unequal micro-batches, against NumPy).
- fsdp and fsdp_tp x both twins at K = 2: losses, gradient norms and params after 2 AdamW
  steps equal single-device K = 1 training (fsdp_tp: the FSDP gather-once path and the
  per-micro-batch TP path of both twins). Their step-1 gradients, which a test compared with
  two more compiles, are held by these: a wrong one changes the params after the steps or,
  scaled per leaf (AdamW is scale-free), the global norm (tests/reference.py train_record).
- manual twin (fsdp, tp, fsdp_tp): the compiled step's ledger equals the cost model with
  grad_accum = 2 (tp: its gradient program's, every row but the optimizer's), and no data-axis
  collective sits inside a loop.
- auto twin (auto_parallel/runner.py's per-data-shard vmap): the data-axis collectives do
  not grow with K (K = 2 and 4), the tensor all-reduces grow as 19 K + 9.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import auto_parallel
import manual_parallel
import reference
from runners import assert_ledger_without_optimizer, scans
from twinshard import cost, hlo
from twinshard.parallel import resolve
from twinshard.config import Config, preset
from twinshard.model import state_dict
from twinshard.train.trainer import (SingleDevice, accumulated_value_and_grad, graphdef, loss_fn, unrolled_stacks,
                                     zero_gradient)

BASE = preset("tiny")
# batch 16: 2 sequences per device on data=8, so K = 2 splits every device's rows
CFG = Config(dataclasses.replace(BASE.model, num_heads=8), dataclasses.replace(BASE.train, batch_size=16))
K = 2
MESHES = {"dp": "data:8,tensor:1", "fsdp": "data:8,tensor:1", "tp": "data:1,tensor:8",
          "fsdp_tp": "data:2,tensor:4"}
STEPS = 2
L = CFG.model.num_layers
# tolerances: as tests/test_data_tensor.py (losses are means of 512 f32 token losses, summed here
# in micro-batches: measured max 3.3e-6; gradients 1.2e-8; params after AdamW steps ~1e-7)
LOSS_ATOL, GRAD_ATOL, PARAM_ATOL, NORM_RTOL = 2e-5, 2e-7, 2e-5, 1e-6


def accum(k: int) -> Config:
    return Config(CFG.model, dataclasses.replace(CFG.train, grad_accum=k))


def batches():
    return reference.random_batches(CFG.train.batch_size, CFG.model.context_length, CFG.model.vocab_size, STEPS)


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@functools.cache
def single():
    """Single-device K = 1: the initial state, step-1 loss/gradients, STEPS losses, norms, params."""
    r = SingleDevice(CFG.model, CFG.train)
    state = r.init_state(CFG.train.seed)
    init = jax.device_get(state)
    loss, grads = jax.device_get(r.loss_and_grads(state.params, *batches()[0]))
    return {"init": init, "loss": float(loss), "grads": grads, "runner": r, **train(r, state)}


def train(r, state):
    losses, norms = [], []
    for x, y in batches():
        state, m = r.train_step(state, *r.place_batch(x, y))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return {"losses": np.array(losses), "norms": np.array(norms), "params": jax.device_get(state.params)}


@functools.cache
def runner(impl: str, strategy: str, k: int = K):
    make = manual_parallel.make_runner if impl == "manual" else auto_parallel.make_runner
    return make(strategy, MESHES[strategy], accum(k))


@functools.cache
def twin(impl: str, strategy: str):
    """The twin at grad_accum K, from the single-device initial state (test_data_tensor proves it
    bitwise equal to the runner's own init), trained STEPS steps."""
    r = runner(impl, strategy)
    return r, train(r, jax.device_put(single()["init"], r.state_shardings))


def tokens(r) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((CFG.train.batch_size, CFG.model.context_length), np.int32, sharding=r.batch_sharding)


def ledger(r) -> hlo.Ledger:
    """The compiled train step's ledger (fsdp, fsdp_tp: the twin tests' program, the persistent cache's)."""
    return hlo.ledger(r.train_step.lower(r.abstract_state(), tokens(r), tokens(r)).compile(), r.mesh)


def gradient_ledger(r) -> hlo.Ledger:
    """The compiled loss_and_grads' ledger: the train step's but the optimizer's collectives. For tp,
    which no test here trains: its gradient program compiles in about half a train step's CPU seconds
    (measured, XLA:CPU), and the optimizer's rows under accumulation are fsdp_tp's train step's (the
    same tensor-axis norm sums, test_auto_syncs_gradients_once_per_step)."""
    return hlo.ledger(r.loss_and_grads.lower(r.abstract_state().params, tokens(r), tokens(r)).compile(), r.mesh)


# ----------------------------------------------------------------------------- single device


@pytest.mark.parametrize("k", [2, 4])
def test_single_device_accumulation_equals_the_full_batch(k):
    s = single()
    r = SingleDevice(CFG.model, accum(k).train)
    loss, grads = jax.device_get(r.loss_and_grads(s["init"].params, *batches()[0]))
    # the micro-batch scan around the layer scans (forward, backward); K = 1 has none
    whiles = lambda f: f.lower(s["init"].params, *batches()[0]).as_text().count("stablehlo.while")  # noqa: E731
    assert (whiles(single()["runner"].loss_and_grads), whiles(r.loss_and_grads)) == (2, 3)
    np.testing.assert_allclose(float(loss), s["loss"], rtol=2e-6)  # measured 5.8e-7 (K = 2)
    assert max_diff(grads, s["grads"]) < GRAD_ATOL / 10  # measured 1.9e-8
    if k == 2:  # the NumPy float64 model's full-batch mean loss
        sd = {n: v.astype(np.float64) for n, v in state_dict(nnx.merge(graphdef(CFG.model), s["init"].params)).items()}
        x, y = batches()[0]
        logits = reference.transformer_lm(sd, x, L, CFG.model.num_heads, CFG.model.rope_theta)
        assert abs(float(loss) - reference.cross_entropy(logits, y)) < 1e-5


def test_micro_batches_weigh_by_their_tokens():
    """A masked toy loss (targets -1: no loss) whose two micro-batches hold 2 and 13 target
    tokens: the accumulated loss and gradient are the full batch's masked mean (NumPy
    float64), where a mean of the micro-batch means is far off."""
    rng = np.random.default_rng(0)
    v, x = 5, rng.normal(size=(4, 8)).astype(np.float32)
    y = rng.integers(0, v, (4, 8)).astype(np.int32)
    y[0::2] = -1  # micro-batch 0 = rows 0 and 2 (strided split): only 2 targets
    y[0, :2] = rng.integers(0, v, 2)
    y[1, :3] = -1  # micro-batch 1 = rows 1 and 3: 13 targets
    w = rng.normal(size=v).astype(np.float32)

    def loss(p, xm, ym):  # masked mean of (w[y] x - 1)^2
        mask = ym >= 0
        per = (p["w"][jnp.clip(ym, 0)] * xm - 1.0) ** 2
        return jnp.sum(jnp.where(mask, per, 0.0)) / jnp.sum(mask)

    count = lambda ym: jnp.sum(ym >= 0).astype(jnp.float32)  # noqa: E731
    # jitted, as in a train step (eager: ~30 small compiles)
    got_loss, got = jax.jit(lambda p: accumulated_value_and_grad(loss, p, x, y, 2, count))({"w": jnp.asarray(w)})
    # NumPy float64: mean over valid tokens; d/dw_v = sum over tokens with y = v of 2 (w_v x - 1) x / n
    valid = y >= 0
    w64, x64, yv = w.astype(np.float64), x.astype(np.float64), np.where(valid, y, 0)
    resid = w64[yv] * x64 - 1.0
    want_loss = np.sum(np.where(valid, resid**2, 0.0)) / valid.sum()
    want = np.zeros(v)
    np.add.at(want, yv[valid], (2 * resid * x64)[valid] / valid.sum())
    np.testing.assert_allclose(float(got_loss), want_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=1e-5, atol=1e-7)
    means = [jax.jit(jax.grad(loss))({"w": jnp.asarray(w)}, x[i::2], y[i::2])["w"] for i in range(2)]
    assert np.max(np.abs((means[0] + means[1]) / 2 - want)) > 0.1  # the test can tell


def test_the_weight_sum_adds_in_each_params_dtype():
    """--grad_accum_dtype=weight on hand-made gradients with a known answer: 4 micro-batches whose
    gradients are 1 and three 2^-9. A bf16 sum rounds each 1 + 2^-9 back to 1 (its ulp at 1 is 2^-7):
    0.25 after the mean over 4 tokens; float32 sums 1 + 3 * 2^-9 and casts once: 1.0078125 / 4. A float32
    param sums in float32 under either setting."""
    x = np.array([[1.0], [2.0**-9], [2.0**-9], [2.0**-9]], np.float32)  # row j: micro-batch j (strided split)
    y = np.zeros((4, 1), np.int32)
    loss = lambda p, xm, ym: jnp.sum(p["w"] * xm) / ym.size  # noqa: E731  summed: d/dw = sum of xm

    def grad(dtype, sum_dtype):
        w = {"w": jnp.ones((1,), dtype)}
        return float(jax.jit(lambda p: accumulated_value_and_grad(loss, p, x, y, 4, sum_dtype=sum_dtype))(w)[1]["w"][0])

    assert grad(jnp.bfloat16, "weight") == 0.25
    assert grad(jnp.bfloat16, "float32") == 1.0078125 / 4
    assert grad(jnp.float32, "weight") == grad(jnp.float32, "float32") == np.float32(1 + 3 * 2.0**-9) / 4
    with pytest.raises(ValueError, match=r"^sum_dtype='bf16': choose one of float32, weight\.$"):
        zero_gradient(jnp.ones((1,), jnp.bfloat16), "bf16")


def test_summing_layer_by_layer_equals_the_full_batch():
    """sum_by_layer (per_layer=("layers",)): each layer's gradient summed in an array of its own, the stack rebuilt
    after: K = 2's gradient equals the full batch's (as the stacked sum does, above), each layer in its place
    (the two layers' gradients differ, so a stack rebuilt in another order fails)."""
    s = single()
    step = jax.jit(functools.partial(accumulated_value_and_grad, functools.partial(loss_fn, cfg=CFG.model),
                                     grad_accum=K, per_layer=("layers",)))
    loss, grads = jax.device_get(step(s["init"].params, *batches()[0]))
    np.testing.assert_allclose(float(loss), s["loss"], rtol=2e-6)
    assert max_diff(grads, s["grads"]) < GRAD_ATOL / 10
    assert max_diff(grads["layers"], jax.tree.map(lambda g: g[::-1], s["grads"]["layers"])) > 100 * GRAD_ATOL
    with pytest.raises(ValueError, match=r"per_layer=\('blocks',\): \['blocks'\] not among the params' keys"):
        accumulated_value_and_grad(loss_fn, s["init"].params, *batches()[0], K, per_layer=("blocks",))


def test_the_stacks_summed_by_layer_are_the_unrolled_ones():
    """unrolled_stacks: a stack of more than one layer whose scan is fully unrolled, with micro-batches to sum."""
    m = CFG.model  # 2 layers
    assert unrolled_stacks(dataclasses.replace(m, scan_unroll=2), 2) == ("layers",)
    assert unrolled_stacks(dataclasses.replace(m, scan_unroll=3), 4) == ("layers",)
    assert unrolled_stacks(dataclasses.replace(m, scan_unroll=1), 2) == ()  # rolled: restacked each micro-batch
    assert unrolled_stacks(dataclasses.replace(m, scan_unroll=2), 1) == ()  # nothing to sum
    assert unrolled_stacks(dataclasses.replace(m, num_layers=1, scan_unroll=1), 2) == ()  # one layer
    moe = preset("tiny_moe").model  # its dense_layers, then layers
    deep = dataclasses.replace(moe, num_layers=5, first_dense_layers=2)  # dense 2, experts 3
    assert unrolled_stacks(dataclasses.replace(deep, scan_unroll=3), 2) == ("dense_layers", "layers")
    assert unrolled_stacks(dataclasses.replace(deep, scan_unroll=2), 2) == ("dense_layers",)


@pytest.mark.parametrize("unroll", [1, L], ids=["rolled", "unrolled"])
def test_the_single_device_step_sums_in_the_flags_dtype_an_unrolled_stack_by_layer(unroll):
    """SingleDevice.train_step's own gradient (launch.train's single-device step, where a TPU's fast path sets
    --grad_accum_dtype=weight and unrolls the stack), bf16 weights, K = 4: the micro-batch scan carries each
    stacked leaf's sum in the flag's dtype; as L arrays of one layer when the stack is unrolled, as the [L, ...]
    stack when it is rolled (traced, not compiled)."""
    got = {}
    for sum_dtype in ("float32", "weight"):
        cfg = Config(dataclasses.replace(CFG.model, dtype="bfloat16", weight_dtype="bfloat16", scan_unroll=unroll),
                     dataclasses.replace(CFG.train, grad_accum=4, grad_accum_dtype=sum_dtype))
        r = SingleDevice(cfg.model, cfg.train)
        state = jax.eval_shape(lambda: r.init_state(0))
        tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32)
        (micro,) = [e for e in scans(jax.make_jaxpr(r.train_step)(state, tokens, tokens).jaxpr)
                    if e.params["length"] == 4]  # the layer scans run L = 2
        carries, _ = micro.params["ft_out"].update(micro.outvars).unpack()  # (carries, ys)
        stacked = _stacked_leaves(state.params)
        layer = [v for v in carries if v.aval.shape in {p.shape[1:] for p in stacked}]
        stack = [v for v in carries if v.aval.shape in {p.shape for p in stacked}]
        got[sum_dtype] = (len(layer), len(stack), {str(v.aval.dtype) for v in layer + stack})
    counts = (L * len(stacked), 0) if unroll == L else (0, len(stacked))
    assert got == {"float32": (*counts, {"float32"}), "weight": (*counts, {"bfloat16"})}


def test_every_unrolled_stack_is_carried_layer_by_layer():
    """A model of two stacks (tiny_moe with its first 2 layers dense: dense_layers [2, ...], then the experts'
    layers [2, ...]), unrolled, K = 4: SingleDevice.train_step's micro-batch scan carries no leaf of either
    stack whole, so each stack unrolled_stacks names reaches sum_by_layer (the test above has one stack; here a
    stack left out would be summed as [2, ...] with the same values). Traced, not compiled."""
    moe = preset("tiny_moe")
    cfg = Config(dataclasses.replace(moe.model, num_layers=4, first_dense_layers=2, scan_unroll=2),
                 dataclasses.replace(moe.train, grad_accum=4))
    assert unrolled_stacks(cfg.model, 4) == ("dense_layers", "layers")
    r = SingleDevice(cfg.model, cfg.train)
    state = jax.eval_shape(lambda: r.init_state(0))
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32)
    (micro,) = [e for e in scans(jax.make_jaxpr(r.train_step)(state, tokens, tokens).jaxpr)
                if e.params["length"] == 4]  # the layer scans run 2
    carries, _ = micro.params["ft_out"].update(micro.outvars).unpack()  # (carries, ys)
    carried = [v.aval.shape for v in carries]
    for stack in ("dense_layers", "layers"):
        whole = {p.shape for p in jax.tree.leaves(state.params[stack])}
        assert not whole & set(carried), (stack, whole & set(carried))
        for p in jax.tree.leaves(state.params[stack]):  # each layer's own array, at least L of each shape
            assert carried.count(p.shape[1:]) >= p.shape[0], (stack, p.shape)


def _stacked_leaves(params) -> list:
    """The stack's leaves [L, ...] whose one-layer shape no other param has (the final norm's gain is a layer
    norm's shape)."""
    others = {p.shape for k, v in params.items() if k != "layers" for p in jax.tree.leaves(v)}
    return [p for p in jax.tree.leaves(params["layers"]) if p.shape[1:] not in others]


def _carry_dtypes(fn, *args, shape) -> set[str]:
    """The dtypes of every scan output ending in `shape` in fn's jaxpr (traced, not compiled): the carries of
    that shape (the auto twin's per-data-shard vmap puts [data] in front)."""
    return {str(v.aval.dtype) for e in scans(jax.make_jaxpr(fn)(*args).jaxpr) for v in e.outvars
            if v.aval.shape[-len(shape):] == shape}


def _accumulating_runner(twin: str, strategy: str, cfg: Config):
    """The runner of `twin` on dp's mesh, or hsdp's two slices of fsdp:4 (test_hsdp's), or the single device."""
    import explicit_parallel

    if twin == "single":
        return SingleDevice(cfg.model, cfg.train)
    module = {"auto": auto_parallel, "manual": manual_parallel, "explicit": explicit_parallel}[twin]
    if strategy == "hsdp":  # its own step: per slice a micro-batch loop, then the mean across slices
        return module.runner_of(resolve.resolve_run("hsdp", twin, "fsdp:4", cfg, dcn_spec="data:2"))
    return module.make_runner(strategy, MESHES[strategy], cfg)


@pytest.mark.parametrize("twin, strategy", [("single", "dp"), ("auto", "dp"), ("manual", "dp"), ("explicit", "dp"),
                                            ("auto", "hsdp"), ("manual", "hsdp")])
def test_every_twin_sums_in_the_dtype_the_flag_names(twin, strategy):
    """bf16 weights and compute, K = 2 on dp, and on hsdp (which runs its own micro-batch loop in each
    slice): the micro-batch scan carries the embedding's gradient in float32 by default and in bf16 with
    grad_accum_dtype=weight (a twin that drops the setting fails)."""
    got = {}
    for sum_dtype in ("float32", "weight"):
        cfg = Config(dataclasses.replace(CFG.model, dtype="bfloat16", weight_dtype="bfloat16"),
                     dataclasses.replace(CFG.train, grad_accum=K, grad_accum_dtype=sum_dtype))
        r = _accumulating_runner(twin, strategy, cfg)
        params = r.abstract_state().params if twin != "single" else jax.eval_shape(lambda: r.init_state(0)).params
        tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32,
                                      sharding=getattr(r, "batch_sharding", None))
        got[sum_dtype] = _carry_dtypes(r.loss_and_grads, params, tokens, tokens,
                                       shape=params["token_embeddings"]["weight"].shape)  # [padded vocab, d]
    assert got == {"float32": {"float32"}, "weight": {"bfloat16"}}


# ----------------------------------------------------------------------------- both twins


# The compiled cases: fsdp (the data axis: gathers before the micro-batch loop, the gradient
# mean and scatter after it), tp (the tensor axis: per micro-batch) and fsdp_tp (both). dp's
# once-per-step gradient mean is fsdp's, on replicated weights: its two twins (2 cold train
# steps, ~12 s of CPU) were cut for suite time; the accumulation mutants are caught without them.
COMPILED = [s for s in MESHES if s != "dp"]


# tp accumulates without a data axis (no gradient sync; its Megatron all-reduces are per
# micro-batch, counted by the collectives tests below): cut for suite time (2 cold compiles).
@pytest.mark.parametrize("impl", ["manual", "auto"])
@pytest.mark.parametrize("strategy", [s for s in COMPILED if s != "tp"])
def test_twin_accumulation_matches_single_device(impl, strategy):
    s, (_, got) = single(), twin(impl, strategy)
    np.testing.assert_allclose(got["losses"], s["losses"], atol=LOSS_ATOL, rtol=0)
    np.testing.assert_allclose(got["norms"], s["norms"], rtol=NORM_RTOL)
    assert max_diff(got["params"], s["params"]) < PARAM_ATOL


# ----------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("strategy", COMPILED)
def test_manual_ledger_equals_the_cost_model_with_grad_accum(strategy):
    """The compiled step's ledger against the cost model at grad_accum = K, row by row; tp's gradient
    program against every row but the optimizer's (gradient_ledger)."""
    r = runner("manual", strategy)
    model = cost.cost(CFG.model, strategy, r.sizes, CFG.train.batch_size, grad_accum=K)
    if strategy == "tp":
        led = gradient_ledger(r)
        assert_ledger_without_optimizer(led, model)
    else:
        led = ledger(r)
        rows = cost.compare(led.summary(), model.summary())
        assert all(r["match"] for r in rows), cost.compare_table(rows) + "\n" + led.table()
    # once per step: no data-axis collective (gather, scatter, mean) inside a loop
    assert all(r.multiplicity == 1 for r in led.filter(axes=("data",))), led.table()


def _counts(led: hlo.Ledger) -> dict:
    return {(op, axes): s["count"] for (op, axes), s in led.summary().items()}


@pytest.mark.parametrize("strategy", COMPILED)
def test_auto_syncs_gradients_once_per_step(strategy):
    """auto_parallel/runner.py's one gradient sync per step at K = 2 (XLA:CPU writes the FSDP
    reduce-scatter as an all-reduce): 12 gradient leaves, 9 matrix leaves (the optimizer's global norm
    sums one partial norm per split matrix). tp: its gradient program (gradient_ledger), without those 9."""
    r = runner("auto", strategy)
    led = gradient_ledger(r) if strategy == "tp" else ledger(r)
    leaves, matrices = len(jax.tree.leaves(single()["grads"])), 9
    per_micro_batch = (1 + 2 * L) + (1 + 5 * L) + 3  # TP: [b, T, D] forward, backward; 3 token statistics
    want = {
        "fsdp": {("all-gather", ("data",)): matrices, ("all-reduce", ("data",)): leaves + matrices + 1},
        "tp": {("all-reduce", ("tensor",)): K * per_micro_batch},
        "fsdp_tp": {("all-gather", ("data",)): matrices, ("all-reduce", ("data",)): leaves + matrices + 1,
                    ("all-reduce", ("tensor",)): K * per_micro_batch + matrices},
    }[strategy]
    assert _counts(led) == want, led.table()
    assert all(r.multiplicity == 1 for r in led.filter(axes=("data",))), led.table()


def test_auto_data_collectives_do_not_grow_with_k():
    """K = 4 against K = 2 (fsdp_tp): the same data-axis collectives, K x the TP ones."""
    two, four = (_counts(ledger(runner("auto", "fsdp_tp", k))) for k in (2, 4))
    data = lambda c: {key: n for key, n in c.items() if key[1] == ("data",)}  # noqa: E731
    assert data(four) == data(two)
    tensor = ("all-reduce", ("tensor",))
    assert four[tensor] - two[tensor] == 2 * ((1 + 2 * L) + (1 + 5 * L) + 3), (two, four)


# ----------------------------------------------------------------------------- input and memory


def test_grad_accum_that_does_not_split_a_device_batch_is_refused():
    cfg = Config(CFG.model, dataclasses.replace(CFG.train, batch_size=8, grad_accum=2))
    for make in (manual_parallel.make_runner, auto_parallel.make_runner):
        with pytest.raises(ValueError, match=r"grad_accum=2 .*per-device batch of 1 .*multiple of 16"):
            make("fsdp", MESHES["fsdp"], cfg)
    with pytest.raises(ValueError, match=r"grad_accum=3 .*per-device batch of 2"):
        cost.cost(CFG.model, "dp", {"data": 8}, 16, grad_accum=3)


@pytest.mark.parametrize("strategy", MESHES)
def test_memory_with_grad_accum(strategy):
    """Activations of one micro-batch; a float32 accumulator the size of the local gradient
    (FSDP: of the whole matrices, with every matrix gathered in the compute dtype)."""
    mesh = {a: int(n) for a, n in (p.split(":") for p in MESHES[strategy].split(","))}
    one, two = (cost.memory(CFG.model, strategy, mesh, 16, 32, 4, grad_accum=k) for k in (1, 2))
    assert two.activations * 2 == one.activations and one.accumulator == 0
    t = mesh["tensor"]
    norms = CFG.model.d_model * (2 * L + 1)
    if strategy in ("dp", "tp"):
        assert two.accumulator == one.params and two.gathered_weights == one.gathered_weights == 0
    else:
        assert two.accumulator == 4 * (CFG.model.num_params() - norms) // t + 4 * norms
        assert two.gathered_weights == 4 * (CFG.model.num_params() - norms) // t
    assert two.backward_layer * 2 == one.backward_layer  # one layer's working set, of one micro-batch
    # --grad_accum_dtype=weight with bf16 weights: the sum in 2 bytes an element, through the resolved run too
    assert cost.memory(CFG.model, strategy, mesh, 16, 32, 4, grad_accum=2, accum_bytes=2).accumulator * 2 == two.accumulator
    if strategy == "dp":
        cfg = Config(dataclasses.replace(CFG.model, weight_dtype="bfloat16"),
                     dataclasses.replace(CFG.train, grad_accum=2, grad_accum_dtype="weight"))
        run = resolve.resolve_run("dp", "manual", MESHES["dp"], cfg)
        assert cost.of_run(run).memory.accumulator == two.accumulator // 2
    assert two.total == one.total - one.activations + two.activations + two.accumulator \
        + two.gathered_weights - one.gathered_weights - one.backward_layer + two.backward_layer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp_ep_gathers_its_local_experts_with_grad_accum(dtype):
    """fsdp_ep's gather_step gathers each device's E/ep experts, not all E: the gathered weights are
    the bytes its all-gathers over data bring in (the router in float32), and the float32
    accumulator holds the same pieces, plus the norm gains whole."""
    model = dataclasses.replace(preset("tiny_moe").model, dtype=dtype)
    c = cost.cost(model, "fsdp_ep", {"data": 2, "expert": 4}, 16, grad_accum=K)
    gathers = [r for r in c.collectives if (r.op, r.axes) == ("all-gather", ("data",))]
    assert c.memory.gathered_weights == sum(r.bytes for r in gathers)
    norms = sum(w.count * w.size for w in cost.weights(model) if not w.is_matrix)
    f32 = cost.cost(dataclasses.replace(model, dtype="float32"), "fsdp_ep", {"data": 2, "expert": 4}, 16,
                    grad_accum=K).memory.gathered_weights
    assert c.memory.accumulator == f32 + 4 * norms
