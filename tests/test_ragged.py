"""The dropless path (ModelConfig.moe_dispatch='ragged'): rows sorted by expert through
jax.lax.ragged_dot, and under manual ep the ragged_all_to_all pair of manual_parallel/collectives.py.

XLA:CPU runs ragged_dot but not ragged-all-to-all. So:
- one device: the ragged block and model against the dense dispatch with capacity_factor 0
  (dropless: the same function up to float rounding), outputs, losses, stats and gradients;
- the manual twin's arithmetic (the route, the regrouping, the pair's backward) runs on CPU with
  `emulated_ragged_all_to_all`, JAX's documented semantics written with all_to_all (checked
  against the example of jax.lax.ragged_all_to_all's docstring), against one device: its loss
  and gradients; the GSPMD twin's loss and gradients against one device's;
- the real ragged_all_to_all is compiled ahead of time for a TPU pod (v5e:2x4, libtpu): the
  ledger's ragged-all-to-alls and count all_to_alls, counted by hand;
- on CPU a manual ep run with ragged fails before compiling, naming --moe_dispatch=dense.

tiny_moe (E = 4, k = 2, T = 32, L = 2, B = 8), dropless; ep on data:2,expert:4 (A = 1 row x 32
tokens x 2 choices = 64 assignment rows per device), fsdp_ep on data:2,expert:2.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import auto_parallel
import manual_parallel
import reference
import runners
from cli import run as run_cli
from launch import common
from manual_parallel import collectives, ep
from test_moe import B, S, T, capacity, flag_values, ours, weights
from twinshard import cost, hlo, testing
from twinshard.config import Config, preset
from twinshard.hardware import topology
from twinshard.model import moe
from twinshard.parallel import mesh as mesh_lib, resolve
from twinshard.train import trainer

BASE = preset("tiny_moe")
TRAIN = dataclasses.replace(BASE.train, grad_clip=0.25)
DENSE = Config(dataclasses.replace(BASE.model, capacity_factor=0.0), TRAIN)
RAGGED = Config(dataclasses.replace(DENSE.model, moe_dispatch="ragged"), TRAIN)
MESHES = {"ep": "data:2,expert:4", "fsdp_ep": "data:2,expert:2"}


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """jax.lax.ragged_all_to_all as its docstring defines it, from all_to_all and selects (which
    XLA:CPU runs): slice j of the operand goes to peer j, zero-padded to the operand's rows, and
    peer s's slice is written at all_to_all(output_offsets)[s] of this device's output."""
    assert axis_index_groups is None
    n, a = lax.axis_size(axis_name), operand.shape[0]
    column = lambda m: m.reshape(m.shape + (1,) * (operand.ndim - 1))  # noqa: E731
    at = jnp.arange(a)
    sent = jnp.where(column(at[None] < send_sizes[:, None]),
                     operand[jnp.clip(input_offsets[:, None] + at[None], 0, a - 1)], 0)  # [n, A, ...]
    got = lax.all_to_all(sent, axis_name, 0, 0, tiled=True)  # [n, A, ...]: from peer s
    where = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    row = jnp.arange(output.shape[0])
    for s in range(n):
        r = row - where[s]
        output = jnp.where(column((r >= 0) & (r < recv_sizes[s])), got[s][jnp.clip(r, 0, a - 1)], output)
    return output


@pytest.fixture
def emulated(monkeypatch):
    """ragged_all_to_all emulated (collectives.py calls it as lax.ragged_all_to_all) and the
    CPU refusal of twinshard/parallel/resolve.py lifted, for this test only."""
    monkeypatch.setattr(lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(resolve, "check_dispatch", lambda *args: None)


def expert_mesh(n: int):
    return mesh_lib.make_mesh({"expert": n}, jax.sharding.AxisType.Explicit, jax.devices()[:n])


def devices_of(mesh: str) -> list:
    return jax.devices()[:math.prod(int(p.split(":")[1]) for p in mesh.split(","))]


# ----------------------------------------------------------------------------- one device


@functools.cache
def blocks(k: int):
    """(dense dropless, ragged) jitted blocks of test_moe's shapes."""
    dense = functools.partial(moe.moe_ffn, experts_per_token=k, capacity=capacity(k, 0.0), group_size=S)
    return jax.jit(dense), jax.jit(functools.partial(moe.moe_ffn_ragged, experts_per_token=k, group_size=S))


@pytest.mark.parametrize("k", [1, 2])
def test_ragged_block_is_the_dense_dropless_block(k):
    """Outputs within 1e-5 (measured max |diff| 6.0e-8 at k = 2, |y| <= 2.7), aux and z and the
    tokens per expert equal, nothing dropped; the gradients of <y, c> + 0.3 aux + 0.2 z with
    respect to x, router, w1, w2, w3 within 1e-5 (measured 1.9e-6 on entries up to ~60)."""
    x, *w = weights(seed=20 + k)
    args = (jnp.asarray(x, jnp.float32), *ours(*w))
    dense, ragged = blocks(k)
    (yd, sd), (yr, sr) = dense(*args), ragged(*args)
    np.testing.assert_allclose(yr, yd, rtol=0, atol=1e-5)
    for name in ("aux", "z"):
        np.testing.assert_allclose(float(sr[name]), float(sd[name]), rtol=1e-7)
    np.testing.assert_array_equal(sr["tokens_per_expert"], sd["tokens_per_expert"])
    assert int(sr["dropped"]) == int(sd["dropped"]) == 0 and int(np.sum(sr["tokens_per_expert"])) == k * B * T
    c = jnp.asarray(np.random.default_rng(k).normal(size=x.shape), jnp.float32)

    def grads(block):
        def objective(*a):
            y, st = block(*a)
            return (y * c).sum() + 0.3 * st["aux"] + 0.2 * st["z"]
        return jax.jit(jax.grad(objective, argnums=tuple(range(5))))(*args)

    for name, gd, gr in zip(("x", "router", "w1", "w2", "w3"), grads(dense), grads(ragged)):
        assert np.any(np.asarray(gr) != 0), name
        np.testing.assert_allclose(gr, gd, rtol=0, atol=1e-5, err_msg=name)


@functools.cache
def single(name: str):
    """One device's runner of `name`, its loss and gradients on the first batch at the initial params
    (tests/runners.py): DENSE's is tests/test_experts.py's test_dropless_ep_matches_single_device's
    (runners.single_loss_and_grads: traced once on the worker that runs both modules)."""
    return runners.single_loss_and_grads({"dense": DENSE, "ragged": RAGGED}[name])


def test_ragged_model_is_the_dense_dropless_model():
    """tiny_moe with --moe_dispatch=ragged --capacity_factor=0 (the launch flags) on one CPU
    device: its loss equals the dense dropless model's (measured: equal to the last bit) and its
    gradients are within 1e-7 (6.5e-9). (Its 3 training steps on one device, which this test and then
    test_auto_twin_runs_* took: a train step is these gradients then the optimizer, whose twins
    tests/test_experts.py trains against one device.)"""
    flags = common.with_model_flags(BASE, flag_values(moe_dispatch="ragged", capacity_factor=0.0))
    assert flags.model == RAGGED.model
    dense, ragged = single("dense"), single("ragged")
    assert abs(ragged["loss"] - dense["loss"]) < 1e-6
    assert reference.max_diff(ragged["grads"], dense["grads"]) < 1e-7


def test_flops_are_the_assigned_rows_and_xla_counts_every_expert():
    """cost.flops of the dropless path counts the experts on the N k assigned rows only (what a
    grouped matmul kernel computes). XLA's cost analysis of the single-device step (L = 1: XLA
    counts a while body once) counts more, measured: it charges jax.lax.ragged_dot as a dot of
    every row with every one of the E experts, so it equals the model plus (E - 1) x the experts'
    forward and backward matmuls, within 5% (XLA also counts elementwise ops)."""
    m = dataclasses.replace(RAGGED.model, num_layers=1)
    b, t = TRAIN.batch_size, m.context_length
    params = jax.eval_shape(functools.partial(trainer.create_params, m, 0))
    x = jax.ShapeDtypeStruct((b, t), jnp.int32)
    xla = jax.jit(jax.value_and_grad(functools.partial(trainer.loss_fn, cfg=m))).lower(params, x, x).compile()
    rows = b * t * m.experts_per_token
    experts = 3 * 2 * rows * 3 * m.d_model * m.expert_ff  # forward + 2x backward, three matmuls
    model = cost.flops(m, b, t).total
    assert xla.cost_analysis()["flops"] == pytest.approx(model + (m.num_experts - 1) * experts, rel=0.05)
    dense = cost.flops(dataclasses.replace(DENSE.model, num_layers=1), b, t).total  # buffers: E G S rows > N k
    assert model < dense


# ----------------------------------------------------------------------------- the ragged pair


def test_emulation_is_the_documented_ragged_all_to_all():
    """The example of jax.lax.ragged_all_to_all's docstring (JAX 0.12), axis of size 2."""
    mesh = expert_mesh(2)
    args = [[[1, 2, 2], [3, 4, 0]], [[0, 0, 0, 0]] * 2, [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]],
            [[1, 1], [2, 1]]]
    args = [jax.device_put(jnp.asarray(a, jnp.int32).reshape(-1), NamedSharding(mesh, P("expert"))) for a in args]
    f = jax.jit(jax.shard_map(functools.partial(emulated_ragged_all_to_all, axis_name="expert"), mesh=mesh,
                              in_specs=(P("expert"),) * 6, out_specs=P("expert")))
    np.testing.assert_array_equal(np.asarray(f(*args)).reshape(2, 4), [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_ragged_pair_routes_rows_to_their_experts_and_back(emulated):
    """expert:4, E = 8 (2 local experts), A = 12 rows per device with value 100 device + row, sorted
    by random experts: after dispatch_rows device j holds every row of experts 2j, 2j+1 grouped by
    local expert (senders in device order within one), zeros after them; combine_rows brings each
    row back to its place; ragged_dispatch's VJP is ragged_combine and the reverse."""
    n, e, a, d = 4, 8, 12, 3
    mesh = expert_mesh(n)
    ids = np.sort(np.random.default_rng(0).integers(0, e, (n, a)), axis=1)  # each device's experts, sorted
    sizes = np.stack([np.bincount(i, minlength=e) for i in ids]).astype(np.int32)  # [n, E]
    rows = (100 * np.arange(n)[:, None] + np.arange(a)[None, :]).astype(np.float32)  # [n, A]
    rows = np.repeat(rows[..., None], d, axis=-1)
    put = lambda v: jax.device_put(jnp.asarray(v).reshape(-1, *v.shape[2:]), NamedSharding(mesh, P("expert")))  # noqa: E731
    par = ep.ExpertParallel({})
    def smap(f, out_specs=P("expert"), in_specs=(P("expert"),) * 2):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    def there(r, s):
        got, local, _ = par.dispatch_rows(r, s)
        return got, local

    got, local = smap(there, out_specs=(P("expert"), P("expert")))(put(rows), put(sizes))
    got, local = np.asarray(got).reshape(n, n * a, d), np.asarray(local).reshape(n, e // n)
    for j in range(n):
        want = [rows[s, i] for x in (2 * j, 2 * j + 1) for s in range(n) for i in range(a) if ids[s, i] == x]
        np.testing.assert_array_equal(local[j], sizes[:, 2 * j:2 * j + 2].sum(0))
        np.testing.assert_array_equal(got[j, :len(want)], np.array(want).reshape(-1, d))
        assert np.all(got[j, len(want):] == 0)
    def round_trip(r, s):
        got, _, plan = par.dispatch_rows(r, s)
        return par.combine_rows(got, plan)

    np.testing.assert_array_equal(np.asarray(smap(round_trip)(put(rows), put(sizes))), np.asarray(put(rows)))

    def pair(r, s, g, which):
        route, _ = collectives.expert_route(s, a, "expert")
        op = {"dispatch": collectives.ragged_dispatch, "combine": collectives.ragged_combine}[which]
        other = {"dispatch": collectives.ragged_combine, "combine": collectives.ragged_dispatch}[which]
        out, pull = jax.vjp(lambda v: op(v, route, n * a if which == "dispatch" else a, "expert"), r)
        return pull(g)[0], other(g, route, a if which == "dispatch" else n * a, "expert")

    for which, g_rows in (("dispatch", n * a), ("combine", a)):
        r = rows if which == "dispatch" else np.zeros((n, n * a, d), np.float32) + rows[:, :1]
        g = jax.random.normal(jax.random.key(1), (n, g_rows, d))
        vjp, other = smap(functools.partial(pair, which=which), (P("expert"),) * 2, (P("expert"),) * 3)(
            put(r), put(sizes), put(g))
        np.testing.assert_array_equal(np.asarray(vjp), np.asarray(other), err_msg=which)
        assert np.any(np.asarray(vjp) != 0)


# ----------------------------------------------------------------------------- the twins on CPU


@pytest.mark.parametrize("strategy", list(MESHES))
def test_manual_twin_with_emulated_exchange_matches_one_device(emulated, strategy):
    """The manual twin's whole ragged loss and gradient (route, exchange, regrouping, expert
    gradients) with the emulated exchange, at one device's initial params, against one device:
    loss within 1e-5, gradients 1e-7 (measured 1.9e-6 and 1.4e-8), the same tokens per expert and
    none dropped. (The optimizer's steps after it are the dense twins' code: their training,
    tests/test_experts.py.)"""
    mesh = MESHES[strategy]
    runner = manual_parallel.make_runner(strategy, mesh, RAGGED, devices=devices_of(mesh))
    got, want = runners.loss_and_grads(runner, RAGGED), single("ragged")
    assert abs(got["loss"] - want["loss"]) < 1e-5
    assert reference.max_diff(got["grads"], want["grads"]) < 1e-7
    x = reference.random_batches(TRAIN.batch_size, RAGGED.model.context_length, RAGGED.model.vocab_size, 1)[0]
    params = runners.initial_params(RAGGED)
    _, stats = jax.device_get(runner.router_stats(jax.device_put(params, runner.state_shardings.params),
                                                  *runner.place_batch(*x)))
    one = want["runner"]
    _, expected = jax.device_get(one.router_stats(params, *one.place_batch(*x)))
    np.testing.assert_array_equal(stats["tokens_per_expert"], expected["tokens_per_expert"])
    assert not np.any(stats["dropped"])


def test_auto_twin_runs_the_ragged_math_under_gspmd():
    """GSPMD partitions the single-device ragged math itself (no ragged_all_to_all: it runs on
    CPU): its loss and gradients at one device's initial params are one device's (loss within 1e-5,
    gradients 1e-7; measured 2.4e-6 and 1.3e-8, as the manual twin). Its train step is this gradient
    then the optimizer (placed.GlobalRunner), which the dropping GSPMD ep twin trains against one
    device in tests/test_experts.py; this test trained 3 steps on each side before (two train steps
    compiled where one device's gradient program is compiled already). What it inserts on a TPU pod:
    test_auto_twin_on_tpu_replicates_the_ragged_experts."""
    runner = auto_parallel.make_runner("ep", MESHES["ep"], RAGGED, devices=devices_of(MESHES["ep"]))
    got, want = runners.loss_and_grads(runner, RAGGED), single("ragged")
    assert abs(got["loss"] - want["loss"]) < 1e-5
    assert reference.max_diff(got["grads"], want["grads"]) < 1e-7


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("strategy", list(MESHES))
def test_manual_ragged_on_cpu_fails_before_compiling(strategy):
    with pytest.raises(ValueError, match=r"--moe_dispatch=ragged .* XLA:CPU cannot run ragged-all-to-all .* "
                                         r"use --moe_dispatch=dense"):
        manual_parallel.make_runner(strategy, MESHES[strategy], RAGGED, devices=devices_of(MESHES[strategy]))


def test_the_launcher_names_the_fix():
    """The same error from `launch.train` (one line on stderr, exit 1, nothing compiled); the
    config's own checks through the flags; ragged with micro-batches under the GSPMD twin, whose
    per-shard jax.vmap JAX 0.12 cannot apply to ragged_dot (twinshard/parallel/resolve.py)."""
    out = run_cli("-m", "launch.train", "--preset=tiny_moe", "--strategy=ep", "--impl=manual",
                  "--mesh=data:2,expert:4", "--moe_dispatch=ragged", "--capacity_factor=0", "--steps=1")
    assert out.returncode == 1 and "XLA:CPU cannot run ragged-all-to-all" in out.stderr, out.stderr
    assert "--moe_dispatch=dense" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(ValueError, match=r"^--moe_dispatch=ragged: ModelConfig.moe_dispatch='ragged' .* needs "
                                         r"capacity_factor=0, not 1.25 .* pass --capacity_factor=0"):
        common.with_model_flags(BASE, flag_values(moe_dispatch="ragged"))
    with pytest.raises(ValueError, match=r"ModelConfig.moe_dispatch='sparse' is not supported; choose one of "
                                         r"dense, ragged"):
        dataclasses.replace(BASE.model, moe_dispatch="sparse")
    dataclasses.replace(preset("tiny").model, moe_dispatch="ragged")  # a dense model: nothing to route
    accumulating = Config(RAGGED.model, dataclasses.replace(TRAIN, grad_accum=2))
    with pytest.raises(ValueError, match=r"--moe_dispatch=ragged with --grad_accum=2 under --impl=auto: .* cannot "
                                         r"vmap jax.lax.ragged_dot"):
        auto_parallel.make_runner("dp", "data:2,tensor:1", accumulating, devices=devices_of("data:2"))


# ----------------------------------------------------------------------------- a TPU pod, ahead of time

needs_libtpu = pytest.mark.skipif(not topology.libtpu_installed(),
                                  reason="needs libtpu: uv run --locked --extra tpu pytest")
POD_MESH = {"data": 2, "expert": 4}
# d_model 128: TPU lays a ragged-all-to-all's rows out as [rows, 1, 128 lanes], so tiny_moe's
# d_model 64 would show as [rows, 1, 128] (measured, libtpu 0.0.50.1); 128 keeps the bytes D's.
POD_MODEL = dataclasses.replace(RAGGED.model, d_model=128)


def pod_step(impl: str, remat: str = "none"):
    """(cfg, runner, ledger) of the ep train step compiled for v5e:2x4 (8 chips on 2 hosts)."""
    return _pod_step(impl, remat)  # one cache entry however `remat` is passed (each AOT compile: ~5 s of CPU)


@functools.cache
def _pod_step(impl: str, remat: str):
    cfg = Config(dataclasses.replace(POD_MODEL, remat=remat), TRAIN)
    make = {"auto": auto_parallel, "manual": manual_parallel}[impl].make_runner
    runner = make("ep", MESHES["ep"], cfg, devices=topology.mesh_devices(POD_MESH, topology.devices("v5e:2x4")))
    xs = jax.ShapeDtypeStruct((TRAIN.batch_size, cfg.model.context_length), np.int32, sharding=runner.batch_sharding)
    compiled = topology.compile_for_pod(runner.train_step.lower(runner.abstract_state(), xs, xs))
    return cfg, runner, hlo.ledger(compiled.as_text(), runner.mesh)


@needs_libtpu
@pytest.mark.parametrize("remat", ["none", "full"])
def test_manual_twin_on_tpu_exchanges_with_four_ragged_all_to_alls_per_layer(remat):
    """Counted by hand, per MoE layer (L = 2, ep = 4 devices, A = B/(data ep) T k = 64 rows, D = 128):
    forward, expert_route's all_to_all of [ep, E/ep + 1] = [4, 2] int32 (the counts and offsets),
    ragged_dispatch [A, D] -> [ep A, D] and ragged_combine [ep A, D] -> [A, D]; backward, their
    reverses: combine's into [ep A, D], dispatch's into [A, D]. 4L ragged-all-to-alls and L
    all_to_alls; the one other collective over `expert` alone is the optimizer's norm. Each buffer is its static
    bound (the ledger's bytes): ep A rows where the experts run, whatever the routing. With
    --remat=full the layer policy saves the exchanged rows: the backward repeats none of them."""
    cfg, runner, led = pod_step("manual", remat)
    m, ep_size = cfg.model, POD_MESH["expert"]
    L, a = m.num_layers, TRAIN.batch_size // runner.mesh.size * m.context_length * m.experts_per_token
    ragged = testing.expect_collectives(led, "ragged-all-to-all", ("expert",), count=4 * L)
    for backward in (False, True):
        recs = [r for r in ragged if ("transpose(" in r.op_name) == backward]
        shapes = sorted((tuple(r.shape), r.dtype, r.multiplicity) for r in recs)
        assert shapes == [((a, 1, m.d_model), "f32", L), ((ep_size * a, 1, m.d_model), "f32", L)], led.table()
    assert ragged.total_bytes() == 2 * L * (a + ep_size * a) * m.d_model * 4
    counts = testing.expect_collectives(led, "all-to-all", ("expert",), count=L)
    assert {(r.dtype, math.prod(r.shape)) for r in counts} == {("s32", ep_size * (m.num_experts // ep_size + 1))}
    assert {r.source.rpartition(":")[0].rsplit("/", 1)[-1] for r in ragged} == {"ep.py"}
    assert led.filter(op="all-reduce", axes="expert").count() == 1 and not led.unparsed  # the norm's psum
    # the cost model's exchange rows (twinshard/cost/communication.py) say the same, op for op
    exchanges = lambda summary: {k: v for k, v in summary.items() if k[0].endswith("all-to-all")}  # noqa: E731
    rows = cost.compare(exchanges(led.summary()), exchanges(cost.cost(m, "ep", POD_MESH, TRAIN.batch_size).summary()))
    assert len(rows) == 2 and all(r["match"] for r in rows), cost.compare_table(rows)


@needs_libtpu
def test_auto_twin_on_tpu_replicates_the_ragged_experts():
    """What GSPMD makes of the ragged math under ep's placement (measured, libtpu 0.0.50.1): no
    exchange of tokens at all, no all-to-all of either kind. It all-gathers each layer's expert
    weights over `expert` (w1, w2, w3, forward and again in the backward pass: 6 per layer) and
    all-reduces over (data, expert) the global argsort and the sorted rows [B T k, D], so every
    device runs every expert on every token: the ragged path is expert parallel in the manual
    twin only."""
    cfg, runner, led = pod_step("auto")
    m = cfg.model
    assert led.count("all-to-all") == led.count("ragged-all-to-all") == 0
    gathers = testing.expect_collectives(led, "all-gather", ("expert",), count=6 * m.num_layers)
    assert {tuple(r.shape)[::-1][:2] for r in gathers} == {(m.expert_ff, m.d_model), (m.d_model, m.expert_ff)}
    rows = TRAIN.batch_size * m.context_length * m.experts_per_token
    assert any(tuple(r.shape) == (rows, m.d_model) for r in led.filter(op="all-reduce", axes=("data", "expert")))


@needs_libtpu
def test_saved_residuals_equal_the_memory_model():
    """What the layer scan hands to the backward pass (JAX's print_saved_residuals) is exactly
    L x cost.saved_per_layer (remat=none; the feed-forward term cost.memory's dropless rows) plus
    the last layer's output: on one device, and per device of manual ep, whose experts run on the
    static [ep A, D] rows ragged_dispatch returns. The manual runner is traced (not compiled) over
    the v5e:2x4 devices: on CPU devices it refuses ragged before tracing."""
    from test_remat import residuals

    m, b, t = POD_MODEL, TRAIN.batch_size, POD_MODEL.context_length
    tokens = jax.ShapeDtypeStruct((b, t), np.int32)
    single_saved = residuals(functools.partial(trainer.loss_fn, cfg=m),
                             jax.eval_shape(lambda: trainer.create_params(m, 0)), tokens, tokens)
    _, r, _ = pod_step("manual")
    ep_saved = []

    def body(p, x, y):  # the params as the runner differentiates them: varying over the token axes
        p = jax.tree.map(lambda w, axes: lax.pcast(w, axes, to="varying") if axes else w, p, r.replicated_over_tokens)
        ep_saved.extend(residuals(lambda q: r._local_loss(q, x, y), p))
        return x

    batch = jax.ShapeDtypeStruct((b, t), np.int32, sharding=r.batch_sharding)
    jax.eval_shape(jax.shard_map(body, mesh=r.mesh, in_specs=(r.param_specs, r.batch_spec, r.batch_spec),
                                 out_specs=r.batch_spec, check_vma=True), r.abstract_state().params, batch, batch)
    per_layer = {}
    for saved, rows, exchange in ((single_saved, b, 0), (ep_saved, b // r.mesh.size, POD_MESH["expert"])):
        scan = sum(n for shape, n, where in saved if "output of scan" in where and shape[1:] != (1, 1, m.d_model))
        per_layer[exchange] = (scan // 4 - rows * t * m.d_model) // m.num_layers
        assert scan == 4 * (m.num_layers * cost.saved_per_layer(m, "none", rows, t, 1, exchange=exchange)
                            + rows * t * m.d_model), exchange
    # the strategy's memory (what launch.plan ranks with) holds the exchanged rows: its backward
    # working set is one measured manual-ep layer plus attention's
    rows = b // r.mesh.size
    model = cost.memory(m, "ep", POD_MESH, b, t)
    assert model.backward_layer == 4 * per_layer[POD_MESH["expert"]] + cost.attention_backward(m, rows, t, 1)
