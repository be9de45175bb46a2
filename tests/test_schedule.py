"""The compiled schedule (twinshard/hlo/schedule.py) and the step time it predicts (twinshard/hlo/timing.py),
on small programs whose schedule is known.

`hidden`: one all-gather of a weight and, independent of it, two matmuls of another matrix: compiled for
a v5e:2x2 (AOT, needs libtpu) XLA issues the gather as an async collective fusion and schedules the
matmuls inside its window. `dependent`: the matmul takes the gathered weight, so nothing can hide it: a
synchronous all-gather, a zero-width window. `megatron`: a psum feeding a residual add, whole or in
batch chunks (ModelConfig.tp_overlap_chunks). On XLA:CPU every collective is synchronous.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twinshard import hlo
from twinshard.hardware import chips, links, topology
from twinshard.hardware.step_time import predict_step
from twinshard.model import layers
from twinshard.train import xla_options

needs_libtpu = pytest.mark.skipif(not topology.libtpu_installed(),
                                  reason="needs libtpu: uv run --locked --extra tpu pytest")
M, D, F = 128, 256, 256  # x [M, D], w [D/4, F] per device, a [F, F]
MESH = {"data": 4}
V5E = chips.chip("v5e")
LINKS = links.axis_links(links.Topology("v5e:2x2", V5E, (2, 2)), MESH)


def hidden(x, w, a):
    w_full = jax.lax.all_gather(w, "data", axis=0, tiled=True)  # [D, F]; nothing below waits for it but x @ w_full
    y = jnp.tanh(a @ a) @ a  # [F, F], independent of the gather: 2 x 2 F^3 FLOPs to hide it
    return x @ w_full, y


def dependent(x, w, a):
    w_full = jax.lax.all_gather(w, "data", axis=0, tiled=True)  # [D, F]
    return jnp.tanh(x @ w_full) @ a, a  # every matmul waits for the gather


def scanned(x, w, a):
    """Three layers in a lax.scan, each gathering its weight [D/4, F] -> [D, F]."""
    def layer(h, w_i):
        return jnp.tanh(h @ jax.lax.all_gather(w_i, "data", axis=0, tiled=True)), None
    return jax.lax.scan(layer, x, jnp.stack([w] * 3))[0], a


def _compile(fn, devices):
    mesh = Mesh(np.array(devices), ("data",))
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=(P(), P()), check_vma=False)
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    args = (jax.ShapeDtypeStruct((M, D), jnp.bfloat16, sharding=rep),
            jax.ShapeDtypeStruct((D, F), jnp.bfloat16, sharding=split),
            jax.ShapeDtypeStruct((F, F), jnp.bfloat16, sharding=rep))
    lowered = jax.jit(sm).lower(*args)
    return (topology.compile_for_pod(lowered) if devices[0].platform == "tpu" else lowered.compile()).as_text()


@pytest.fixture(scope="module")
def programs():
    """(program, 'tpu' | 'cpu') -> HLO text, each compiled once."""
    done: dict[tuple[str, str], str] = {}
    fns = {"hidden": hidden, "dependent": dependent, "scanned": scanned}

    def get(name: str, where: str) -> str:
        if (name, where) not in done:
            devices = topology.devices("v5e:2x2", (2, 2, 1)) if where == "tpu" else jax.devices()[:4]
            done[(name, where)] = _compile(fns[name], devices)
        return done[(name, where)]

    return get


def _only_window(sched: hlo.Schedule, dtype: str = "bf16") -> hlo.Window:
    (w,) = sched.windows()
    assert (w.op, w.axes, w.tensor) == ("all-gather", ("data",), f"{dtype}[{D},{F}]")
    return w


@needs_libtpu
def test_tpu_hides_the_gather_behind_the_independent_matmuls(programs):
    sched = hlo.schedule(programs("hidden", "tpu"), MESH)
    assert sched.scheduled and sched.warnings == []
    w = _only_window(sched)
    order = sched.entry.order
    assert not w.synchronous and w.issue < w.done
    assert order[w.issue].opcode == order[w.done].opcode == "fusion"  # TPU async collective fusions
    pred = predict_step(programs("hidden", "tpu"), V5E, MESH, LINKS)
    inside = [o for o in pred.ops if o.name in w.inside]
    # the two independent [F, F] matmuls run inside the window (one continuation fusion), x @ w_full after it
    assert sum(o.flops for o in inside) == 2 * (2 * F ** 3)
    after = [o for o in pred.ops if sched.entry.position(o.name) > w.done and o.kind == "matmul"]
    assert [o.flops for o in after] == [2 * M * D * F]
    (c,) = pred.collectives
    compute_inside = sum(o.seconds for o in inside)
    assert c.comm_s == pytest.approx((4 - 1) / 4 * D * F * 2 / LINKS["data"].bytes_per_s)
    assert 0 < compute_inside < c.comm_s  # v5e: 67 MFLOP take 0.34 us, the 96 KiB ring 1.09 us
    assert c.hidden_s == pytest.approx(compute_inside) and c.exposed_s == pytest.approx(c.comm_s - compute_inside)
    assert pred.axes["data"].hidden_s == pytest.approx(compute_inside)
    assert pred.step_s == pytest.approx(pred.compute_s + pred.exposed_s)


@needs_libtpu
def test_tpu_cannot_hide_a_gather_the_matmul_waits_for(programs):
    sched = hlo.schedule(programs("dependent", "tpu"), MESH)
    w = _only_window(sched)
    assert w.synchronous and w.inside == () and sched.entry.order[w.issue].opcode == "all-gather"
    pred = predict_step(programs("dependent", "tpu"), V5E, MESH, LINKS)
    (c,) = pred.collectives
    assert c.hidden_s == 0 and c.exposed_s == c.comm_s > 0
    assert pred.exposed_s == c.comm_s and pred.step_s == pytest.approx(pred.compute_s + c.comm_s)
    # every matmul of the program is scheduled after the gather
    assert all(sched.entry.position(o.name) > w.done for o in pred.ops if o.kind == "matmul")


@pytest.mark.parametrize("name", ["hidden", "dependent"])
def test_cpu_collectives_are_synchronous_and_exposed(programs, name):
    sched = hlo.schedule(programs(name, "cpu"), MESH)
    w = _only_window(sched, "f32")  # XLA:CPU gathers the bf16 weight as f32 (measured)
    assert w.synchronous and w.inside == () and w.phase == "other"  # no gradient taken
    pred = predict_step(programs(name, "cpu"), V5E, MESH, LINKS)
    assert pred.axes["data"].hidden_s == 0 and pred.axes["data"].exposed_s == pred.axes["data"].comm_s > 0
    # the CPU's matmuls are dots: 2 x the [F, F] chain (hidden only) and x @ w_full, [M, F] after tanh for dependent
    want = 2 * 2 * F ** 3 + 2 * M * D * F if name == "hidden" else 2 * M * D * F + 2 * M * F * F
    assert sum(o.flops for o in pred.ops) == want


@pytest.mark.parametrize("where", ["cpu", pytest.param("tpu", marks=needs_libtpu)])
def test_a_scanned_layer_is_one_loop_body_run_per_trip(programs, where):
    pred = predict_step(programs("scanned", where), V5E, MESH, LINKS)
    (body,) = pred.schedule.loops
    assert (body.trips, body.runs) == (3, 3)
    (w,) = body.windows  # the layer's gather, in the body, counted 3 times
    assert w.records[0].multiplicity == 3
    (c,) = pred.collectives
    assert c.runs == 3 and pred.axes["data"].comm_s == pytest.approx(3 * c.comm_s)
    loop = next(o for o in pred.ops if o.kind == "loop")
    assert loop.seconds == pytest.approx(3 * pred.sequence_s[body.name])
    assert sum(o.flops * o.runs for o in pred.ops) == 3 * 2 * M * D * F
    assert pred.step_s == pytest.approx(pred.compute_s + pred.exposed_s)


def test_efficiencies_scale_the_op_kinds(programs):
    text = programs("hidden", "cpu")
    full = predict_step(text, V5E, MESH, LINKS, efficiency=chips.Efficiency())
    half = predict_step(text, V5E, MESH, LINKS, efficiency=chips.Efficiency(matmul_efficiency=0.5, hbm_efficiency=0.25))
    for a, b in zip(full.ops, half.ops):
        assert (b.compute_s, b.memory_s) == pytest.approx((2 * a.compute_s, 4 * a.memory_s))
    assert chips.efficiency(chips.chip("v4")) == chips.Efficiency() and "datasheet" in chips.efficiency(chips.chip("v4")).source
    with pytest.raises(ValueError, match=r"matmul_efficiency=1.5 must be in \(0, 1\]"):
        chips.Efficiency(matmul_efficiency=1.5)


def test_a_collective_over_an_axis_without_a_link_is_refused(programs):
    with pytest.raises(ValueError, match=r"no link bandwidth for mesh axes \['data'\]"):
        predict_step(programs("hidden", "cpu"), V5E, MESH, links={})


def test_one_chip_needs_no_links():
    @jax.jit
    def f(a):
        return jnp.tanh(a @ a)

    pred = predict_step(f.lower(jax.ShapeDtypeStruct((F, F), jnp.float32)).compile(), "v4")
    assert pred.collectives == [] and pred.exposed_s == 0 and pred.step_s == pred.compute_s > 0
    assert sum(o.flops for o in pred.ops) == 2 * F ** 3
    assert "datasheet peaks" in pred.table() and pred.as_dict()["step_s"] == pred.step_s


# Two elementwise fusions as XLA:TPU writes them: the first's result and the second's operand in
# VMEM (layout memory space S(1)), so only the HBM operands and results cost bytes.
VMEM_HLO = """HloModule jit_f, entry_computation_layout={(bf16[1024,1024]{1,0})->bf16[1024,1024]{1,0}}

%fused_computation.1 (param_0: bf16[1024,1024]) -> bf16[1024,1024] {
  %param_0 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %tanh.1 = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} tanh(%param_0)
}

%fused_computation.2 (param_0.1: bf16[1024,1024], param_1: bf16[1024,1024]) -> bf16[1024,1024] {
  %param_0.1 = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %param_1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %add.1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} add(%param_0.1, %param_1)
}

ENTRY %main (Arg_0.1: bf16[1024,1024]) -> bf16[1024,1024] {
  %Arg_0.1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %tanh_fusion = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation.1
  ROOT %add_fusion = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%tanh_fusion, %Arg_0.1), kind=kLoop, calls=%fused_computation.2
}
"""


def test_an_int8_matmul_runs_at_the_int8_peak():
    dot = VMEM_HLO.replace("bf16[1024,1024]", "s8[1024,1024]").replace(
        "ROOT %add.1 = s8[1024,1024]{1,0:T(8,128)(2,1)} add(%param_0.1, %param_1)",
        "ROOT %add.1 = s32[1024,1024]{1,0:T(8,128)} dot(%param_0.1, %param_1), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}")
    as_bf16 = dot.replace("s8[", "bf16[")
    int8, bf16 = ({o.name: o for o in predict_step(t, V5E, efficiency=chips.Efficiency()).ops}["add_fusion"]
                  for t in (dot, as_bf16))
    assert int8.kind == bf16.kind == "matmul" and int8.flops == bf16.flops == 2 * 1024 ** 3
    assert int8.compute_s == pytest.approx(bf16.compute_s / 2)  # v5e: 394 int8 TOP/s against 197 bf16


def test_operands_and_results_on_the_chip_move_no_hbm_bytes():
    pred = predict_step(VMEM_HLO, V5E, efficiency=chips.Efficiency())
    moved = {o.name: o.bytes for o in pred.ops}
    array = 1024 * 1024 * 2
    assert moved == {"tanh_fusion": array, "add_fusion": 2 * array}  # reads HBM; the VMEM operand is free
    on_hbm = predict_step(VMEM_HLO.replace("S(1)", ""), V5E, efficiency=chips.Efficiency())
    assert {o.name: o.bytes for o in on_hbm.ops} == {"tanh_fusion": 2 * array, "add_fusion": 3 * array}


@needs_libtpu
def test_splash_attention_counts_its_causal_flops():
    from twinshard.model import layers

    b, h, t, dh = 1, 2, 256, 64
    devs = topology.devices("v5e:1x1", (1, 1, 1))
    one = NamedSharding(Mesh(np.array(devs), ("data",)), P())
    q = jax.ShapeDtypeStruct((b, h, t, dh), jnp.bfloat16, sharding=one)
    with layers.compiling_for("tpu"):
        lowered = jax.jit(layers.splash_attention).lower(q, q, q)
    text = topology.compile_for_pod(lowered).as_text()
    pred = predict_step(text, V5E, efficiency=chips.Efficiency())
    (kernel,) = [o for o in pred.ops if o.kind == "attention"]
    assert kernel.flops == 2 * (2 * b * h * t * t * dh) / 2  # QK^T and PV, causal: half
    slow = predict_step(text, V5E, efficiency=chips.Efficiency(splash_efficiency=0.5))
    assert [o.compute_s for o in slow.ops if o.kind == "attention"] == [pytest.approx(2 * kernel.compute_s)]
    measured = predict_step(text, V5E)  # v5e's measured rate at head_dim 64
    assert [o.compute_s for o in measured.ops if o.kind == "attention"] == [
        pytest.approx(kernel.compute_s / chips.EFFICIENCIES["v5e"].splash_by_head_dim[0][1])]
    full = predict_step(text, V5E, causal_attention=False)  # a full mask: twice the FLOPs
    assert [o.flops for o in full.ops if o.kind == "attention"] == [2 * kernel.flops]


@needs_libtpu
def test_the_drawing_puts_the_hiding_matmuls_inside_the_gathers_box(programs):
    import xml.etree.ElementTree as ET

    from twinshard.hlo.draw import timeline_svg

    svg = ET.fromstring(timeline_svg([("hidden", predict_step(programs("hidden", "tpu"), V5E, MESH, LINKS)),
                                      ("dependent", predict_step(programs("dependent", "tpu"), V5E, MESH, LINKS))]))
    g = "{http://www.w3.org/2000/svg}g"
    bands = {b.get("data-twin"): {lane.get("data-lane"): lane.findall(g) for lane in b.findall(g)}
             for b in svg.iter(g) if b.get("class") == "twin"}
    span = lambda box: (float(box.get("data-start-s")), float(box.get("data-end-s")))  # noqa: E731
    (gather,) = bands["hidden"]["data"]
    start, end = span(gather)
    matmuls = [span(b) for b in bands["hidden"]["compute"] if b.get("data-kind") == "matmul"]
    assert len(matmuls) == 2 and start <= matmuls[0][0] < matmuls[0][1] < end <= matmuls[1][0]  # hidden, then x @ w
    assert gather.find("{http://www.w3.org/2000/svg}rect[@class='exposed']") is not None
    (wait,) = bands["dependent"]["data"]
    assert wait.get("data-synchronous") == "true" and wait.get("data-hidden-us") == "0"
    assert all(span(b)[0] >= span(wait)[1] for b in bands["dependent"]["compute"] if b.get("data-kind") == "matmul")


def megatron(x, w1, w2, chunks: int):
    """One Megatron MLP on tensor:4 with its residual add, the batch in `chunks` chunks (layers.batch_chunks,
    as ModelConfig.tp_overlap_chunks runs each block): x [M, D]; w1 [D, F/4], w2 [F/4, D] per device."""
    def block(c):  # c [M/chunks, D] -> the same, after g's psum over tensor
        return c + jax.lax.psum(jnp.tanh(c @ w1) @ w2, "tensor")
    return layers.merge_chunks(tuple(block(c) for c in layers.batch_chunks(x, chunks)))


@needs_libtpu
def test_tpu_hides_a_chunks_all_reduce_behind_the_next_chunks_matmuls():
    """Batch-split overlap on a v5e:2x2 with the train step's options: whole, the psum feeds the residual
    add and nothing runs beside it; in 2 chunks the first chunk's psum (half the bytes) runs while the
    second chunk's matmul computes, and only the last one waits."""
    mesh = Mesh(np.array(topology.devices("v5e:2x2", (2, 2, 1))), ("tensor",))
    axis = {"tensor": 4}
    link = links.axis_links(links.Topology("v5e:2x2", V5E, (2, 2)), axis)
    column, row = NamedSharding(mesh, P(None, "tensor")), NamedSharding(mesh, P("tensor"))
    args = (jax.ShapeDtypeStruct((4 * M, 2 * D), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
            jax.ShapeDtypeStruct((2 * D, 8 * F), jnp.bfloat16, sharding=column),
            jax.ShapeDtypeStruct((8 * F, 2 * D), jnp.bfloat16, sharding=row))
    exposed = {}
    for chunks in (1, 2):
        sm = jax.shard_map(functools.partial(megatron, chunks=chunks), mesh=mesh, in_specs=(P(), P(None, "tensor"),
                           P("tensor")), out_specs=P(), check_vma=False)
        text = topology.compile_for_pod(jax.jit(sm).lower(*args), xla_options.ASYNC_COLLECTIVES).as_text()
        windows = hlo.schedule(text, axis).windows()
        pred = predict_step(text, V5E, axis, link)
        exposed[chunks] = pred.exposed_s
        assert [w.tensor for w in windows] == [f"bf16[{4 * M // chunks},{2 * D}]"] * chunks
        *first, last = windows
        assert last.synchronous and last.inside == ()  # the last chunk's psum: its add waits for it
        matmuls = {o.name for o in pred.ops if o.kind == "matmul"}
        assert all(not w.synchronous and set(w.inside) & matmuls for w in first)
    assert exposed[2] < exposed[1]


def test_the_splash_rate_is_the_one_measured_nearest_below_the_head_dim():
    r = hlo.Rates("x", {"bfloat16": 1.0}, 1.0, splash_efficiency=0.9, splash_by_head_dim=((64, 0.1), (128, 0.3)))
    assert [r.splash_share(d) for d in (32, 64, 96, 128, 256)] == [0.1, 0.1, 0.1, 0.3, 0.3]
    assert hlo.Rates("x", {"bfloat16": 1.0}, 1.0, splash_efficiency=0.9).splash_share(64) == 0.9
    with pytest.raises(ValueError, match=r"splash_by_head_dim\[64\]=0 must be in \(0, 1\]"):
        chips.Efficiency(splash_by_head_dim=((64, 0),))
