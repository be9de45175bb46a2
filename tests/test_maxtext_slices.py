"""Across TPU slices: transfers in flight over compute on one DCN link (twinshard/hlo/megascale.py reads
them; tests/test_megascale.py holds the reader), the GSPMD HSDP step of launch/slices.py sends only its
gradient shards over DCN with the cost model's bytes and the planner's seconds, and
tools/maxtext_slices.py scales and refuses as it says."""

import dataclasses
import pathlib
import re
import sys

import pytest

from twinshard import hlo
from twinshard.config import Config, preset
from twinshard.hardware import chips, links, plan, topology
from twinshard.hlo.timing import Rates, predict

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
