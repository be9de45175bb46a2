"""Every selector and option of the assertion API (twinshard.testing, hlo.Ledger's filter, count and
total_bytes) on one program whose collectives are known by construction: for each, a value that
matches, one that matches nothing, and one that is not a value at all. The invalid one raises a
one-line ValueError naming it and the valid choices, in every entry point, so that no user's
`expect_no_collective` passes because a typo selected nothing.

Imports only what the twinshard-hlo distribution needs (jax, numpy, pytest), like test_hlo_api.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # run alone; the suite's conftest has set both already
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from twinshard import hlo
from twinshard.testing import expect_bytes, expect_collectives, expect_no_collective, expect_permute, expect_sharding

HERE = pathlib.Path(__file__).name
SPEC = P("data", "tensor")


def _line(marker: str) -> int:
    """The line of this file that ends with `marker` (a comment on the op's call)."""
    lines = pathlib.Path(__file__).read_text().splitlines()
    (n,) = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(marker)]
    return n


def known(x):
    """x: f32[4, 4] per device of a data:2 x tensor:4 mesh -> one collective per line, each of its
    own kind, axes, dtype or reduction (XLA:CPU combines none of them: measured, JAX 0.12)."""
    scaled = x * 3.0  # an instruction, no collective  # <- scale
    total = lax.psum(scaled, "data")  # <- psum
    ints = lax.all_gather(x.astype(jnp.int32), "tensor", axis=0, tiled=True)  # <- gather s32
    shifted = lax.ppermute(x, "tensor", [(i, (i + 1) % 4) for i in range(4)])  # <- ppermute
    largest = lax.pmax(x, ("data", "tensor"))  # <- pmax
    part = lax.psum_scatter(x, "tensor", scatter_dimension=0, tiled=True)  # <- psum_scatter
    swapped = lax.all_to_all(x, "data", 0, 0, tiled=True)  # <- all_to_all
    # forward: all-gather over data; backward (its transpose): reduce-scatter over data
    grad = jax.grad(lambda v: (lax.all_gather(v, "data", axis=0, tiled=True) ** 2).sum())(x)  # <- grad
    return total, ints, shifted, largest, part, swapped, grad


# (op, reduction, axes, dtype, shape, bytes, phase, marker): by construction. A collective outside
# jax.grad has phase "" in a program that differentiates something.
EXPECTED = [
    ("all-reduce", "sum", ("data",), "f32", (4, 4), 64, "", "# <- psum"),
    ("all-gather", "", ("tensor",), "s32", (16, 4), 256, "", "# <- gather s32"),
    ("collective-permute", "", ("tensor",), "f32", (4, 4), 64, "", "# <- ppermute"),
    ("all-reduce", "max", ("data", "tensor"), "f32", (4, 4), 64, "", "# <- pmax"),
    ("reduce-scatter", "sum", ("tensor",), "f32", (1, 4), 16, "", "# <- psum_scatter"),
    ("all-to-all", "", ("data",), "f32", (2, 4), 64, "", "# <- all_to_all"),  # 2 parts of [2, 4]
    ("all-gather", "", ("data",), "f32", (8, 4), 128, "forward", "# <- grad"),
    ("reduce-scatter", "sum", ("data",), "f32", (4, 4), 64, "backward", "# <- grad"),
]
TOTAL = sum(row[5] for row in EXPECTED)


@pytest.fixture(scope="module")
def led() -> hlo.Ledger:
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    fn = jax.jit(jax.shard_map(known, mesh=mesh, in_specs=SPEC, out_specs=(SPEC,) * 7))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, SPEC))
    return hlo.ledger(fn.lower(x).compile(), mesh)


def test_the_ledger_holds_exactly_the_collectives_written(led: hlo.Ledger) -> None:
    got = sorted((r.op, r.reduction, r.axes, r.dtype, r.shape, r.bytes, r.phase, r.source.rpartition(":")[2])
                 for r in led for _ in range(r.multiplicity))
    want = sorted((*row[:7], str(_line(row[7]))) for row in EXPECTED)
    assert got == want, led.table()
    assert all(r.source.rpartition(":")[0].endswith("/" + HERE) for r in led)
    assert f"{HERE}:{_line('# <- scale')}" in {s.rpartition("/")[2] for s in led.sources}


SCALE = _line("# <- scale")
# One row per selector: a selection that matches (and how many records, how many bytes, by
# construction), one that matches nothing, an invalid one, and what its error must name (the
# value, and a valid choice).
SELECTORS = {
    "op": ({"op": "all-to-all"}, 1, 64, {"op": "collective-broadcast"},
           {"op": "all_to_all"}, ("'all_to_all'", "'all-to-all'")),
    "ops": ({"op": ("all-gather", "reduce-scatter")}, 4, 464, {"op": ("ragged-all-to-all",)},
            {"op": ("all-gather", "allgather")}, ("'allgather'", "'all-gather'")),
    "axes": ({"axes": ("tensor", "data")}, 1, 64, {"axes": ()},
             {"axes": "date"}, ("'date'", "('data', 'tensor')")),
    "axis": ({"axes": "data"}, 4, 320, {"op": "collective-permute", "axes": "data"},
             {"axes": ("data", "tensr")}, ("'tensr'", "('data', 'tensor')")),
    "dtype": ({"dtype": "s32"}, 1, 256, {"dtype": "bf16"},
              {"dtype": "int32"}, ("'int32'", "'s32'")),
    "source": ({"source": f"{HERE}:{_line('# <- pmax')}"}, 1, 64, {"source": f"{HERE}:{SCALE}"},
               {"source": f"{HERE}:{SCALE - 1}"}, (f"'{HERE}:{SCALE - 1}'", f"{SCALE}, ")),
    "source file": ({"source": f"tests/{HERE}"}, 8, TOTAL, {"op": "collective-broadcast", "source": HERE},
                    {"source": "test_hlo_selector.py"}, ("'test_hlo_selector.py'", f"'{HERE}'")),
    "phase": ({"phase": "backward"}, 1, 64, {"op": "all-reduce", "phase": "forward"},
              {"phase": "bwd"}, ("'bwd'", "'backward'")),
    "reduction": ({"reduction": "max"}, 1, 64, {"reduction": "product"},
                  {"reduction": "add"}, ("'add'", "'sum'")),
}

# Every entry point that selects, called with a selection (`sel`) alone.
ENTRIES = {
    "filter": lambda led, sel: led.filter(**sel),
    "count": lambda led, sel: led.count(**sel),
    "total_bytes": lambda led, sel: led.total_bytes(**sel),
    "expect_collectives": lambda led, sel: expect_collectives(led, **{"op": None, **sel}),
    "expect_no_collective": lambda led, sel: expect_no_collective(led, **sel),
    "expect_bytes": lambda led, sel: expect_bytes(led, **{"axes": None, "bytes": 1.0, **sel}),
}


@pytest.mark.parametrize("name", SELECTORS)
def test_a_matching_value_selects_what_was_written(led: hlo.Ledger, name: str) -> None:
    sel, n, nbytes, *_ = SELECTORS[name]
    assert led.count(**sel) == n == len(led.filter(**sel)), led.table()
    assert led.total_bytes(**sel) == nbytes and expect_bytes(led, **{"axes": None, **sel}, bytes=nbytes) == nbytes
    assert len(expect_collectives(led, **{"op": None, **sel}, count=n)) == n
    expect_collectives(led, **{"op": None, **sel}, min_count=n, max_count=n)
    with pytest.raises(AssertionError, match=rf"with count={n + 1}; found {n}\n"):
        expect_collectives(led, **{"op": None, **sel}, count=n + 1)
    with pytest.raises(AssertionError, match=rf"expected no .*; found {n}: %"):
        expect_no_collective(led, **sel)


@pytest.mark.parametrize("name", SELECTORS)
def test_a_value_that_matches_nothing_selects_nothing(led: hlo.Ledger, name: str) -> None:
    sel = SELECTORS[name][3]
    assert led.count(**sel) == 0 and led.total_bytes(**sel) == 0, led.table()
    expect_no_collective(led, **sel)
    expect_bytes(led, **{"axes": None, **sel}, bytes=0)
    with pytest.raises(AssertionError, match=r"with min_count=1; found 0\n"):
        expect_collectives(led, **{"op": None, **sel})


@pytest.mark.parametrize("name", SELECTORS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_an_invalid_value_raises_naming_it_and_the_choices(led: hlo.Ledger, name: str, entry: str) -> None:
    *_, invalid, named = SELECTORS[name]
    with pytest.raises(ValueError) as err:
        ENTRIES[entry](led, invalid)
    message = str(err.value)
    assert "\n" not in message and all(text in message for text in named), message


def test_kind_chooses_bytes_or_ring_bytes_and_nothing_else(led: hlo.Ledger) -> None:
    # ring bytes by construction: all-reduce 2 (n-1)/n, all-gather and all-to-all (n-1)/n,
    # reduce-scatter (n-1) x its result, a permute its bytes
    ring = 64 + 3 / 4 * 256 + 64 + 2 * 7 / 8 * 64 + 3 * 16 + 1 / 2 * 64 + 1 / 2 * 128 + 64
    assert led.total_bytes() == TOTAL and led.total_bytes(kind="ring_bytes") == ring
    assert expect_bytes(led, None, ring, kind="ring_bytes", rel=0) == ring
    with pytest.raises(AssertionError, match=f"expected ring_bytes of any collective over any axes = {TOTAL}"):
        expect_bytes(led, None, TOTAL, kind="ring_bytes")
    for call in (lambda: led.total_bytes(kind="ring"), lambda: expect_bytes(led, None, TOTAL, kind="ring")):
        with pytest.raises(ValueError, match="kind must be 'bytes' or 'ring_bytes', got 'ring'"):
            call()


def test_larger_than_counts_only_results_above_it(led: hlo.Ledger) -> None:
    expect_no_collective(led, larger_than=256)  # the s32 gather, 256 B, is the largest
    with pytest.raises(AssertionError, match=r"expected no any collective over any axes larger than 255 bytes; "
                                             rf"found 1: %all_gather[.\d]* \(256 B, \S*/{HERE}:{_line('# <- gather s32')}\)"):
        expect_no_collective(led, larger_than=255)
    expect_no_collective(led, "reduce-scatter", larger_than=64)
    with pytest.raises(AssertionError, match="found 1: %reduce_scatter"):
        expect_no_collective(led, "reduce-scatter", larger_than=63, phase="backward")


@pytest.mark.parametrize("bounds, message", [
    ({"count": -1}, "count=-1 is not a count"), ({"min_count": 1.5}, "min_count=1.5 is not a count"),
    ({"max_count": True}, "max_count=True is not a count"),
    ({"min_count": 2, "max_count": 1}, "min_count=2 > max_count=1: no count satisfies both")])
def test_bounds_that_no_count_meets_are_refused(led: hlo.Ledger, bounds: dict, message: str) -> None:
    for call in (lambda: expect_collectives(led, "all-reduce", **bounds),
                 lambda: expect_permute(led, {"tensor": 1}, **bounds)):
        with pytest.raises(ValueError, match=message):
            call()


def test_expect_permute_selects_the_shift_and_the_ring(led: hlo.Ledger) -> None:
    assert len(expect_permute(led, {"tensor": +1}, wrap=True, count=1)) == 1
    expect_permute(led, {"tensor": +1}, count=1)  # wrap=None: a line or a ring
    expect_permute(led, {"tensor": -3}, wrap=True, count=1)  # -3 steps around a ring of 4 is +1
    for shift, wrap in (({"tensor": +1}, False), ({"tensor": -1}, True), ({"data": +1}, None),
                        ({"data": +1, "tensor": +1}, True)):
        with pytest.raises(AssertionError, match=r"found 0 \(collective-permutes by pattern: 'tensor ring \+1' x1\)"):
            expect_permute(led, shift, wrap=wrap, count=1)
        expect_permute(led, shift, wrap=wrap, count=0)


@pytest.mark.parametrize("shift, wrap, message", [
    ({"tensr": 1}, None, r"axes \['tensr'\] are not mesh axes \('data', 'tensor'\)"),
    ({}, None, "shift names no axis"),
    ({"tensor": 0}, None, r"shift \{'tensor': 0\} must move by whole non-zero steps"),
    ({"tensor": 1.5}, None, r"shift \{'tensor': 1.5\} must move by whole non-zero steps"),
    ({"tensor": 1}, "ring", r"wrap='ring': pass False \(a line\), True \(a ring\) or None"),
    ({"tensor": 1}, 1, r"wrap=1: pass False")])
def test_expect_permute_refuses_a_shift_or_wrap_that_is_not_one(led: hlo.Ledger, shift, wrap, message) -> None:
    with pytest.raises(ValueError, match=message):
        expect_permute(led, shift, wrap=wrap, count=0)


def test_each_helpers_failure_says_what_was_expected_and_found(led: hlo.Ledger) -> None:
    cases = [
        (lambda: expect_collectives(led, "all-reduce", "data", count=2, reduction="sum", dtype="f32"),
         "expected all-reduce over ('data',), reduction='sum', dtype='f32' with count=2; found 1"),
        (lambda: expect_no_collective(led, "all-gather", "tensor"),
         "expected no all-gather over ('tensor',); found 1: %all_gather"),
        (lambda: expect_bytes(led, "tensor", 300, op="all-gather"),
         "expected bytes of all-gather over ('tensor',) = 300 (rel 0.01); got 256 (-14.67%)"),
        (lambda: expect_bytes(led, "tensor", 0, op="all-gather"),
         "expected bytes of all-gather over ('tensor',) = 0; got 256"),
        (lambda: expect_permute(led, {"tensor": -1}, wrap=False, count=1),
         "expected collective-permutes shifting tensor -1 (line, no wrap) with count=1; found 0"),
    ]
    for call, first_line in cases:
        with pytest.raises(AssertionError) as err:
            call()
        message = str(err.value)
        assert message.splitlines()[0].startswith(first_line), message
        assert message.endswith(led.table()), message


def test_expect_sharding_matches_refuses_another_spec_and_an_axis_the_mesh_lacks() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.zeros((8, 16)), NamedSharding(mesh, SPEC))
    expect_sharding(x, SPEC)
    expect_sharding(jax.typeof(x), P("data", "tensor"))  # its type, in Explicit mode
    with pytest.raises(AssertionError, match=r"expected sharding P\('tensor', 'data'\); .* is sharded P\('data', 'tensor'\)"):
        expect_sharding(x, P("tensor", "data"))
    for spec, unknown in ((P("data", "tensr"), "['tensr']"), (P(("data", "stage")), "['stage']"),
                          (P(None, None, unreduced={"dat"}), "['dat']")):
        with pytest.raises(ValueError) as err:
            expect_sharding(x, spec)
        assert unknown in str(err.value) and "('data', 'tensor')" in str(err.value), str(err.value)


# Collectives the parser cannot read (a replica-group form it does not know, a permute without its pairs),
# written by hand as the full HLO lines a compiled module prints, beside one it reads.
WITH_UNPARSED = """HloModule unparsed, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[4,4]) -> (f32[4,4], f32[16,4], f32[4,4]) {
  %p = f32[4,4]{1,0} parameter(0)
  %good = f32[4,4]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %hidden-gather = f32[16,4]{1,0} all-gather(%p), channel_id=2, replica_groups=weird(3), dimensions={0}
  %hidden-permute = f32[4,4]{1,0} collective-permute(%p), channel_id=3
  ROOT %out = (f32[4,4]{1,0}, f32[16,4]{1,0}, f32[4,4]{1,0}) tuple(%good, %hidden-gather, %hidden-permute)
}
"""


def test_expect_no_collective_refuses_to_pass_over_an_unparsed_line_of_that_op() -> None:
    """An unparsed line holding the op may be one: expect_no_collective of that op (or of any collective)
    raises saying so; of an op no line holds (parsed or not) it passes."""
    led = hlo.ledger(WITH_UNPARSED, {"data": 2, "tensor": 4})
    assert [r.name for r in led] == ["good"] and len(led.unparsed) == 2
    for op, hidden in (("all-gather", 1), ("collective-permute", 1), (None, 2), (("all-to-all", "all-gather"), 1)):
        with pytest.raises(AssertionError, match=f"cannot assert no .*: {hidden} collective-looking HLO line"):
            expect_no_collective(led, op)
    for op in ("all-to-all", "reduce-scatter"):
        expect_no_collective(led, op)



@pytest.mark.parametrize("want, matches", [
    ("tp.py", True), ("manual_parallel/tp.py", True), ("/repo/manual_parallel/tp.py", True), ("tp.py:42", True),
    ("manual_parallel/tp.py:42", True),
    ("tp.py:4", False), ("tp.py:420", False), ("tp.py:2", False),  # a line is the whole number, not a prefix
    ("p.py", False), ("parallel/tp.py", False), ("xtp.py", False),  # a file is whole path components
    ("tp.py:43", False), ("ep.py:42", False)])
def test_a_source_is_whole_path_components_and_a_whole_line(want: str, matches: bool) -> None:
    """The `source` selector's rule on one record's `path:line` (/repo/manual_parallel/tp.py:42), value by
    value: `tp.py:4` is not line 42, `parallel/tp.py` not manual_parallel/tp.py."""
    from twinshard.hlo.records import source_matches

    assert source_matches("/repo/manual_parallel/tp.py:42", want) is matches
    assert not source_matches("", want)  # a record without metadata matches no source
