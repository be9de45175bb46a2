"""The ledger and the schedule reader across TPU slices: a program compiled for 2 slices is one slice's, its
collectives across slices megascale send/recv pairs (twinshard/hlo/megascale.py). On a hand-trimmed excerpt of
the real compile (tests/hlo_snippets/tpu_megascale.hlo: hsdp/manual, v5e:2x2 x 2 slices, the CFG model): the
DCN all-reduces with their payload bytes, equal to the cost model's hsdp rows across slices; their windows
in the schedule; the DCN lane of the predicted step; none without the attribute; malformed ones raise.
No compile: the AOT command is in docs/slices.md."""

from __future__ import annotations

import functools
import pathlib
import re

import pytest

from runners import CFG
from twinshard import cost, hlo
from twinshard.hardware import links, step_time
from twinshard.hlo import draw
from twinshard.hlo.schedule import schedule
from twinshard.parallel import resolve

TEXT = (pathlib.Path(__file__).parent / "hlo_snippets" / "tpu_megascale.hlo").read_text()
MESH = {"data": 2, "fsdp": 4}  # data across the 2 slices (DCN), fsdp over a slice's 4 chips
TYPE = '_xla_megascale_transfer_type="ALL_REDUCE"'


@functools.cache
def _ledger() -> hlo.Ledger:
    return hlo.ledger(TEXT, MESH)


def test_megascale_pairs_are_dcn_all_reduces_of_their_payload():
    led = _ledger()
    across = led.filter(axes="data")
    assert led.dcn == ("data",) and not led.unparsed
    # the payload, not the padded transfer buffer (f32[27,8,128], f32[8,8,128], f32[6,8,128], f32[1,1,128])
    assert sorted((r.name, r.op, r.reduction, r.dtype, r.shape, r.bytes) for r in across) == [
        ("send", "all-reduce", "sum", "f32", (26944,), 26944 * 4),
        ("send.1", "all-reduce", "sum", "f32", (2, 192, 16), 6144 * 4),
        ("send.2", "all-reduce", "sum", "f32", (384, 16), 6144 * 4),
        ("send.3", "all-reduce", "sum", "f32", (), 4)]
    assert all(r.group_size == 2 and r.ring_bytes == r.bytes and r.is_async for r in across)  # 2 slices
    assert [(r.op, r.axes, r.bytes) for r in led.filter(axes="fsdp")] == [("all-reduce", ("fsdp",), 512)]
    assert "data(DCN)" in led.table()


def test_dcn_bytes_equal_the_cost_models_hsdp_rows_across_slices():
    """Only the gradient shards' mean and the loss cross DCN: 153.25 KiB + 4 B on the CFG model."""
    run = resolve.resolve_run("hsdp", "manual", "fsdp:4", CFG, dcn_spec="data:2")
    model = sum(r.bytes for r in cost.of_run(run).collectives if "data" in r.axes)
    assert _ledger().total_bytes("data") == model == 153.25 * 1024 + 4


def test_dcn_windows_run_from_the_send_to_the_recv_done():
    sched = schedule(TEXT, MESH)
    windows = {w.start: w for w in sched.windows() if w.axes == ("data",)}
    assert {k: w.finish for k, w in windows.items()} == {
        "send": "recv-done", "send.1": "recv-done.1", "send.2": "recv-done.2", "send.3": "recv-done.3"}
    assert "multiply.7" in windows["send.3"].inside  # the loss's transfer spans the backward op
    assert "multiply.7" not in windows["send"].inside  # the gradients' is issued after it
    assert not sched.warnings


def test_the_predicted_step_has_a_dcn_lane_priced_at_the_dcn_link():
    pod = links.with_slices(links.parse_topology("v5e:2x2"), 2)
    known = {**links.axis_links(pod, {"fsdp": 4}), "data": links.dcn_link(pod)}
    pred = step_time.predict_step(TEXT, "v5e", MESH, known)
    dcn = [c for c in pred.collectives if c.axis == "data"]
    assert len(dcn) == 4 and sum(c.comm_s for c in dcn) == pytest.approx(
        (153.25 * 1024 + 4) / pod.chip.dcn_bytes_per_s)
    assert pred.axes["data"].exposed_s > 0
    assert "axis data (DCN): communication" in pred.table()
    assert "data (DCN) (" in draw.timeline_svg([("manual", pred)], "hsdp")


def test_without_the_megascale_attribute_no_dcn_collective():
    plain = hlo.ledger(TEXT.replace(TYPE, ""), {"fsdp": 4})  # host transfers, not collectives
    assert plain.dcn == () and [r.name for r in plain] == ["all-reduce.10"]


@pytest.mark.parametrize("old, new, message", [
    (TYPE, '_xla_megascale_transfer_type="ALL_SHUFFLE"',
     r"^megascale send %send(\.\d)? in %main\.61_spmd: _xla_megascale_transfer_type='ALL_SHUFFLE' is not one of "),
    ('recv(%after-all.3), channel_id=7, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name='
     '"xla_megascale_runtime",_xla_host_transfer_rendezvous="psum_invariant.135_0"',
     'recv(%after-all.3), channel_id=7, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name='
     '"xla_megascale_runtime",_xla_host_transfer_rendezvous="other_0"',
     r"^megascale send %send\.3 in %main\.61_spmd: no recv and recv-done share its "),
])
def test_a_malformed_transfer_raises_one_line(old, new, message):
    assert old in TEXT
    with pytest.raises(ValueError, match=message) as err:
        hlo.ledger(TEXT.replace(old, new), MESH)
    assert "\n" not in str(err.value)


def test_a_mesh_that_is_not_across_the_slices_raises_one_line():
    with pytest.raises(ValueError, match=r"^the program sends collectives across slices but the mesh "
                                         r"\{'fsdp': 4\} is one slice's") as err:
        hlo.ledger(TEXT, {"fsdp": 4})
    assert "\n" not in str(err.value)


def test_the_manual_twin_compiled_for_two_v5e_slices():
    """The real AOT compile (v5e:2x2 x 2 slices, preset tiny at 4 layers; libtpu, the tpu extra): its DCN rows
    are the cost model's across slices, and the schedule shows what docs/slices.md says: hsdp_gather's
    pmean of each layer's gradient shards crosses DCN inside the backward layer loop, beside that loop's
    compute. XLA peeled the loop's first iteration (its counter starts at 1: 3 runs of the 4 layers)."""
    import dataclasses

    from launch.collectives import collectives
    from twinshard.config import preset
    from twinshard.hardware import topology

    tiny = preset("tiny")
    cfg = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, num_layers=4))
    devices = topology.devices("v5e:2x2", num_slices=2)
    res = collectives("hsdp", "manual", None, cfg, devices, dcn_spec="data:2")
    led = res["ledger"]
    assert res["mesh"] == MESH and led.dcn == ("data",) and not led.unparsed
    assert {r.op for r in led.filter(axes="data")} == {"all-reduce"}
    assert led.total_bytes("data") == sum(r.bytes for r in res["model"].collectives if "data" in r.axes)
    # one layer's gradient shards, f32: q, k, v, o [64, 64] and w1, w3, w2 [64, 192], each / fsdp 4
    layer = (4 * 64 * 64 + 3 * 64 * 192) // 4 * 4
    in_loop, = [r for r in led.filter(axes="data") if re.search(rf"body=%{re.escape(r.computation)}(?![\w.])", res["hlo"])]
    assert (in_loop.bytes, in_loop.multiplicity) == (layer, 3)
    window, = [w for w in schedule(res["hlo"], MESH).windows() if w.axes == ("data",) and w.start == in_loop.name]
    assert window.computation == in_loop.computation and any(n.startswith("fusion") for n in window.inside)


def test_launch_collectives_refuses_the_gspmd_twin_across_slices_in_one_line():
    from types import SimpleNamespace

    from launch.collectives import check_flags
    from twinshard.config import preset

    flags = SimpleNamespace(impl="auto,manual", strategy="hsdp", topology="v5e:2x2", dcn_mesh="data:2", mesh=None,
                            json=None, hlo=None, timeline=None, trace=None, force=False)
    with pytest.raises(ValueError, match=r"^--impl=auto,manual with --dcn_mesh=data:2 --topology=v5e:2x2: libtpu "
                                         r"does not compile the GSPMD twin across slices .*pass --impl=manual") as err:
        check_flags(flags, preset("tiny"))
    assert "\n" not in str(err.value)
    _, pod = check_flags(SimpleNamespace(**{**vars(flags), "impl": "manual"}), preset("tiny"))
    assert pod.slices == 2  # compiled for 2 slices of v5e:2x2
