"""The collective ledger on hand-written HLO of every format and on real programs.

(a) Snippets: every replica-group format, async pairs, async wrappers, TPU
    fusions, while loops, tuple all-reduce, permutes, malformed lines. Each
    snippet is also fed through XLA's own HLO parser and printer (when jaxlib
    exposes it), proving the fixture is valid HLO and that the ledger does not
    change when XLA re-prints it (the printer turns `async-start` into
    `reduce-scatter-start` and drops the wrapped computation).
(b) Real shard_map / GSPMD programs on a 2x4 ('data', 'tensor') mesh of the 8
    simulated CPU devices, whose collectives are known by construction.
    Partition ids are row-major mesh positions: 'data' groups are
    {0,4},{1,5},{2,6},{3,7}; 'tensor' groups are {0,1,2,3},{4,5,6,7}.

Measured (JAX 0.12.0.1, XLA:CPU): `--xla_backend_optimization_level=0` (set in
conftest) changes nothing asserted here: the same ops, groups, shapes, bytes,
multiplicities, tuple-combined all-reduce and tuple all-to-all with and without it.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twinshard import hlo
from twinshard.testing import (expect_bytes, expect_collectives, expect_no_collective, expect_parsed,
                                expect_permute)

SNIPPETS = pathlib.Path(__file__).parent / "hlo_snippets"
MESH = {"data": 2, "tensor": 4}
DATA_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))
TENSOR_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
RING_TENSOR = tuple((i, (i + 1) % 4) for i in range(4)) + tuple((4 + i, 4 + (i + 1) % 4) for i in range(4))


def module(*lines: str, comps: str = "") -> str:
    """A small HLO module: `%add`, extra computations, and an ENTRY holding `lines`."""
    body = "\n".join("  " + line for line in lines)
    return f"""HloModule snippet, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}}
{comps}
ENTRY %main {{
  %p = f32[4,4]{{1,0}} parameter(0)
  %q = f32[8,4]{{1,0}} parameter(1)
{body}
  ROOT %out = f32[] constant(0)
}}
"""


def all_reduce(groups: str, name: str = "ar") -> str:
    return (f"%{name} = f32[4,4]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
            "use_global_device_ids=true, to_apply=%add")


def only(led: hlo.Ledger) -> hlo.Collective:
    expect_parsed(led)
    assert len(led) == 1, led.table()
    return led[0]


# ----------------------------------------------------------------------------- (a) snippets

GROUP_FORMATS = {
    # format: (replica_groups text, groups, axes, partial axes)
    "explicit data": ("{{0,4},{1,5},{2,6},{3,7}}", DATA_GROUPS, ("data",), ()),
    "explicit tensor": ("{{0,1,2,3},{4,5,6,7}}", TENSOR_GROUPS, ("tensor",), ()),
    "explicit all": ("{{0,1,2,3,4,5,6,7}}", (tuple(range(8)),), ("data", "tensor"), ()),
    "empty = all": ("{}", (tuple(range(8)),), ("data", "tensor"), ()),
    "iota transposed": ("[4,2]<=[2,4]T(1,0)", DATA_GROUPS, ("data",), ()),
    "iota plain": ("[2,4]<=[8]", TENSOR_GROUPS, ("tensor",), ()),
    "iota one group": ("[1,8]<=[8]", (tuple(range(8)),), ("data", "tensor"), ()),
    "explicit sub-axis": ("{{0,2},{1,3},{4,6},{5,7}}", ((0, 2), (1, 3), (4, 6), (5, 7)),
                          ("tensor",), ("tensor",)),
    # Each axis fully covered, but a group holds 4 of the 8 (data, tensor) pairs: partial
    # over both (an "every coordinate appears" check alone would call it the whole mesh).
    "explicit diagonal": ("{{0,2,5,7},{1,3,4,6}}", ((0, 2, 5, 7), (1, 3, 4, 6)),
                          ("data", "tensor"), ("data", "tensor")),
    "explicit singletons": ("{{0},{1},{2},{3},{4},{5},{6},{7}}", tuple((i,) for i in range(8)), (), ()),
    "mesh tensor": ("mesh['data'=2,'tensor'=4] {'tensor'}", TENSOR_GROUPS, ("tensor",), ()),
    "mesh data": ("mesh['data'=2,'tensor'=4] {'data'}", DATA_GROUPS, ("data",), ()),
    "mesh both": ("mesh['data'=2,'tensor'=4] {'data','tensor'}", (tuple(range(8)),),
                  ("data", "tensor"), ()),
    # No axes listed = no communication (inferred; never printed here).
    "mesh none = singletons": ("mesh['data'=2,'tensor'=4] {}", tuple((i,) for i in range(8)), (), ()),
    # GSPMD renames axes: classified by mesh coordinates, not by name.
    "mesh renamed": ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", DATA_GROUPS, ("data",), ()),
    # Shardy sub-axis (pre)size: (1)2 = major half of tensor, (2)2 = minor half.
    "mesh sub-axis major": ("mesh['data'=2,'tensor'=4] {'tensor':(1)2}",
                            ((0, 2), (1, 3), (4, 6), (5, 7)), ("tensor",), ("tensor",)),
    "mesh sub-axis minor": ("mesh['data'=2,'tensor'=4] {'tensor':(2)2}",
                            ((0, 1), (2, 3), (4, 5), (6, 7)), ("tensor",), ("tensor",)),
    # Accepted by XLA's parser but never printed by JAX 0.12 here; semantics inferred.
    "mesh device_ids": ("mesh['data'=2,'tensor'=4], device_ids=(7,6,5,4,3,2,1,0) {'data'}",
                        ((7, 3), (6, 2), (5, 1), (4, 0)), ("data",), ()),
}


@pytest.mark.parametrize("fmt", list(GROUP_FORMATS))
def test_replica_group_formats(fmt: str) -> None:
    text, groups, axes, partial = GROUP_FORMATS[fmt]
    r = only(hlo.ledger(module(all_reduce(text)), MESH))
    assert r.replica_groups == groups
    assert (r.axes, r.partial_axes) == (axes, partial)
    assert r.group_size == len(groups[0])
    assert r.bytes == 64 and r.ring_bytes == pytest.approx(2 * (r.group_size - 1) / r.group_size * 64)


@pytest.mark.parametrize("mesh_text, iota", [
    # Same real program (a GSPMD reshape-then-sum), printed with
    # --xla_enable_rgv3_materialization on (mesh text) and off (iota).
    ("mesh['data'=2,'tensor'=4] {'tensor':(1)2}", "[4,2]<=[4,2]T(1,0)"),
    ("mesh['data'=2,'tensor'=4] {'tensor':(2)2}", "[4,2]<=[8]"),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", "[4,2]<=[2,4]T(1,0)"),
])
def test_mesh_format_matches_iota_measured_pairs(mesh_text: str, iota: str) -> None:
    a = only(hlo.ledger(module(all_reduce(mesh_text)), MESH))
    b = only(hlo.ledger(module(all_reduce(iota)), MESH))
    assert sorted(a.replica_groups) == sorted(b.replica_groups)
    assert (a.axes, a.partial_axes) == (b.axes, b.partial_axes)


def test_gpu_async_pairs_counted_once() -> None:
    led = hlo.ledger((SNIPPETS / "gpu_async.hlo").read_text(), MESH)
    expect_parsed(led)
    by_op = {r.op: r for r in led}
    assert sorted(by_op) == sorted(["all-gather", "all-reduce", "collective-permute",
                                    "reduce-scatter", "all-to-all"])
    assert len(led) == 7 and all(r.is_async and r.multiplicity == 1 for r in led)
    ag = led.filter(op="all-gather", axes="tensor")[0]
    assert (ag.shape, ag.bytes, ag.name) == ((16, 4), 256, "all-gather-start")
    assert ag.ring_bytes == pytest.approx(0.75 * 256)
    assert ag.source == "/src/manual_parallel/tp.py:42"  # old-style source_file metadata
    assert by_op["all-reduce"].axes == ("data",)
    assert by_op["collective-permute"].source_target_pairs == RING_TENSOR
    rs = by_op["reduce-scatter"]  # inside the async-start's computation
    assert (rs.shape, rs.axes, rs.ring_bytes) == ((4, 4), ("data",), 64.0)
    combined = led.filter(op="all-gather", axes="data")  # 2-operand start/done: split
    assert [(r.shape, r.tuple_index) for r in combined] == [((8, 4), 0), ((16, 4), 1)]


def test_call_sites_add_and_conditional_branches_count_once() -> None:
    led = hlo.ledger((SNIPPETS / "call_conditional.hlo").read_text(), MESH)
    expect_parsed(led)
    assert {r.name: r.multiplicity for r in led} == {
        "called_psum": 2, "then_gather": 1, "else_permute": 1}
    assert led.filter(op="all-gather")[0].axes == ()  # singleton groups: no communication


def test_tpu_async_collective_fusion_counted_once() -> None:
    led = hlo.ledger((SNIPPETS / "tpu_async_collective_fusion.hlo").read_text(), MESH)
    r = only(led)
    assert (r.op, r.dtype, r.shape, r.bytes, r.axes) == ("all-gather", "bf16", (16, 256), 8192, ("tensor",))
    assert r.is_async and r.multiplicity == 1


def test_a_start_fed_by_another_collectives_chain_is_its_own_collective() -> None:
    led = hlo.ledger((SNIPPETS / "tpu_async_chunks.hlo").read_text(), {"data": 4, "tensor": 2})
    assert sorted(r.name for r in led) == ["all-reduce.1", "all-reduce.3"], led.table()  # .2 is .1's copy
    assert led.count("all-reduce", axes="tensor") == 2


TPU_16 = {"data": 16, "tensor": 1}  # tpu_async_collective_done_fusion.hlo: v5e:4x4, 16 partitions
DONE_FUSION = "tpu_async_collective_done_fusion.hlo"


def test_tpu_async_collective_done_fusion_counted_once() -> None:
    # Real v5e:4x4 HLO: one async all-gather printed in three computations (start,
    # continuation, done; same channel_id) and one sync all-gather: 2 records, not 4, and no
    # "%fused_computation.18 has no caller" warning (the done's computation).
    led = hlo.ledger((SNIPPETS / DONE_FUSION).read_text(), TPU_16)
    expect_parsed(led)
    assert not led.warnings, led.table()
    assert {r.name: r.multiplicity for r in led} == {"all-gather.25": 1, "all-gather.30": 1}
    assert led.count("all-gather", axes="data") == 2
    ag = {r.name: r for r in led}
    start, sync = ag["all-gather.25"], ag["all-gather.30"]
    assert start.computation == "fused_computation.16" and start.is_async and not sync.is_async
    for r in (start, sync):
        assert (r.dtype, r.shape, r.bytes, r.axes, r.group_size) == (
            "bf16", (256, 256), 131072, ("data",), 16)
        assert r.source == "/tmp/acd/gen.py:13"


def test_tpu_async_done_fusion_found_by_root_custom_call() -> None:
    # The done computation is recognised by its ROOT custom-call, not only by the
    # caller's name: rename the done fusion and the count is unchanged.
    text = (SNIPPETS / DONE_FUSION).read_text().replace("%async-collective-done", "%fusion.99")
    led = hlo.ledger(text, TPU_16)
    assert not led.warnings and sorted(r.name for r in led) == ["all-gather.25", "all-gather.30"]


def test_tpu_async_done_fusion_without_start_is_counted_with_warning() -> None:
    # A done-side collective that matches no start (by channel_id) is not dropped.
    text = (SNIPPETS / DONE_FUSION).read_text()
    done = text.index("%fused_computation.18 (")
    text = text[:done] + text[done:].replace("channel_id=4,", "channel_id=44,", 1)
    led = hlo.ledger(text, TPU_16)
    assert sorted(r.name for r in led) == ["all-gather.25", "all-gather.29", "all-gather.30"]
    assert len(led.warnings) == 1 and "%all-gather.29 matches no async start" in led.warnings[0]


def test_tpu_async_continuation_not_fed_by_start_is_counted_with_warning() -> None:
    # Copies are found by data flow from the start fusion. Cut the flow into the
    # continuation: its all-gather now counts (warned); the done is still a copy.
    text = (SNIPPETS / DONE_FUSION).read_text().replace(
        "fusion(%get-tuple-element.4,", "fusion(%convert_element_type.13,", 1)
    led = hlo.ledger(text, TPU_16)
    assert sorted(r.name for r in led) == ["all-gather.25", "all-gather.27", "all-gather.30"]
    assert len(led.warnings) == 1 and "%all-gather.27 in %async_collective_fusion.19" in led.warnings[0]


def test_while_known_trip_count_and_nesting() -> None:
    led = hlo.ledger((SNIPPETS / "nested_while.hlo").read_text(), MESH)
    expect_parsed(led)
    inner, outer = led.filter(axes="tensor")[0], led.filter(axes="data")[0]
    assert (inner.multiplicity, outer.multiplicity) == (6, 2)
    assert inner.multiplicity_exact and not led.warnings
    assert led.summary()[("all-reduce", ("tensor",))] == {"count": 6, "bytes": 6 * 64,
                                                          "ring_bytes": 6 * 96.0}
    expect_collectives(led, "all-reduce", axes=("tensor",), count=6)


def test_single_while_trip_count_3() -> None:
    body = ("%body (b: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {\n"
            "  %b = (s32[], f32[4,4]{1,0}) parameter(0)\n"
            "  %v = f32[4,4]{1,0} get-tuple-element(%b), index=1\n"
            "  %i = s32[] get-tuple-element(%b), index=0\n"
            "  %ar = f32[4,4]{1,0} all-reduce(%v), channel_id=1, replica_groups=[2,4]<=[8], "
            "use_global_device_ids=true, to_apply=%add\n"
            "  ROOT %t = (s32[], f32[4,4]{1,0}) tuple(%i, %ar)\n}\n"
            "%cond (c: (s32[], f32[4,4])) -> pred[] {\n"
            "  %c = (s32[], f32[4,4]{1,0}) parameter(0)\n"
            "  ROOT %k = pred[] constant(true)\n}\n")
    text = module("%z = s32[] constant(0)", "%init = (s32[], f32[4,4]{1,0}) tuple(%z, %p)",
                  '%w = (s32[], f32[4,4]{1,0}) while(%init), condition=%cond, body=%body, '
                  'backend_config={"known_induction_variable":{"tuple_index":"0"},'
                  '"known_trip_count":{"n":"3"}}', comps=body)
    r = only(hlo.ledger(text, MESH))
    assert (r.multiplicity, r.computation, r.multiplicity_exact) == (3, "body", True)


def test_tpu_while_without_trip_count_is_inferred_and_flagged() -> None:
    # Real TPU output: libtpu drops known_trip_count; the condition says i < 3.
    led = hlo.ledger((SNIPPETS / "tpu_while_no_trip_count.hlo").read_text(), MESH)
    r = only(led)
    assert (r.multiplicity, r.multiplicity_exact, r.axes) == (3, False, ("tensor",))
    assert any("inferred 3" in w for w in led.warnings)
    assert "3?" in led.table()


def test_a_peeled_while_counts_from_its_counters_first_value() -> None:
    # XLA:TPU peels a loop's first iteration (hsdp's pipelined DCN transfers): the counter starts at 1, copied
    # in, under the same i < 3, so the body runs twice
    text = (SNIPPETS / "tpu_while_no_trip_count.hlo").read_text()
    peeled = text.replace("tuple(%constant.5.clone.1, %param.4,", "tuple(%copy.1, %param.4,").replace(
        "  %tuple.20 = ", "  %copy.1 = s32[]{:T(128)} copy(%constant.0.clone.1)\n  %tuple.20 = ")
    assert peeled.count("%copy.1") == 2
    led = hlo.ledger(peeled, MESH)
    assert (only(led).multiplicity, only(led).multiplicity_exact) == (2, False)
    assert any("inferred 2" in w for w in led.warnings)


def test_tuple_all_reduce_split_per_operand() -> None:
    text = module("%ar = (f32[4,4]{1,0}, f32[8,4]{1,0}) all-reduce(%p, %q), channel_id=1, "
                  "replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, "
                  'to_apply=%add, metadata={op_name="jit(f)/psum" source_file="a.py" source_line=3}',
                  '%g1 = f32[8,4]{1,0} get-tuple-element(%ar), index=1, '
                  'metadata={op_name="jit(f)/psum" source_file="a.py" source_line=9}')
    led = hlo.ledger(text, MESH)
    expect_parsed(led)
    assert [(r.shape, r.bytes, r.tuple_index, r.source) for r in led] == [
        ((4, 4), 64, 0, "a.py:3"), ((8, 4), 128, 1, "a.py:9")]
    expect_collectives(led, "all-reduce", axes="data", count=2)
    expect_bytes(led, "data", 192)


def test_collective_permute_pairs() -> None:
    pairs = "{{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}"
    led = hlo.ledger(module(f"%cp = f32[4,4]{{1,0}} collective-permute(%p), channel_id=1, "
                            f"source_target_pairs={pairs}"), MESH)
    r = only(led)
    assert r.source_target_pairs == RING_TENSOR and r.replica_groups == ()
    assert (r.axes, r.partial_axes, r.ring_bytes) == (("tensor",), (), 64.0)
    swap = only(hlo.ledger(module("%cp = f32[4,4]{1,0} collective-permute(%p), channel_id=1, "
                                  "source_target_pairs={{0,2},{2,0}}"), MESH))
    assert (swap.axes, swap.partial_axes) == (("tensor",), ("tensor",))


# Hand-decoded (partition id = 4 data + tensor on MESH): name -> (pattern, shifts as
# (axis, steps, wrap)). A +1 step is to the next tensor index; 3 -> 0 is +1 around the ring.
PERMUTES = {
    "fwd": ("tensor +1", (("tensor", (1,), False),)),
    "bwd": ("tensor -1", (("tensor", (-1,), False),)),
    "ring": ("tensor ring +1", (("tensor", (1,), True),)),
    "rev": ("tensor ring -1", (("tensor", (-1,), True),)),
    "data_ring": ("data ring +1", (("data", (1,), True),)),  # on 2 devices +1 and -1 are one ring
    # the wrong ones: described per axis, marked irregular
    "extra": ("tensor ring +1 (irregular, 7 pairs)", (("tensor", (1,), True),)),
    "half_ring": ("tensor ring +1 (irregular, 4 pairs)", (("tensor", (1,), True),)),
    "flat": ("data +1, tensor ring +1 (irregular, crosses axes, 7 pairs)",
             (("data", (1,), False), ("tensor", (1,), True))),
    "mixed": ("tensor ring -1/+1 (irregular, 8 pairs)", (("tensor", (-1, 1), True),)),
}


@pytest.fixture(scope="module")
def permutes() -> hlo.Ledger:
    return hlo.ledger((SNIPPETS / "permutes.hlo").read_text(), MESH)


def test_permute_pairs_decoded_to_mesh_coordinates_and_patterns(permutes: hlo.Ledger) -> None:
    expect_parsed(permutes)
    got = {r.name: (r.pattern, tuple((s.axis, s.steps, s.wrap) for s in r.shifts)) for r in permutes}
    assert got == PERMUTES
    by_name = {r.name: r for r in permutes}
    # (data, tensor) coordinates of the pairs, decoded by hand from the ids
    assert by_name["rev"].coordinate_pairs == (((0, 1), (0, 0)), ((0, 2), (0, 1)), ((0, 3), (0, 2)),
                                               ((0, 0), (0, 3)), ((1, 1), (1, 0)), ((1, 2), (1, 1)),
                                               ((1, 3), (1, 2)), ((1, 0), (1, 3)))
    assert by_name["flat"].coordinate_pairs[3] == ((0, 3), (1, 0))
    assert hlo.shift_pairs(MESH, {"tensor": -1}, wrap=True) == frozenset(by_name["rev"].source_target_pairs)
    assert hlo.shift_pairs(MESH, {"tensor": 1}, wrap=False) == frozenset(by_name["fwd"].source_target_pairs)
    # where the user reads it: the table's axes column, the summary, the JSON
    table = permutes.table()
    assert "collective-permute  tensor ring -1  " in table and "collective-permute  tensor +1  " in table
    assert permutes.summary()[("collective-permute", ("tensor",))]["patterns"] == {
        p: 1 for name, (p, _) in PERMUTES.items() if name not in ("data_ring", "flat")}
    assert permutes.patterns("data") == {"data ring +1": 1}
    doc = json.loads(permutes.to_json())
    rev = next(r for r in doc["records"] if r["name"] == "rev")
    assert rev["pattern"] == "tensor ring -1" and rev["shifts"] == [{"axis": "tensor", "steps": [-1], "wrap": True}]


def test_expect_permute_matches_exactly_the_shift(permutes: hlo.Ledger) -> None:
    """Each right permute is found once; the wrong ones (a pair extra, missing, reversed,
    across data rows) match no shift."""
    assert [r.name for r in expect_permute(permutes, {"tensor": +1}, wrap=False, count=1)] == ["fwd"]
    assert [r.name for r in expect_permute(permutes, {"tensor": -1}, wrap=False, count=1)] == ["bwd"]
    assert [r.name for r in expect_permute(permutes, {"tensor": +1}, wrap=True, count=1)] == ["ring"]
    assert [r.name for r in expect_permute(permutes, {"tensor": -1}, wrap=True, count=1)] == ["rev"]
    assert [r.name for r in expect_permute(permutes, {"tensor": +1}, count=2)] == ["fwd", "ring"]
    assert [r.name for r in expect_permute(permutes, {"data": -1}, wrap=True, count=1)] == ["data_ring"]
    expect_permute(permutes, {"tensor": +2}, count=0)
    expect_permute(permutes, {"data": +1, "tensor": +1}, wrap=False, count=0)


@pytest.mark.parametrize("name, shift, wrap", [
    ("extra", {"tensor": +1}, False),  # the line +1 with one extra wrap pair, 3 -> 0
    ("half_ring", {"tensor": +1}, True),  # the ring on data row 0 only: 4 pairs missing
    ("flat", {"tensor": +1}, False),  # 3 -> 4 crosses into the next data row
    ("mixed", {"tensor": +1}, True),  # row 1's ring reversed
])
def test_expect_permute_fails_on_a_wrong_permute(permutes: hlo.Ledger, name: str, shift: dict, wrap: bool) -> None:
    alone = hlo.Ledger([r for r in permutes if r.name == name], permutes.mesh, instructions=permutes.instructions)
    with pytest.raises(AssertionError) as err:
        expect_permute(alone, shift, wrap=wrap)
    message = str(err.value)
    assert message.startswith(f"expected collective-permutes shifting tensor +1 ({'ring' if wrap else 'line, no wrap'}) "
                              f"with min_count=1; found 0 (collective-permutes by pattern: '{PERMUTES[name][0]}' x1)")
    assert message.endswith(alone.table())


def test_other_ops_and_bytes() -> None:
    led = hlo.ledger(module(
        "%ag = bf16[16,4]{1,0} all-gather(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}",
        "%rs = f32[4,4]{1,0} reduce-scatter(%q), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), "
        "dimensions={0}, to_apply=%add",
        "%a2a = f32[4,4]{1,0} all-to-all(%p), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}",
        "%cb = f32[4,4]{1,0} collective-broadcast(%p), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}",
    ), MESH)
    expect_parsed(led)
    got = {r.op: (r.bytes, r.ring_bytes) for r in led}
    assert got == {"all-gather": (128, 96.0), "reduce-scatter": (64, 64.0),
                   "all-to-all": (64, 48.0), "collective-broadcast": (64, 64.0)}


def test_sub_byte_types_are_counted_in_bits() -> None:
    """int4 / fp4 collectives (quantized weights): 4 bits per element, not 0 bytes."""
    led = hlo.ledger(module(
        "%ag = s4[16,4]{1,0} all-gather(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}",
        "%ag2 = f4e2m1fn[8,8]{1,0} all-gather(%p), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}",
    ), MESH)
    assert [r.bytes for r in led] == [16 * 4 * 4 // 8, 8 * 8 * 4 // 8]


MALFORMED = [
    "%bad1 = f32[4,4]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1},{2, to_apply=%add",
    "%bad2 = f32[4,4]{1,0} all-gather(%p), channel_id=2, replica_groups=weird(3), dimensions={0}",
    "%bad3 = f32[4,4]{1,0} all-reduce-scatter(%p), channel_id=3, replica_groups={}",
    "%bad4 = f32[4,4]{1,0} collective-permute(%p), channel_id=4",
]


def test_malformed_lines_are_reported_not_dropped() -> None:
    led = hlo.ledger(module(all_reduce("[2,4]<=[8]", "good"), *MALFORMED), MESH)
    assert [r.name for r in led] == ["good"]
    assert len(led.unparsed) == len(MALFORMED)
    for bad, line in zip(MALFORMED, led.unparsed):
        assert line.startswith(bad)
    assert f"unparsed: {len(MALFORMED)}" in led.table()
    with pytest.raises(AssertionError, match="not parsed") as err:
        expect_parsed(led)
    assert "bad2" in str(err.value)


def _roundtrip_cases() -> list[tuple[str, str]]:
    cases = [(f"groups: {k}", module(all_reduce(v[0]))) for k, v in GROUP_FORMATS.items()]
    return cases + [(p.name, p.read_text()) for p in sorted(SNIPPETS.glob("*.hlo"))]


@pytest.mark.parametrize("name, text", _roundtrip_cases(), ids=lambda x: x if len(x) < 60 else "")
def test_snippets_are_valid_hlo_and_survive_xla_reprint(name: str, text: str) -> None:
    from jaxlib import _hlo  # XLA's own HLO parser/printer (private API, present in jaxlib 0.12)

    printed = _hlo.hlo_module_from_text(text).to_string()

    def key(led: hlo.Ledger) -> list[tuple]:
        return sorted((r.op, r.axes, r.shape, r.bytes, r.multiplicity,
                       tuple(sorted(r.replica_groups)), r.source_target_pairs, r.pattern) for r in led)

    two_stages = {"stage": 2}  # each snippet's own partitions
    mesh = {DONE_FUSION: TPU_16, "tick_loop.hlo": two_stages, "tick_loop_nested.hlo": two_stages}.get(name, MESH)
    a, b = hlo.ledger(text, mesh), hlo.ledger(printed, mesh)
    expect_parsed(a)
    expect_parsed(b)
    assert key(a) == key(b), f"{a.table()}\n---\n{b.table()}"


# ----------------------------------------------------------------------------- (b) real programs


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)


def compile_sm(mesh: Mesh, f, in_spec: P, out_specs, shape: tuple[int, ...]) -> jax.stages.Compiled:
    """jit(shard_map(f)) lowered for one f32 argument of global `shape` placed by `in_spec`."""
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_specs))
    arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, in_spec))
    return fn.lower(arg).compile()


def test_all_gather_over_tensor(mesh: Mesh) -> None:
    def f(x):  # x: [8/data, 16/tensor] = [4, 4]
        return lax.all_gather(x, "tensor", axis=0, tiled=True)  # [16, 4]
    led = hlo.ledger(compile_sm(mesh, f, P("data", "tensor"), P("data", "tensor"), (8, 16)), mesh)
    r = only(led)
    assert (r.op, r.axes, r.group_size, r.replica_groups) == ("all-gather", ("tensor",), 4, TENSOR_GROUPS)
    assert (r.dtype, r.shape, r.bytes, r.ring_bytes) == ("f32", (16, 4), 256, 192.0)
    assert "test_hlo.py:" in r.source and r.op_name.endswith("all_gather")
    expect_collectives(led, "all-gather", axes=("tensor",), count=1)
    expect_bytes(led, ("tensor",), 192, kind="ring_bytes")


def test_psum_scatter_over_data(mesh: Mesh) -> None:
    # Measured: shard_map's psum_scatter compiles to a real `reduce-scatter` on
    # XLA:CPU (it is GSPMD's FSDP backward that becomes all-reduce + slice).
    def f(x):  # x: [8, 16/tensor] = [8, 4]
        return lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True)  # [4, 4]
    led = hlo.ledger(compile_sm(mesh, f, P(None, "tensor"), P("data", "tensor"), (8, 16)), mesh)
    r = only(led)
    assert (r.op, r.axes, r.replica_groups, r.shape) == ("reduce-scatter", ("data",), DATA_GROUPS, (4, 4))
    assert (r.bytes, r.ring_bytes) == (64, 64.0)  # (n-1) x result, n = 2


def test_ppermute_ring_over_tensor(mesh: Mesh) -> None:
    def f(x):
        return lax.ppermute(x, "tensor", [(i, (i + 1) % 4) for i in range(4)])
    r = only(hlo.ledger(compile_sm(mesh, f, P("data", "tensor"), P("data", "tensor"), (8, 16)), mesh))
    assert r.op == "collective-permute" and r.axes == ("tensor",)
    assert sorted(r.source_target_pairs) == sorted(RING_TENSOR)
    assert r.pattern == "tensor ring +1" and r.shifts == (hlo.Shift("tensor", (1,), True),)
    assert r.ring_bytes == r.bytes == 64


def test_psum_in_scan_has_multiplicity_3(mesh: Mesh) -> None:
    def f(x):
        y, _ = lax.scan(lambda c, _: (c + lax.psum(c, "tensor"), None), x, None, length=3)
        return y
    led = hlo.ledger(compile_sm(mesh, f, P("data", "tensor"), P("data", "tensor"), (8, 16)), mesh)
    r = only(led)
    assert (r.op, r.axes, r.multiplicity, r.multiplicity_exact) == ("all-reduce", ("tensor",), 3, True)
    assert "main" not in r.computation  # it lives in the while body
    expect_collectives(led, "all-reduce", axes="tensor", count=3)
    expect_bytes(led, "tensor", 3 * 64)
    assert led.summary() == {("all-reduce", ("tensor",)): {"count": 3, "bytes": 192, "ring_bytes": 288.0}}


def test_psum_over_both_axes(mesh: Mesh) -> None:
    def f(x):
        return lax.psum(x, ("data", "tensor"))
    r = only(hlo.ledger(compile_sm(mesh, f, P("data", "tensor"), P(), (8, 16)), mesh))
    assert (r.axes, r.partial_axes, r.replica_groups) == (("data", "tensor"), (), (tuple(range(8)),))
    assert r.ring_bytes == pytest.approx(2 * 7 / 8 * 64)


def test_two_psums_combined_into_tuple_all_reduce(mesh: Mesh) -> None:
    def f(x):
        a = lax.psum(x, "data")
        b = lax.psum(2 * x, "data")
        return a + b
    compiled = compile_sm(mesh, f, P("data", "tensor"), P(None, "tensor"), (8, 16))
    assert ") all-reduce(" in compiled.as_text()  # measured: the CPU combiner tuples them
    led = hlo.ledger(compiled, mesh)
    expect_parsed(led)
    assert [r.tuple_index for r in led] == [0, 1] and led[0].name == led[1].name
    assert led[0].source != led[1].source  # each psum keeps its own line
    expect_collectives(led, "all-reduce", axes="data", count=2)


def test_all_to_all_is_one_tuple_collective_on_cpu(mesh: Mesh) -> None:
    def f(x):  # x: [4, 4] -> [1, 16]: split dim 0 across tensor, concat on dim 1
        return lax.all_to_all(x, "tensor", 0, 1, tiled=True)
    r = only(hlo.ledger(compile_sm(mesh, f, P("data", "tensor"), P("data", "tensor"), (8, 16)), mesh))
    # Measured: XLA:CPU prints a 4-operand tuple all-to-all (one part per peer).
    assert (r.op, r.axes, r.parts, r.shape, r.bytes, r.ring_bytes) == (
        "all-to-all", ("tensor",), 4, (1, 4), 64, 48.0)


def test_gspmd_programs_mix_mesh_and_iota_formats() -> None:
    auto = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)

    def sds(shape: tuple[int, ...], spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(auto, spec))

    contract = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(auto, P()))
    c1 = contract.lower(sds((8, 16), P(None, "data")), sds((16, 8), P("data", None))).compile()
    fsdp = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(auto, P(None, "tensor")))
    c2 = fsdp.lower(sds((8, 16), P()), sds((16, 8), P("data", "tensor"))).compile()
    # Measured formats: GSPMD renames the axes in the mesh text; the second uses iota.
    assert "mesh['axis_0'=2,'axis_1'=4] {'axis_0'}" in c1.as_text()
    assert "replica_groups=[4,2]<=[2,4]T(1,0)" in c2.as_text()
    for c in (c1, c2):
        r = only(hlo.ledger(c, auto))
        assert (r.op, r.axes, r.replica_groups) == ("all-reduce", ("data",), DATA_GROUPS)


def test_gspmd_sub_axis_groups() -> None:
    auto = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    f = jax.jit(lambda x: x.reshape(4, 2, 8).sum(1), out_shardings=NamedSharding(auto, P()))
    arg = jax.ShapeDtypeStruct((4, 16), jnp.float32, sharding=NamedSharding(auto, P(None, "tensor")))
    led = hlo.ledger(f.lower(arg).compile(), auto)
    expect_parsed(led)
    ar, ag = led.filter(op="all-reduce")[0], led.filter(op="all-gather")[0]
    # The reshape splits 'tensor' in two: the sum runs over its major half.
    assert ar.replica_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert ag.replica_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert ar.axes == ag.axes == ar.partial_axes == ag.partial_axes == ("tensor",)


def test_ids_are_mesh_positions_not_device_ids() -> None:
    reversed_mesh = Mesh(np.array(jax.devices())[::-1].reshape(2, 4), ("data", "tensor"),
                         axis_types=(AxisType.Explicit,) * 2)
    c = compile_sm(reversed_mesh, lambda x: lax.ppermute(x, "data", [(0, 1), (1, 0)]),
                   P("data", "tensor"), P("data", "tensor"), (8, 16))
    r = only(hlo.ledger(c, reversed_mesh))
    assert sorted(r.source_target_pairs) == sorted([(i, i + 4) for i in range(4)] +
                                                   [(i + 4, i) for i in range(4)])
    assert r.axes == ("data",)


# ----------------------------------------------------------------------------- API and helpers


@pytest.fixture(scope="module")
def mixed(mesh: Mesh) -> hlo.Ledger:
    def f(x):  # x: [4, 4]
        g = lax.all_gather(x, "tensor", axis=0, tiled=True)  # [16, 4]
        s = lax.psum(x, "data")  # [4, 4]
        return g, s
    return hlo.ledger(compile_sm(mesh, f, P("data", "tensor"), (P("data", "tensor"), P(None, "tensor")),
                                 (8, 16)), mesh)


def test_helpers_pass_when_they_should(mixed: hlo.Ledger) -> None:
    expect_parsed(mixed)
    assert len(expect_collectives(mixed, "all-gather", axes=("tensor",), count=1)) == 1
    expect_collectives(mixed, "all-reduce", axes="data", min_count=1, max_count=1)
    expect_collectives(mixed, "all-reduce")
    expect_no_collective(mixed, "reduce-scatter")
    expect_no_collective(mixed, "all-reduce", axes="tensor")
    expect_no_collective(mixed, "all-reduce", larger_than=64)
    expect_no_collective(mixed, axes=("data", "tensor"))
    assert expect_bytes(mixed, "tensor", 256, op="all-gather") == 256
    expect_bytes(mixed, ("data",), 64.5, rel=0.01)
    expect_bytes(mixed, "tensor", 192, kind="ring_bytes")


@pytest.mark.parametrize("call", [
    lambda led: expect_collectives(led, "all-gather", axes="tensor", count=2),
    lambda led: expect_collectives(led, "all-gather", axes=("data",)),  # exact axes only
    lambda led: expect_collectives(led, "all-reduce", axes=("data", "tensor")),
    lambda led: expect_collectives(led, "all-reduce", max_count=0),
    lambda led: expect_no_collective(led, "all-reduce", larger_than=63),
    lambda led: expect_no_collective(led),
    lambda led: expect_bytes(led, "tensor", 200, op="all-gather"),
    lambda led: expect_bytes(led, "data", 0),
])
def test_helpers_raise_with_table(mixed: hlo.Ledger, call) -> None:
    with pytest.raises(AssertionError) as err:
        call(mixed)
    message = str(err.value)
    assert mixed.table() in message
    assert "all-gather" in message and "unparsed: 0" in message


def test_ledger_api(mixed: hlo.Ledger, mesh: Mesh) -> None:
    assert mixed.summary() == {("all-gather", ("tensor",)): {"count": 1, "bytes": 256, "ring_bytes": 192.0},
                               ("all-reduce", ("data",)): {"count": 1, "bytes": 64, "ring_bytes": 64.0}}
    assert mixed.total_bytes() == 320 and mixed.total_bytes(axes="data", op="all-reduce") == 64
    assert len(mixed.filter(axes=("tensor", "data"))) == 0
    assert mixed.count("all-gather", "tensor") == 1
    data = json.loads(mixed.to_json())
    assert data["mesh"] == MESH and len(data["records"]) == 2 and data["unparsed"] == []
    assert {(s["op"], tuple(s["axes"])) for s in data["summary"]} == set(mixed.summary())
    table = mixed.table().splitlines()
    assert table[0].split()[:3] == ["op", "axes", "count"] and table[-1].endswith("unparsed: 0")
    with pytest.raises(ValueError, match="not mesh axes"):
        mixed.filter(axes="date")
    with pytest.raises(ValueError, match="unknown collective"):
        mixed.filter(op="allreduce")


def test_mesh_inputs_and_mismatch(mesh: Mesh) -> None:
    compiled = compile_sm(mesh, lambda x: lax.psum(x, "data"), P("data", "tensor"), P(None, "tensor"),
                          (8, 16))
    assert hlo.ledger(compiled, mesh).records == hlo.ledger(compiled, MESH).records
    assert hlo.ledger(compiled.as_text(), mesh).records == hlo.ledger(compiled, mesh).records
    with pytest.raises(ValueError, match="num_partitions=8"):
        hlo.ledger(compiled, {"data": 4})
    with pytest.raises(TypeError, match="compile"):
        hlo.ledger(jax.jit(lambda x: x).lower(1.0), mesh)
