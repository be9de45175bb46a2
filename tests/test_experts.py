"""Expert parallelism (ep, fsdp_ep) in both twins: the all_to_all pair, each twin against
single-device training with dropped tokens, ep's step-1 loss and gradients without (dropless), the
manual ledger against the cost model, what GSPMD inserts, router statistics and checkpoints across
strategies.

tiny_moe (E = 4 experts, k = 2, T = 32, one capacity group per sequence, L = 2, B = 8) with
capacity_factor 0.5 (C = 8 slots per expert and group, against k S / E = 16 assignments on
average: tokens are dropped, counted below); ep on data:2,expert:4 and fsdp_ep on
data:2,expert:2, so each device routes one or two whole groups. fsdp_ep's twins run the model
whose first layer stays dense (first_dense_layers; L = 3, two scanned stacks): each compiled step
proves fsdp_ep and the two stacks at once (the MoE stack is every-layer-MoE's; ep's twins, and
tests/test_ragged.py's fsdp_ep gradients, hold the model without a dense layer). The step clips
(grad_clip 0.25 < the ~0.7 norm), so the twins' global norms must agree for the updates to agree.

Where the claims of tests merged away are held: every-layer-MoE fsdp_ep training, ledger, temporaries
and drops -> the first_dense cells of the same tests (one compiled step per twin and strategy);
dropless ep training -> test_dropless_ep_matches_single_device's gradients, with the dropping
twins' training; the first dense layers under fsdp_ep -> test_expert_parallel_matches_single_*[*-fsdp_ep].
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import auto_parallel
import manual_parallel
import reference
import runners
from manual_parallel.collectives import combine_from_experts, dispatch_to_experts
from twinshard import cost, hlo, testing
from twinshard.config import Config, preset
from twinshard.hardware import topology
from twinshard.parallel import mesh as mesh_lib
from twinshard.train.checkpoint import Checkpointer
from twinshard.train.trainer import SingleDevice, create_params, loss_fn

pytestmark = pytest.mark.ep  # every test here proves ep: the expert exchange and ep's twins (fsdp_ep's too)

BASE = preset("tiny_moe")
TRAIN = dataclasses.replace(BASE.train, grad_clip=0.25)
DROPS = Config(dataclasses.replace(BASE.model, capacity_factor=0.5), TRAIN)
DROPLESS = Config(dataclasses.replace(BASE.model, capacity_factor=0.0), TRAIN)
# L = 3 whose layer 0 keeps the dense feed-forward (ModelConfig.first_dense_layers): two scanned stacks
FIRST_DENSE = Config(dataclasses.replace(DROPS.model, num_layers=3, first_dense_layers=1), TRAIN)
CONFIGS = {"drops": DROPS, "first_dense": FIRST_DENSE}
MESHES = {"ep": "data:2,expert:4", "fsdp_ep": "data:2,expert:2"}
MODEL_OF = {"ep": "drops", "fsdp_ep": "first_dense"}  # the config each strategy's twins train (module docstring)
STEPS = 3
# Measured (JAX 0.12.0.1, XLA:CPU), every twin vs single device: losses within 9.5e-7,
# norms 9.3e-8 relative, params after 3 AdamW steps 3.0e-7 (ep) and 7.6e-6 (fsdp_ep's
# first_dense model); dropless ep's step-1 loss 2.4e-6, gradients 1.5e-8.
LOSS_ATOL, GRAD_ATOL, NORM_RTOL, PARAM_ATOL = 1e-5, 1e-7, 1e-6, 1e-5


def devices_of(mesh: str) -> list:
    return jax.devices()[:math.prod(int(p.split(":")[1]) for p in mesh.split(","))]


@functools.cache
def single(name: str):
    cfg = CONFIGS[name]
    return reference.train_record(SingleDevice(cfg.model, cfg.train), cfg, STEPS, grads=False)


def make_runner(impl: str, strategy: str, cfg: Config):
    mesh = MESHES[strategy]
    return {"auto": auto_parallel, "manual": manual_parallel}[impl].make_runner(strategy, mesh, cfg,
                                                                                 devices=devices_of(mesh))


@functools.cache
def twin(impl: str, strategy: str):
    """The twin's record of its strategy's config (MODEL_OF), from its own init, without step-1
    gradients (train_record: equal losses, norms and params after clipped AdamW steps leave a wrong
    gradient nowhere to hide; ep's manual gradients themselves: test_dropless_ep_*)."""
    cfg = CONFIGS[MODEL_OF[strategy]]
    return reference.train_record(make_runner(impl, strategy, cfg), cfg, STEPS, grads=False)


@functools.cache
def compiled_ledger(impl: str, strategy: str) -> hlo.Ledger:
    r = twin(impl, strategy)["runner"]
    cfg = CONFIGS[MODEL_OF[strategy]]
    xs = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32, sharding=r.batch_sharding)
    return hlo.ledger(r.train_step.lower(r.abstract_state(), xs, xs).compile().as_text(), r.mesh)


def first_batch(cfg: Config):
    return reference.random_batches(cfg.train.batch_size, cfg.model.context_length, cfg.model.vocab_size, 1)[0]


# ----------------------------------------------------------------------------- the all_to_all pair


def test_dispatch_sends_each_experts_buffers_to_its_device_and_combine_inverts_it():
    """On expert:4, device i's buffer [E=8, G=1, C, D] holds value 100 i + e in expert e's rows:
    after dispatch device j holds experts 2j, 2j+1 of every sender, senders in device order along
    G; combine returns every buffer home; each one's VJP is the other."""
    n, e, c, d = 4, 8, 3, 2
    mesh = mesh_lib.make_mesh({"expert": n}, jax.sharding.AxisType.Explicit, jax.devices()[:n])
    x = (100 * jnp.arange(n)[:, None] + jnp.arange(e)[None, :]).astype(jnp.float32)  # [n, E]
    x = jnp.broadcast_to(x[:, :, None, None, None], (n, e, 1, c, d)).reshape(n * e, 1, c, d)  # [n E, 1, C, D]
    on_devices = functools.partial(jax.device_put, device=NamedSharding(mesh, P("expert")))
    x = on_devices(x)
    smap = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
    there = smap(lambda b: dispatch_to_experts(b, "expert"))(x)  # per device [E/n, n, C, D]
    got = np.asarray(there).reshape(n, e // n, n, c, d)[..., 0, 0]  # [device, local expert, sender]
    want = np.array([[[100 * s + (e // n) * j + k for s in range(n)] for k in range(e // n)] for j in range(n)])
    np.testing.assert_array_equal(got, want)
    back = smap(lambda b: combine_from_experts(dispatch_to_experts(b, "expert"), "expert"))(x)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    g = on_devices(jax.random.normal(jax.random.key(0), there.shape))
    _, pull = jax.vjp(smap(lambda b: dispatch_to_experts(b, "expert")), x)
    np.testing.assert_array_equal(np.asarray(pull(g)[0]), np.asarray(smap(lambda b: combine_from_experts(b, "expert"))(g)))


# ----------------------------------------------------------------------------- against single device


@pytest.mark.parametrize("strategy", list(MESHES))
@pytest.mark.parametrize("impl", ["auto", "manual"])
def test_expert_parallel_matches_single_device_while_dropping_tokens(impl, strategy):
    """3 clipped AdamW steps. fsdp_ep: a dense stack and a MoE stack, FSDP gathers both stacks'
    weights, only the MoE stack exchanges."""
    got, want = twin(impl, strategy), single(MODEL_OF[strategy])
    np.testing.assert_allclose(got["losses"], want["losses"], atol=LOSS_ATOL, rtol=0)
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=NORM_RTOL)
    assert reference.max_diff(got["params"], want["params"]) < PARAM_ATOL


@pytest.mark.parametrize("impl", ["auto", "manual"])
def test_dropless_ep_matches_single_device(impl):
    """Capacity S (nothing dropped): the same ep code on larger buffers (still partly empty: k S / E
    = 16 of 32 slots on average), so the step-1 loss and gradients stand for the training the
    dropping twins prove (one compile each; the single-device program is traced once for both
    and for tests/test_ragged.py: runners.single_loss_and_grads)."""
    got = runners.loss_and_grads(make_runner(impl, "ep", DROPLESS), DROPLESS)
    want = runners.single_loss_and_grads(DROPLESS)
    assert abs(got["loss"] - want["loss"]) < LOSS_ATOL
    assert reference.max_diff(got["grads"], want["grads"]) < GRAD_ATOL


@pytest.mark.parametrize("impl, strategy", [("manual", "ep"), ("auto", "ep"), ("manual", "fsdp_ep")])
def test_every_twin_drops_exactly_the_tokens_one_device_drops(impl, strategy):
    """router_stats on the first batch, at the initial params: the dropped assignments and the
    tokens kept per expert are integers and must be equal, and > 0 (capacity 0.5); one row per MoE
    layer (fsdp_ep: the first_dense model, 2 of its 3 layers). Dropless, where nothing is dropped:
    tests/test_moe.py's block against the reference, test_dropless_ep_*'s equal gradients."""
    name = MODEL_OF[strategy]
    cfg = CONFIGS[name]
    x = first_batch(cfg)
    one = SingleDevice(cfg.model, cfg.train)
    _, want = jax.device_get(one.router_stats(single(name)["init"], *one.place_batch(*x)))
    assert int(np.sum(want["dropped"])) > 0, want["dropped"]
    assert want["dropped"].shape == (cfg.model.moe_layers,)
    assert int(want["assignments"]) == cfg.model.experts_per_token * x[0].size
    r = twin(impl, strategy)["runner"]
    params = jax.device_put(single(name)["init"], r.state_shardings.params)
    _, got = jax.device_get(r.router_stats(params, *r.place_batch(*x)))
    np.testing.assert_array_equal(got["dropped"], want["dropped"])
    np.testing.assert_array_equal(got["tokens_per_expert"], want["tokens_per_expert"])
    np.testing.assert_allclose(got["aux"], want["aux"], rtol=1e-6)


# ----------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("strategy", list(MESHES))
def test_manual_ledger_equals_the_cost_model_exactly(strategy):
    """Per MoE layer 2 all_to_alls of the capacity buffers [E, G, C, D] forward (dispatch,
    combine) and 2 backward (their inverses), each from manual_parallel/ep.py's hooks; ep: every
    dense gradient's mean over (data, expert), each expert gradient's over data; fsdp_ep: FSDP's
    gathers and scatters over data, the dense shards' mean over expert; its first_dense model: none in the
    dense layer (4 x 2 all_to_alls, not 4 x 3), FSDP's of both stacks."""
    runner = twin("manual", strategy)["runner"]
    led = compiled_ledger("manual", strategy)
    m, b = CONFIGS[MODEL_OF[strategy]].model, DROPS.train.batch_size
    model = cost.cost(m, strategy, runner.sizes, b)
    rows = cost.compare(led.summary(), model.summary())
    assert all(r["match"] for r in rows), cost.compare_table(rows) + "\n" + led.table()
    groups = b // (runner.sizes["data"] * runner.sizes["expert"]) * m.context_length // m.moe_group
    buffers = m.num_experts * groups * m.expert_capacity * m.d_model * 4
    testing.expect_collectives(led, "all-to-all", ("expert",), count=4 * m.moe_layers)
    assert led.filter(op="all-to-all").total_bytes() == 4 * m.moe_layers * buffers
    assert {r.source.rpartition(":")[0].rsplit("/", 1)[-1] for r in led.filter(op="all-to-all").records} == {"ep.py"}


@pytest.mark.parametrize("strategy", list(MESHES))
def test_auto_twin_exchanges_the_buffers_with_all_to_alls(strategy):
    """What GSPMD inserts for ep's two buffer layouts (auto_parallel/ep.py), measured: the same
    4 all-to-alls per MoE layer over `expert`, of the same bytes as the manual twin's, and no
    all-gather of the buffers (its only all-gather over data,expert is the router's [G, S, E]
    probabilities, which GSPMD gathers whole for top_k: 2 per step, one per layer)."""
    auto, manual = compiled_ledger("auto", strategy), compiled_ledger("manual", strategy)
    m = CONFIGS[MODEL_OF[strategy]].model
    testing.expect_collectives(auto, "all-to-all", ("expert",), count=4 * m.moe_layers)
    assert auto.filter(op="all-to-all").total_bytes() == manual.filter(op="all-to-all").total_bytes()
    probs = DROPS.train.batch_size * m.context_length * m.num_experts * 4
    gathered = auto.filter(op="all-gather", axes=("data", "expert"))
    assert gathered.count() == m.moe_layers and gathered.total_bytes() == m.moe_layers * probs, auto.table()


# test_remat_never_repeats_an_exchange (manual ep's train step compiled under --remat=full: still 4
# all_to_alls per layer, the layer policy saving the exchanged buffers) went: its count is asserted by
# tests/test_remat.py::test_manual_ledger_under_full_remat_equals_the_cost_model[ep] (and [fsdp_ep]),
# on the loss_and_grads that test compiles under full anyway (the update exchanges nothing).


# ----------------------------------------------------------------------------- checkpoints and errors


@pytest.mark.ep
@pytest.mark.parametrize("writer, reader", [("ep", "fsdp_ep"), ("fsdp_ep", "ep")])
def test_a_checkpoint_written_under_one_expert_strategy_restores_under_single_and_the_other(tmp_path, writer, reader):
    """The state after 3 manual steps of `writer` (ep on 8 devices, fsdp_ep on 4; each its
    MODEL_OF config), saved sharded, restores bit for bit on one device and under `reader`
    (Orbax reshards it)."""
    state = twin("manual", writer)["state"]
    want = jax.device_get(state)
    ckpt = Checkpointer(str(tmp_path / writer))
    ckpt.save(STEPS, state, {"strategy": writer})
    cfg = CONFIGS[MODEL_OF[writer]]
    targets = {"single": SingleDevice(cfg.model, cfg.train).abstract_state(),
               reader: make_runner("manual", reader, cfg).abstract_state()}
    for where, target in targets.items():
        got, _ = ckpt.restore(target, expect={"strategy": writer})
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(jax.device_get(got)), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=where)


@pytest.mark.parametrize("strategy, mesh, cfg, message", [
    ("ep", "data:2,expert:4", preset("tiny"), r"--strategy=ep splits the experts .* dense \(--num_experts=0\): add experts"),
    ("tp", "data:1,tensor:4", BASE, r"--num_experts=4: a mixture of experts runs under dp, fsdp, ep, fsdp_ep"),
    ("pp", "stage:2", BASE, r"--num_experts=4: a mixture of experts runs under"),
    ("ep", "data:1,expert:8", BASE, r"experts=4 is not divisible by mesh axis expert=8 \(or make experts "
     r"\(--num_experts\) a multiple of 8\); try --mesh=data:4,expert:2"),
])
def test_bad_expert_configs_are_clear_errors(strategy, mesh, cfg, message):
    for twin_module in (auto_parallel, manual_parallel):
        with pytest.raises(ValueError, match=message):
            twin_module.make_runner(strategy, mesh, cfg, devices=devices_of(mesh))


# ----------------------------------------------------------------------------- memory


def test_saved_residuals_per_layer_equal_the_memory_model():
    """What the layer scan hands to the backward pass (JAX's own list) is exactly L x
    cost.saved_per_layer (remat=none, whose feed-forward term is cost.memory.moe_saved) plus the
    last layer's output, on one device and per device of manual ep (one group each)."""
    from test_remat import residuals

    m, b, t = DROPS.model, DROPS.train.batch_size, DROPS.model.context_length
    tokens = jax.ShapeDtypeStruct((b, t), np.int32)
    single_saved = residuals(functools.partial(loss_fn, cfg=m), jax.eval_shape(lambda: create_params(m, 0)),
                             tokens, tokens)
    r = twin("manual", "ep")["runner"]
    ep_saved = []

    def body(p, x, y):  # the params as the runner differentiates them: varying over the token axes
        p = jax.tree.map(lambda w, axes: lax.pcast(w, axes, to="varying") if axes else w, p, r.replicated_over_tokens)
        ep_saved.extend(residuals(lambda q: r._local_loss(q, x, y), p))
        return x

    jax.eval_shape(jax.shard_map(body, mesh=r.mesh, in_specs=(r.param_specs, r.batch_spec, r.batch_spec),
                                 out_specs=r.batch_spec, check_vma=True),
                   r.abstract_state().params, jax.ShapeDtypeStruct((b, t), np.int32, sharding=r.batch_sharding),
                   jax.ShapeDtypeStruct((b, t), np.int32, sharding=r.batch_sharding))
    for saved, rows in ((single_saved, b), (ep_saved, b // r.mesh.size)):
        scan = sum(n for shape, n, where in saved if "output of scan" in where and shape[1:] != (1, 1, m.d_model))
        assert scan == 4 * (m.num_layers * cost.saved_per_layer(m, "none", rows, t, 1) + rows * t * m.d_model)


def test_saved_residuals_of_the_two_stacks_equal_the_memory_model():
    """first_dense: each scan hands its own layers' residuals to the backward pass, the dense
    layer SwiGLU's [b,T,F] three, the MoE layers' buffers: exactly cost.saved_by_stacks (the sum over
    ModelConfig.stacks of n x saved_per_layer of the stack), plus the dense scan's output."""
    from test_remat import residuals

    m, b, t = FIRST_DENSE.model, FIRST_DENSE.train.batch_size, FIRST_DENSE.model.context_length
    tokens = jax.ShapeDtypeStruct((b, t), np.int32)
    saved = residuals(functools.partial(loss_fn, cfg=m), jax.eval_shape(lambda: create_params(m, 0)), tokens, tokens)
    scan = sum(n for shape, n, where in saved if "output of scan" in where and shape[1:] != (1, 1, m.d_model))
    assert scan == 4 * (cost.saved_by_stacks(m, "none", b, t, 1) + b * t * m.d_model)
    (_, dense), (_, moe) = m.stacks
    assert cost.saved_per_layer(dense, "none", b, t, 1) < cost.saved_per_layer(moe, "none", b, t, 1)


# temp / model bands as for the dense strategies (tests/test_memory.py): manual ep replicates
# its dense weights as dp does and takes manual dp's band (the gradient means' buffers), the
# GSPMD twins hold buffers the model does not count. Measured (JAX 0.12.0.1, tiny_moe, capacity
# 0.5; fsdp_ep: first_dense): manual ep 1.34, manual fsdp_ep 1.04, auto ep 1.59, auto fsdp_ep 1.41.
BANDS = {("manual", "ep"): (0.85, 1.8), ("manual", "fsdp_ep"): (0.85, 1.35), ("auto", "ep"): (0.85, 1.75),
         ("auto", "fsdp_ep"): (0.85, 1.75)}


@pytest.mark.parametrize("strategy", list(MESHES))
@pytest.mark.parametrize("impl", ["auto", "manual"])
def test_compiled_step_beside_the_memory_model(impl, strategy):
    """memory_analysis() of the compiled step: its arguments hold exactly the model's params and
    optimizer state (the experts split over `expert`), its temporaries within the band of the
    model's (activations with the capacity buffers, gathered weights, the backward working set)."""
    r = twin(impl, strategy)["runner"]
    cfg = CONFIGS[MODEL_OF[strategy]]
    xs = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32, sharding=r.batch_sharding)
    state = r.abstract_state()
    step = r.train_step.lower(state, xs, xs).compile()
    model = cost.memory(cfg.model, strategy, r.sizes, cfg.train.batch_size, cfg.model.context_length)
    args = topology.argument_bytes(step, state, xs, xs)
    assert (args["params"]["bytes"], args["optimizer"]["bytes"]) == (model.params, model.optimizer)
    low, high = BANDS[impl, strategy]
    assert low < step.memory_analysis().temp_size_in_bytes / model.temporaries < high, model


@pytest.mark.parametrize("layers, dense, capacity_factor", [(1, 0, 0.5), (2, 1, 1.25)])
def test_flops_match_xlas_count(layers, dense, capacity_factor):
    """cost.flops of a mixture of experts (every expert on its whole capacity buffer, the dispatch
    and combine einsums) against XLA's cost analysis of the single-device step, on one layer per
    stack (XLA counts a while body once: tests/test_cost.py) and within 5% (XLA also counts
    elementwise ops). (2, 1): a dense layer, then a MoE layer whose buffers hold 2.5 x the tokens,
    so that counting the dense layer as a MoE one misses (measured: XLA 319.4 MFLOP, the model
    315.0, every layer MoE 416.0)."""
    m = dataclasses.replace(DROPS.model, num_layers=layers, first_dense_layers=dense, capacity_factor=capacity_factor)
    b, t = DROPS.train.batch_size, m.context_length
    params = jax.eval_shape(functools.partial(create_params, m, 0))
    x = jax.ShapeDtypeStruct((b, t), jnp.int32)
    xla = jax.jit(jax.value_and_grad(functools.partial(loss_fn, cfg=m))).lower(params, x, x).compile().cost_analysis()
    assert xla["flops"] == pytest.approx(cost.flops(m, b, t).total, rel=0.05)


def test_the_cost_model_refuses_experts_that_do_not_split():
    with pytest.raises(ValueError, match=r"experts=4 is not divisible by mesh axis expert=8"):
        cost.cost(BASE.model, "ep", {"data": 1, "expert": 8}, BASE.train.batch_size)


@pytest.mark.parametrize("strategy, mesh", [("tp", {"tensor": 2}), ("tp_sp", {"tensor": 2}), ("cp", {"context": 2}),
                                            ("pp", {"stage": 2}), ("pp_fsdp", {"stage": 2, "data": 2})])
def test_the_cost_model_refuses_strategies_experts_do_not_run_under(strategy, mesh):
    """As launch.train (resolve.check_experts): no numbers for a program that does not exist."""
    with pytest.raises(ValueError, match=rf"--num_experts=4: a mixture of experts runs under dp, fsdp, ep, fsdp_ep "
                                         rf"\(or single\), not --strategy={strategy}"):
        cost.cost(BASE.model, strategy, mesh, BASE.train.batch_size, microbatches=2)
