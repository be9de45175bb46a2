"""The schedule reader (twinshard/hlo/schedule.py) on hand-written HLO whose answers are known by construction:
which instructions each collective's window holds, and which done completes which start when async
collectives overlap, nest, or cross a while loop's boundary, in every async form the reader knows:
`all-reduce-start`/`-done`, `all-gather-start`/`-done`, `collective-permute-start`/`-done`, the generic
`async-start`/`async-update`/`async-done` wrapper, and TPU async collective fusion chains.

The snippets live in tests/hlo_snippets/ (tests/test_hlo.py checks that XLA's own parser reads each one and
that its reprint gives the same ledger). Nothing here compiles.
"""

from __future__ import annotations

import pathlib

import pytest

from twinshard import hlo
from twinshard.hlo.schedule import phase

SNIPPETS = pathlib.Path(__file__).parent / "hlo_snippets"
MESH = {"data": 2, "tensor": 4}  # partition id = 4 data + tensor


def read(name: str, mesh: dict[str, int] = MESH) -> hlo.Schedule:
    sched = hlo.schedule((SNIPPETS / name).read_text(), mesh)
    assert sched.scheduled and sched.warnings == []
    return sched


def as_rows(seq: hlo.Sequence) -> dict[str, tuple]:
    """start -> (finish, op, axes, inside, continuations, carried): what a window claims, by names."""
    return {w.start: (w.finish, w.op, w.axes, w.inside, w.continuations, w.carried) for w in seq.windows}


def each_record_in_one_window(sched: hlo.Schedule) -> None:
    """Every ledger record is timed, in exactly one window, as the same object (no copy, no stray)."""
    timed = [id(r) for w in sched.windows() for r in w.records]
    assert sorted(timed) == sorted(id(r) for r in sched.ledger.records)


def test_overlapping_and_nested_async_pairs_complete_where_their_own_done_is():
    """schedule_overlap.hlo: the all-gather and all-reduce cross (each done takes its own start, not the
    latest one); two all-gathers cross, completed first in, first out; a collective-permute holds a whole
    async-start wrapper and, in that, another collective-permute completed last in, first out. A window
    lists the non-free instructions strictly between its start and its done, in schedule order: the other
    collectives' starts, updates and dones among them; the constant, get-tuple-element and async copy
    in them take no time and are not listed."""
    sched = read("schedule_overlap.hlo")
    rows = as_rows(sched.entry)
    assert rows == {
        # crossing, two kinds: %ar-start is issued after %ag-start and completes after %ag-done
        "ag-start": ("ag-done", "all-gather", ("tensor",), ("ar-start", "mm1"), (), False),
        "ar-start": ("ar-done", "all-reduce", ("data",), ("mm1", "ag-done", "mm2"), (), False),
        # crossing, one kind: first in, first out
        "agd-start": ("agd-done", "all-gather", ("data",), ("agt-start", "mm3"), (), False),
        "agt-start": ("agt-done", "all-gather", ("tensor",), ("mm3", "agd-done"), (), False),
        # nested: the permute over tensor around the async wrapper around the permute over data
        "cp-start": ("cp-done", "collective-permute", ("tensor",),
                     ("mm4", "rs-start", "mm5", "cpd-start", "rs-update", "mm6", "cpd-done", "rs-done", "mm7"),
                     (), False),
        "rs-start": ("rs-done", "reduce-scatter", ("data",), ("mm5", "cpd-start", "rs-update", "mm6", "cpd-done"),
                     ("rs-update",), False),
        "cpd-start": ("cpd-done", "collective-permute", ("data",), ("rs-update", "mm6"), (), False),
        "sync": ("sync", "all-reduce", ("tensor",), (), (), False),
    }
    order = [i.name for i in sched.entry.order]
    for w in sched.entry.windows:  # positions agree with the names
        assert (order[w.issue], order[w.done]) == (w.start, w.finish)
        assert w.synchronous == (w.start == "sync")
    # the wrapper's record is the reduce-scatter inside the computation it calls
    rs = next(w for w in sched.entry.windows if w.start == "rs-start")
    # its computation is called from the start and from the done: it runs once a start, not once more a done
    assert [(r.name, r.computation, r.shape, r.multiplicity) for r in rs.records] == [("rs", "async_rs", (4, 4), 1)]
    each_record_in_one_window(sched)


def test_window_sizes_are_their_records():
    """A window's result, bytes and ring bytes are its records' (the all-gather's result, f32[16,4] = 256 B,
    3/4 of it sent on a ring of 4; the all-reduce's f32[4,4] = 64 B, 2 x 1/2 of it on a ring of 2)."""
    sched = read("schedule_overlap.hlo")
    by_start = {w.start: w for w in sched.entry.windows}
    assert (by_start["ag-start"].tensor, by_start["ag-start"].bytes, by_start["ag-start"].ring_bytes) == \
        ("f32[16,4]", 256, 192.0)
    assert (by_start["ar-start"].tensor, by_start["ar-start"].bytes, by_start["ar-start"].ring_bytes) == \
        ("f32[4,4]", 64, 64.0)
    assert (by_start["rs-start"].bytes, by_start["rs-start"].ring_bytes) == (64, 64.0)  # (n - 1) x result
    assert (by_start["cpd-start"].bytes, by_start["cpd-start"].ring_bytes) == (64, 64.0)  # the whole buffer
    # each result shape read from its own done (the two crossing all-gathers differ in group and size)
    assert {w.start: w.tensor for w in sched.entry.windows} == {
        "ag-start": "f32[16,4]", "ar-start": "f32[4,4]", "agd-start": "f32[8,4]", "agt-start": "f32[16,4]",
        "cp-start": "f32[4,4]", "rs-start": "f32[4,4]", "cpd-start": "f32[4,4]", "sync": "f32[4,4]"}
    loop = read("schedule_loop_carried.hlo")  # without a done in their computation: the start's result part
    assert {w.start: w.tensor for w in loop.windows()} == {
        "ar-start": "f32[4,4]", "first": "f32[16,4]", "next": "f32[16,4]", "shift-start": "f32[4,4]"}


# One all-reduce of two operands (XLA combines small all-reduces so): f32[4,4] and f32[8], 64 + 32 B.
TUPLE_ALL_REDUCE = """HloModule tuple_all_reduce, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

ENTRY %main (p: f32[4,4], q: f32[8], a: f32[64,64]) -> ((f32[4,4], f32[8]), f32[64,64]) {
  %p = f32[4,4]{1,0} parameter(0)
  %q = f32[8]{0} parameter(1)
  %a = f32[64,64]{1,0} parameter(2)
  %ar-start = (f32[4,4]{1,0}, f32[8]{0}) all-reduce-start(%p, %q), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %mm = f32[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar-done = (f32[4,4]{1,0}, f32[8]{0}) all-reduce-done(%ar-start)
  ROOT %out = ((f32[4,4]{1,0}, f32[8]{0}), f32[64,64]{1,0}) tuple(%ar-done, %mm)
}
"""


def test_a_tuple_collectives_window_is_all_its_operands():
    """One async all-reduce of two operands over data (a ring of 2): one window holding the matmul, with both
    records, and its bytes (64 + 32), ring bytes (2 x 1/2 of them) and tensors those of both operands."""
    sched = hlo.schedule(TUPLE_ALL_REDUCE, MESH)
    (w,) = sched.entry.windows
    assert (w.start, w.finish, w.op, w.axes, w.inside) == ("ar-start", "ar-done", "all-reduce", ("data",), ("mm",))
    assert [(r.shape, r.bytes) for r in w.records] == [((4, 4), 64), ((8,), 32)]
    assert (w.bytes, w.ring_bytes, w.tensor) == (96, 96.0, "f32[4,4] f32[8]")
    each_record_in_one_window(sched)


def test_a_loop_inside_a_window_and_pairs_carried_across_the_loop():
    """schedule_loop_carried.hlo: ENTRY's all-reduce is in flight over the whole loop (the while is one
    instruction of its window); the pipelined all-gathers whose done is not in their own computation
    (%first carried into the loop, %next carried out of each iteration) are open to their computation's
    end; the body's own permute pair is an ordinary window, run trips times per step; a done without
    its start in its computation (%got, %last-done) opens no window."""
    sched = read("schedule_loop_carried.hlo")
    assert [(s.name, s.kind, s.runs, s.trips, s.caller) for s in sched.sequences.values()] == [
        ("main", "entry", 1, None, None), ("body", "while body", 3, 3, "loop")]
    assert as_rows(sched.entry) == {
        "ar-start": ("ar-done", "all-reduce", ("data",), ("first", "loop", "em1", "last-done"), (), False),
        "first": ("", "all-gather", ("tensor",), ("loop", "em1", "last-done", "ar-done"), (), True),
    }
    body = sched.sequences["body"]
    assert as_rows(body) == {
        "next": ("", "all-gather", ("tensor",), ("shift-start", "bm2", "shift-done", "bm3", "i1"), (), True),
        "shift-start": ("shift-done", "collective-permute", ("tensor",), ("bm2",), (), False),
    }
    carried = next(w for w in body.windows if w.carried)
    assert (carried.issue, carried.done) == (body.position("next"), len(body.order) - 1)  # open to the end
    multiplicity = {w.start: [r.multiplicity for r in w.records] for w in sched.windows()}
    assert multiplicity == {"ar-start": [1], "first": [1], "next": [3], "shift-start": [3]}
    each_record_in_one_window(sched)


def test_tpu_async_collective_fusion_chains_in_flight_at_once():
    """schedule_tpu_chains.hlo: each chain from its start fusion to the done fusion that takes its state,
    followed through get-tuple-elements and its continuation; the other chain's start and done are
    instructions of the window, never links of it, nor is a fusion that only reads the input buffer out
    of the start's state (%shard-tanh); each collective counted once, at its start."""
    sched = read("schedule_tpu_chains.hlo")
    assert as_rows(sched.entry) == {
        "ag-start": ("ag-done", "all-gather", ("tensor",), ("ar-start", "shard-tanh", "ag-cont"), ("ag-cont",),
                     False),
        "ar-start": ("ar-done", "all-reduce", ("data",), ("shard-tanh", "ag-cont", "ag-done", "mm.b"), (), False),
    }
    assert [(r.name, r.computation) for w in sched.entry.windows for r in w.records] == [
        ("all-gather.1", "ag_start"), ("all-reduce.1", "ar_start")]
    each_record_in_one_window(sched)


def test_the_real_tpu_chain_and_its_synchronous_neighbour():
    """tpu_async_collective_done_fusion.hlo (a real v5e dump, trimmed): the async all-gather's window holds
    its continuation fusion %fusion.19 and nothing else; the sync all-gather before it is zero-wide."""
    sched = read("tpu_async_collective_done_fusion.hlo", {"data": 16, "tensor": 1})
    assert as_rows(sched.entry) == {
        "all-gather.30": ("all-gather.30", "all-gather", ("data",), (), (), False),
        "async-collective-start": ("async-collective-done", "all-gather", ("data",), ("fusion.19",),
                                   ("fusion.19",), False),
    }
    each_record_in_one_window(sched)


def test_loops_in_loops_and_called_computations_are_their_own_streams():
    """nested_while.hlo: the inner body runs 2 x 3 times per step, its psum's window in it; call_conditional.hlo:
    a computation called twice is one stream run twice, each branch a stream run once (counted as taken)."""
    sched = read("nested_while.hlo")
    assert {s.name: (s.kind, s.runs, s.trips, s.caller) for s in sched.sequences.values()} == {
        "main": ("entry", 1, None, None), "outer_body": ("while body", 2, 2, "outer"),
        "inner_body": ("while body", 6, 3, "inner")}
    assert {s.name: [(w.start, w.synchronous, w.records[0].multiplicity) for w in s.windows]
            for s in sched.sequences.values()} == {
        "main": [], "outer_body": [("outer_psum", True, 2)], "inner_body": [("inner_psum", True, 6)]}
    assert [i.name for i in sched.branches(sched.sequences["outer_body"].order[5])] == ["inner_body"]
    calls = hlo.schedule((SNIPPETS / "call_conditional.hlo").read_text(), MESH)
    assert {s.name: (s.kind, s.runs, [w.start for w in s.windows]) for s in calls.sequences.values()} == {
        "main": ("entry", 1, []), "sync_grads": ("called", 2, ["called_psum"]),
        "then": ("branch", 1, ["then_gather"]), "else": ("branch", 1, ["else_permute"])}
    each_record_in_one_window(calls)


def test_a_loop_without_known_trip_count_runs_the_count_its_condition_gives():
    """tpu_while_no_trip_count.hlo (real TPU HLO, trimmed): the trip count 3 is read from `i < 3`, and the
    body's runs are marked inexact, with a warning saying so."""
    sched = hlo.schedule((SNIPPETS / "tpu_while_no_trip_count.hlo").read_text(), MESH)
    (body,) = sched.loops
    assert (body.trips, body.runs, body.runs_exact) == (3, 3, False) and sched.entry.runs_exact
    assert [(w.start, w.records[0].multiplicity, w.records[0].multiplicity_exact) for w in body.windows] == [
        ("psum_invariant.16", 3, False)]
    assert any("no known_trip_count, inferred 3 from its condition" in w for w in sched.ledger.warnings)


def test_a_start_whose_done_is_missing_is_open_to_the_end_and_a_stray_done_opens_nothing():
    """Cut %ag-done out of schedule_overlap.hlo (its users read the start instead): the all-gather is then
    carried to ENTRY's end, every later instruction in its window; the other windows are unchanged."""
    text = (SNIPPETS / "schedule_overlap.hlo").read_text()
    text = text.replace("  %ag-done = f32[16,4]{1,0} all-gather-done(%ag-start)\n", "").replace(
        "tuple(%ag-done,", "tuple(%ag-start,")
    sched = hlo.schedule(text, MESH)
    rows = as_rows(sched.entry)
    order = [i.name for i in sched.entry.order]
    assert rows["ag-start"][0] == "" and rows["ag-start"][5] is True
    assert rows["ag-start"][3] == tuple(n for n in order[order.index("ag-start") + 1:]
                                        if n not in ("one", "agd-operand", "copy-start", "copy-done", "out"))
    assert rows["ar-start"] == ("ar-done", "all-reduce", ("data",), ("mm1", "mm2"), (), False)


@pytest.mark.parametrize("name", ["schedule_overlap.hlo", "schedule_loop_carried.hlo", "schedule_tpu_chains.hlo"])
def test_an_unscheduled_module_is_read_in_printed_order_with_a_warning(name):
    text = (SNIPPETS / name).read_text().replace(", is_scheduled=true", "")
    sched = hlo.schedule(text, MESH)
    assert not sched.scheduled and sched.warnings == [
        "the module is not scheduled (no is_scheduled=true): the printed order is read as the order"]
    assert [as_rows(s) for s in sched.sequences.values()] == [as_rows(s) for s in read(name).sequences.values()]


# An all-gather over tensor whose done is not in ENTRY, issued before three matmuls, the last of them ENTRY's
# ROOT (not a free tuple): the carried window holds every instruction after its start, the last one too.
CARRIED_TO_A_COMPUTING_ROOT = """HloModule carried_to_root, is_scheduled=true, num_partitions=8

ENTRY %main (p: f32[4,4], a: f32[64,64]) -> f32[64,64] {
  %p = f32[4,4]{1,0} parameter(0)
  %a = f32[64,64]{1,0} parameter(1)
  %ag-start = (f32[4,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %mm1 = f32[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = f32[] constant(1)
  %mm2 = f32[64,64]{1,0} dot(%mm1, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %mm3 = f32[64,64]{1,0} dot(%mm2, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_carried_window_runs_to_its_computations_last_instruction_when_that_one_computes():
    """The loop-carried fixtures end in a ROOT tuple, which is free; here the ROOT is a matmul: the open
    window holds mm1, mm2 and mm3 (not the constant), and it closes at the last position."""
    sched = hlo.schedule(CARRIED_TO_A_COMPUTING_ROOT, MESH)
    assert as_rows(sched.entry) == {"ag-start": ("", "all-gather", ("tensor",), ("mm1", "mm2", "mm3"), (), True)}
    (window,) = sched.entry.windows
    assert (window.issue, window.done) == (2, 6)  # p, a, ag-start, mm1, one, mm2, mm3
    each_record_in_one_window(sched)


# op_name metadata as JAX writes it, by construction: the backward pass's ops are the transposes of the
# forward's jvp, so their names hold both `transpose(` and `jvp(`; the forward's hold `jvp(` only.
PHASES = [
    ("jit(train_step)/jit(main)/transpose(jvp(block))/dot_general", "backward"),
    ("jit(train_step)/transpose(jvp(jit(loss)))/reduce_sum", "backward"),
    ("jit(step)/jit(main)/jvp(jit(checkpoint))/transpose(jvp(attn))/mul", "backward"),
    ("jit(train_step)/jit(main)/jvp(block)/dot_general", "forward"),
    ("jit(train_step)/jvp(jit(loss))/log_softmax", "forward"),
    ("jit(train_step)/jit(main)/adamw/mul", "other"),
    ("jit(f)/jit(main)/transpose", "other"),  # a transpose op, not a transposed function
    ("", "other"),
]


@pytest.mark.parametrize("op_name, want", PHASES)
def test_the_phase_of_each_op_name_shape(op_name, want):
    assert phase(op_name) == want
