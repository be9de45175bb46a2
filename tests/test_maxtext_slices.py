"""Across TPU slices: transfers in flight over compute on one DCN link (twinshard/hlo/megascale.py reads
them; tests/test_megascale.py holds the reader), the GSPMD HSDP step of launch/slices.py sends only its
gradient shards over DCN with the cost model's bytes and the planner's seconds, and
tools/maxtext_slices.py scales and refuses as it says."""

import dataclasses
import pathlib
import re
import sys

import jax
import pytest

from twinshard import hlo
from twinshard.config import Config, preset
from twinshard.hardware import chips, links, plan, topology
from twinshard.hlo.timing import Rates, predict
from twinshard.train.optim import make_optimizer
from twinshard.train.trainer import abstract_state

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))

import maxtext_slices as ms  # noqa: E402  (tools/ is not a package)
from launch import slices as ls  # noqa: E402

needs_libtpu = pytest.mark.skipif(not topology.libtpu_installed(),
                                  reason="needs libtpu: uv run --locked --extra tpu pytest")


def _transfer(rendezvous: str, kind: str = "ALL_REDUCE") -> str:
    return ('is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
            f'_xla_host_transfer_rendezvous="{rendezvous}",_xla_megascale_reduce_operation="SUM",'
            f'_xla_megascale_transfer_type="{kind}"}}')


def _program(kind: str = "ALL_REDUCE") -> str:
    """One slice's program (2 partitions) with two megascale transfers, as libtpu prints them: `a` of
    p [256, 1024] f32 (1 MiB) and `b` of q [8, 128] f32 (4 KiB), both in flight over a [1024, 256] x
    [256, 1024] dot; b's recv-done first."""
    return f"""HloModule m, is_scheduled=true, num_partitions=2

ENTRY %main (p: f32[256,1024], q: f32[8,128]) -> f32[256,1024] {{
  %p = f32[256,1024]{{1,0}} parameter(0)
  %q = f32[8,128]{{1,0}} parameter(1)
  %after-all = token[] after-all()
  %send = (f32[256,1024]{{1,0}}, u32[], token[]) send(%p, %after-all), channel_id=2, {_transfer("a", kind)}
  %recv = (f32[256,1024]{{1,0}}, u32[], token[]) recv(%after-all), channel_id=1, {_transfer("a", kind)}
  %send.1 = (f32[8,128]{{1,0}}, u32[], token[]) send(%q, %after-all), channel_id=4, {_transfer("b", kind)}
  %recv.1 = (f32[8,128]{{1,0}}, u32[], token[]) recv(%after-all), channel_id=3, {_transfer("b", kind)}
  %dot = f32[1024,1024]{{1,0}} dot(%p, %p), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
  %recv-done.1 = (f32[8,128]{{1,0}}, token[]) recv-done(%recv.1), channel_id=3, is_host_transfer=true
  %send-done = token[] send-done(%send), channel_id=2, is_host_transfer=true
  %recv-done = (f32[256,1024]{{1,0}}, token[]) recv-done(%recv), channel_id=1, is_host_transfer=true
  %send-done.1 = token[] send-done(%send.1), channel_id=4, is_host_transfer=true
  ROOT %gte = f32[256,1024]{{1,0}} get-tuple-element(%recv-done), index=0
}}
"""


MESH = {"dcn": 4, "data": 2}  # 4 slices of 2 chips: the program's 2 partitions are one slice


def test_the_dot_hides_its_share_of_the_transfers_and_the_rest_is_exposed():
    rates = Rates("hand", {"float32": 1e12}, 1e12)
    pred = predict(_program(), rates, MESH, lambda op, axes, ring: (axes[0], ring / 1e9))
    dot = 2 * 1024 * 1024 * 256 / 1e12  # FLOPs at 1e12 (its 6 MiB at 1e12 B/s take less)
    a, b = 2 * 3 / 4 * 2**20 / 1e9, 2 * 3 / 4 * 4096 / 1e9  # one link: b waits behind a
    assert pred.compute_s == pytest.approx(dot)  # the sends, recvs and dones: the link's time, none of their own
    assert pred.axes["dcn"].comm_s == pytest.approx(a + b)
    assert pred.axes["dcn"].exposed_s == pytest.approx(a + b - dot)  # recv-done.1 waits for both
    assert pred.step_s == pytest.approx(a + b)


@pytest.mark.parametrize("kind, op, ring", [("ALL_REDUCE", "all-reduce", 2 * 3 / 4), ("ALL_GATHER", "all-gather", 3 / 4),
                                             ("REDUCE_SCATTER", "reduce-scatter", 3), ("ALL_TO_ALL", "all-to-all", 3 / 4)])
def test_each_transfer_type_is_its_collective_with_its_ring_bytes(kind, op, ring):
    """A megascale transfer's type names the collective across the 4 slices (MESH), and a ring of 4 sends
    its op's share of the payload: 2 x 3/4 for an all-reduce, 3/4 for a gather or an all-to-all, 3 x the
    (scattered) result for a reduce-scatter."""
    across = hlo.ledger(_program(kind), MESH).filter(axes="dcn")
    assert sorted((r.name, r.op, r.bytes, r.ring_bytes) for r in across) == [
        ("send", op, 2**20, ring * 2**20), ("send.1", op, 4096, ring * 4096)]


# the transfer `a` of _program inside a loop of 3 trips (the backward's layer loop, where XLA issues a
# layer's gradient all-reduce across slices)
LOOP = f"""HloModule m, is_scheduled=true, num_partitions=2

%body (t: (s32[], f32[256,1024])) -> (s32[], f32[256,1024]) {{
  %t = (s32[], f32[256,1024]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %p = f32[256,1024]{{1,0}} get-tuple-element(%t), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %after-all = token[] after-all()
  %send = (f32[256,1024]{{1,0}}, u32[], token[]) send(%p, %after-all), channel_id=2, {_transfer("a")}
  %recv = (f32[256,1024]{{1,0}}, u32[], token[]) recv(%after-all), channel_id=1, {_transfer("a")}
  %send-done = token[] send-done(%send), channel_id=2, is_host_transfer=true
  %recv-done = (f32[256,1024]{{1,0}}, token[]) recv-done(%recv), channel_id=1, is_host_transfer=true
  %got = f32[256,1024]{{1,0}} get-tuple-element(%recv-done), index=0
  ROOT %out = (s32[], f32[256,1024]{{1,0}}) tuple(%next, %got)
}}

%cond (c: (s32[], f32[256,1024])) -> pred[] {{
  %c = (s32[], f32[256,1024]{{1,0}}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}}

ENTRY %main (p: f32[256,1024]) -> f32[256,1024] {{
  %p = f32[256,1024]{{1,0}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256,1024]{{1,0}}) tuple(%zero, %p)
  %w = (s32[], f32[256,1024]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  ROOT %r = f32[256,1024]{{1,0}} get-tuple-element(%w), index=1
}}
"""


def test_the_report_counts_a_transfer_in_a_loop_once_a_trip():
    """launch.plan --compile's report on a step whose DCN all-reduce runs in a loop of 3 trips: 3 x its 1 MiB
    cross DCN, and the DCN lane prices all three at v5e's DCN rate (no compile: the step is LOOP)."""
    topo = links.with_slices(links.parse_topology(TOPOLOGY), 4)
    hsdp_plan = plan.evaluate(SMALL.model, topo, "fsdp", INSIDE, 4 * SMALL.train.batch_size)
    analysis = {"argument_size_in_bytes": 2**20, "output_size_in_bytes": 2**20, "alias_size_in_bytes": 0,
                "temp_size_in_bytes": 0}
    _, doc = ls.compiled_report(hsdp_plan, topo, {"hlo": LOOP, "mesh": MESH, "compile_s": 0.0,
                                                  "memory_analysis": analysis})
    assert doc["dcn_bytes"] == 3 * 2**20
    assert doc["predicted"]["axes"]["dcn"]["comm_s"] == pytest.approx(3 * 2 * 3 / 4 * 2**20 / chips.V5E_DCN_BYTES_PER_S)


# ----------------------------------------------------------------------------- a compiled HSDP step

TOPOLOGY, SLICES, INSIDE = "v5e:2x2", 2, {"data": 4, "tensor": 1}
# every gradient shard a whole number of (8, 128) f32 tiles, as the transfers move them
SMALL = Config(dataclasses.replace(preset("tiny").model, vocab_size=256, d_model=512, num_heads=4, d_ff=512,
                                   num_layers=1), preset("tiny").train)


@pytest.fixture(scope="module")
def hsdp():
    """(the planner's hsdp plan, its topology, launch/slices.compile_step of it): SMALL's HSDP step compiled
    for 2 slices of v5e:2x2 as launch.plan --compile compiles it, once."""
    topo = links.with_slices(links.parse_topology(TOPOLOGY), SLICES)
    batch = SLICES * SMALL.train.batch_size
    hsdp_plan = plan.evaluate(SMALL.model, topo, "fsdp", INSIDE, batch)
    step = ls.compile_step(hsdp_plan, topo, Config(SMALL.model, dataclasses.replace(SMALL.train, batch_size=batch)))
    return hsdp_plan, topo, step


@needs_libtpu
def test_hsdp_sends_only_its_gradient_shards_across_slices(hsdp):
    hsdp_plan, _, step = hsdp
    led = hlo.ledger(step["hlo"], step["mesh"])
    assert hsdp_plan.layout == "hsdp" and step["mesh"] == {"dcn": 2, "data": 4, "tensor": 1} and not led.unparsed
    across = led.filter(axes="dcn")
    assert {(r.op, r.reduction) for r in across} == {("all-reduce", "sum")}  # no weight, no activation
    assert all(set(r.axes) <= {"data"} for r in led if r not in across.records)  # the rest stays in a slice
    sent = sum(r.bytes * r.multiplicity for r in across)
    # the f32 gradient shards (the planner's), plus the loss in the tile that carries the norms' gradients
    assert hsdp_plan.cost.memory.grads <= sent < hsdp_plan.cost.memory.grads + 4096


@needs_libtpu
def test_the_dcn_term_is_the_planners_at_v5es_dcn_bandwidth(hsdp):
    hsdp_plan, topo, step = hsdp
    text, doc = ls.compiled_report(hsdp_plan, topo, step)
    rate = chips.chip("v5e").dcn_bytes_per_s
    assert rate == 2 * 100e9 / 8 / 8  # 2 x 100 Gb/s per host of 8 chips
    dcn = doc["predicted"]["axes"]["dcn"]
    assert dcn["comm_s"] == pytest.approx(hsdp_plan.comm_s["dcn"], rel=0.01)  # within the loss's tile
    assert dcn["comm_s"] == pytest.approx(2 * (SLICES - 1) / SLICES * doc["dcn_bytes"] / rate)
    assert "hsdp dcn:2 x data:4,tensor:1 (the auto twin, dcn outermost)" in text
    assert re.search(r"^all-reduce sum +dcn\(DCN\) ", text, re.M) and "axis dcn (DCN): communication" in text


@needs_libtpu
def test_each_slice_trains_its_share_of_the_global_batch(hsdp):
    """compile_step is given the global batch (SLICES x SMALL's) and compiles a slice's share of it: each
    chip's program reads batch / (slices x data) rows of x and of y."""
    _, _, step = hsdp
    entry = next(line for line in step["hlo"].splitlines() if line.startswith("ENTRY"))
    rows = SLICES * SMALL.train.batch_size // (SLICES * INSIDE["data"])
    assert re.findall(r"s32\[(\d+),(\d+)\]", entry) == [(str(rows), str(SMALL.model.context_length))] * 2


@needs_libtpu
def test_across_slices_fsdp_splits_each_weight_over_dcn_then_data():
    """across=True (fsdp over every chip): each weight's d_model split over (dcn, data), the DCN axis
    outermost as the [slices, chips] grid lays the devices; across=False (hsdp) no weight is split over dcn.
    The lowered program's argument shardings say so (lowered, not compiled)."""
    grid = ls.hybrid_devices(TOPOLOGY, SLICES)
    assert [d.slice_index for d in grid[:, 0]] == list(range(SLICES))  # slice i is row i
    shardings = {}
    for across in (True, False):
        lowered, mesh = ls.step_lowered(SMALL, "fsdp", INSIDE, grid, across)
        main = next(line for line in lowered.as_text().splitlines() if "func.func public @main" in line)
        shardings[across] = re.findall(r"sdy.sharding = #sdy.sharding<@mesh, \[(.*?)\]>", main)
    assert mesh == {"dcn": SLICES, **INSIDE}
    # the state's shardings (params, moments; in, then out) and x, y: hsdp's with each `data` split over (dcn, data)
    assert [a.replace('{"data"}', '{"dcn", "data"}') for a in shardings[False]] == shardings[True]
    assert sum('"dcn"' in a for a in shardings[False]) == 2  # hsdp: only x and y [slices x B, T] cross slices
    assert sum('{"dcn", "data"}' in a for a in shardings[True]) > 2 * len(jax.tree.leaves(abstract_state(SMALL.model, make_optimizer(SMALL.train)).params))


# ----------------------------------------------------------------------------- the tool


def test_a_ring_on_32_slices_sends_31_16ths_of_the_shard_where_2_send_one():
    assert ms.ring_growth(2, 32) == pytest.approx((2 * 31 / 32) / (2 * 1 / 2))
    assert ms.ring_growth(8, 32) == pytest.approx((31 / 32) / (7 / 8)) and ms.ring_growth(32, 32) == 1


def test_slice_links_price_the_dcn_axis_at_the_slices_asked_for():
    mesh = {"dcn": 2, "data": 256, "tensor": 1}
    at_2, at_32 = ms.slice_links(mesh), ms.slice_links(mesh, 32)
    assert at_2["dcn"].bytes_per_s == chips.V5E_DCN_BYTES_PER_S == 3.125e9
    assert at_32["dcn"].bytes_per_s == pytest.approx(3.125e9 / ms.ring_growth(2, 32))
    assert at_2["data"] == at_32["data"] == links.axis_links(links.parse_topology("v5e:16x16"), {"data": 256})["data"]


def test_bad_slice_counts_are_one_line_before_anything_compiles(capsys):
    for bad in ("1", "64"):
        with pytest.raises(SystemExit) as e:
            ms.main([f"--slices={bad}", "--compile=16b", "--out=/nonexistent"])
        assert e.value.code == 2
        assert capsys.readouterr().err == (f"maxtext_slices: error: --slices={bad} must be in [2, 32]: one slice is "
                                           "tools/maxtext_predict.py's table, and MaxText published 32\n")


def test_the_table_without_compiled_cases_says_so(tmp_path):
    table = ms.rows(str(tmp_path))
    text = ms.markdown(table)
    assert text.count("not compiled") == 8
    # the planner's DCN term: 2 x 31/32 of each chip's f32 gradient shard at 3.125 GB/s
    grads = [plan.evaluate(r["cfg"], links.parse_topology("v5e:16x16"), r["published"].strategy,
                           dict(r["published"].our_mesh), r["published"].per_device_batch * 256).cost.memory.grads
             for r in table]
    assert [r["dcn_term_s"] for r in table] == pytest.approx([2 * 31 / 32 * g / 3.125e9 for g in grads])
    assert "| 16b | 61.10% | 54.65% | 6.45 points |" in text and "| 128b | 56.06% | 46.25% | 9.81 points |" in text
