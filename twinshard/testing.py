"""pytest helpers over the collective ledger (MaxText `hlo_test_utils` style).

Each helper's AssertionError starts with what was expected and found, then `ledger.table()`:

    led = hlo.ledger(step.lower(*args).compile(), mesh)
    expect_parsed(led)
    expect_collectives(led, "all-gather", axes=("data",), count=2 * n_layers)
    expect_no_collective(led, "all-reduce", larger_than=1024)
    expect_bytes(led, ("tensor",), bytes=4 * B * T * D, op="all-reduce")
    expect_permute(led, {"stage": +1}, wrap=False, count=ticks)  # who sends to whom

`expect_sharding` asserts a type at trace time in JAX's Explicit mode instead:

    expect_sharding(grad, P(None, "data"))                   # the gradient sharded as its param
    expect_sharding(acc, P(None, None, unreduced={"data"}))  # partial sums, not reduced yet

Every helper refuses a ledger not parsed from an HLO module, and `expect_no_collective` one with
unparsed collective-looking lines. `axes` is an exact set of mesh axes (None: any); counts and
bytes are multiplicity-weighted. `source` ("tp.py" or "tp.py:42"), `phase` ("forward" /
"backward"), `reduction` ("sum", "max", ...) and `dtype` ("bf16") select records as
`Ledger.filter` does; a value that names nothing the program could hold raises ValueError. A failure
shows the expected row beside the nearest rows found; pytest hides these helpers' own frames.

Only jax and numpy are needed (the `twinshard-hlo` distribution installs this module alone).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from twinshard.hlo import OPS, Ledger, shift_pairs
from twinshard.hlo.records import TABLE_HEAD, fixed_width

__all__ = ["expect_bytes", "expect_collectives", "expect_no_collective", "expect_parsed",
           "expect_permute", "expect_sharding"]

Axes = str | Iterable[str] | None


def _fail(ledger: Ledger, message: str, expected: tuple[str, ...] | None = None,
          nearest: Ledger | None = None) -> None:
    """Raise with the message, the expected row beside the nearest rows found, then the table."""
    __tracebackhide__ = True
    beside = ""
    if expected is not None:
        found = nearest.rows() if nearest is not None else []
        rows = [("expected", *expected)] + [("found", *r) for r in found]
        beside = "\n".join(fixed_width(("", *TABLE_HEAD), rows)[2:]) + (
            "" if found else "\nfound     (no row of this op or these axes)") + "\n\n"
    raise AssertionError(f"{message}\n{beside}{ledger.table()}")


def _nearest(ledger: Ledger, op: str | None, axes: Axes) -> Ledger:
    """The records a reader compares with the expected row: this op on any axes, or these axes."""
    want = ledger.norm_axes(axes)
    keep = [r for r in ledger if (op is not None and r.op == op) or (want is not None and r.axes == want)]
    return ledger.selected(keep)


def _expected(op: str | None, axes: Axes, ledger: Ledger, count: str = "", nbytes: str = "",
              select: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The expected row in the table's columns (op, axes, count, shapes, bytes, ring bytes, source)."""
    want = ledger.norm_axes(axes)
    where = ", ".join(f"{k}={v}" for k, v in (select or {}).items() if v is not None)
    return (f"{op or 'any'} {(select or {}).get('reduction') or ''}".strip(),
            "any" if want is None else ",".join(want) or "-", count, "", nbytes, "", where)


def _require_module(ledger: Ledger) -> None:
    __tracebackhide__ = True
    if not isinstance(ledger, Ledger):
        raise AssertionError(f"expected a twinshard.hlo.Ledger (from hlo.ledger(compiled, mesh)), "
                             f"got {type(ledger).__name__}")
    if ledger.instructions <= 0:
        _fail(ledger, "this ledger parsed no HLO instructions (instructions=0): it did not come "
                      "from hlo.ledger() on a compiled program, so it proves nothing; build it "
                      "with hlo.ledger(jax.jit(f).lower(*args).compile(), mesh)")


def _what(op: str | None, axes: Axes, ledger: Ledger, select: Mapping[str, Any] | None = None) -> str:
    want = ledger.norm_axes(axes)
    where = "".join(f", {k}={v!r}" for k, v in (select or {}).items() if v is not None)
    return f"{op or 'any collective'} over {'any axes' if want is None else want}{where}"


def expect_collectives(ledger: Ledger, op: str, axes: Axes = None, count: int | None = None,
                       min_count: int | None = None, max_count: int | None = None, *,
                       source: str | None = None, phase: str | None = None,
                       reduction: str | None = None, dtype: str | None = None) -> Ledger:
    """Assert how many `op` collectives run over `axes` (at least one if no bound given)."""
    __tracebackhide__ = True
    _require_module(ledger)
    select = {"source": source, "phase": phase, "reduction": reduction, "dtype": dtype}
    found = ledger.filter(op=op, axes=axes, **select)
    bounds = _out_of_bounds(found, count, min_count, max_count)
    if bounds:
        _fail(ledger, f"expected {_what(op, axes, ledger, select)} with {bounds}; "
                      f"found {sum(r.multiplicity for r in found)}",
              _expected(op, axes, ledger, bounds, select=select), _nearest(ledger, op, axes))
    return found


def _out_of_bounds(found: Ledger, count: int | None, min_count: int | None,
                   max_count: int | None) -> str:
    """The bounds as text when the count breaks them ('' when not; no bound means at least one)."""
    for name, bound in (("count", count), ("min_count", min_count), ("max_count", max_count)):
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
            raise ValueError(f"{name}={bound!r} is not a count: pass an integer >= 0")
    if min_count is not None and max_count is not None and min_count > max_count:
        raise ValueError(f"min_count={min_count} > max_count={max_count}: no count satisfies both")
    n = sum(r.multiplicity for r in found)
    if count is None and min_count is None and max_count is None:
        min_count = 1
    bad = ((count is not None and n != count) or (min_count is not None and n < min_count)
           or (max_count is not None and n > max_count))
    return " ".join(f"{k}={v}" for k, v in (("count", count), ("min_count", min_count),
                                             ("max_count", max_count)) if v is not None) if bad else ""


def expect_no_collective(ledger: Ledger, op: str | None = None, axes: Axes = None,
                         larger_than: int | None = None, *, source: str | None = None,
                         phase: str | None = None, reduction: str | None = None,
                         dtype: str | None = None) -> None:
    """Assert no `op` over `axes` exists (or none whose result exceeds `larger_than` bytes)."""
    __tracebackhide__ = True
    _require_module(ledger)
    ops = OPS if op is None else (op,) if isinstance(op, str) else tuple(op)
    hidden = [u for u in ledger.unparsed if any(o in u for o in ops)]
    if hidden:
        _fail(ledger, f"cannot assert no {op or 'collective'}: {len(hidden)} collective-looking "
                      f"HLO line(s) were not parsed and may be one")
    select = {"source": source, "phase": phase, "reduction": reduction, "dtype": dtype}
    found = [r for r in ledger.filter(op=op, axes=axes, **select)
             if larger_than is None or r.bytes > larger_than]
    if found:
        size = "" if larger_than is None else f" larger than {larger_than} bytes"
        names = ", ".join(f"%{r.name} ({r.bytes} B, {r.source or r.op_name})" for r in found[:5])
        _fail(ledger, f"expected no {_what(op, axes, ledger, select)}{size}; found {len(found)}: {names}",
              _expected(op, axes, ledger, "0", "" if larger_than is None else f"<= {larger_than} B",
                        select), ledger.selected(found))


def expect_bytes(ledger: Ledger, axes: Axes, bytes: float, rel: float = 0.01,
                 op: str | None = None, kind: str = "bytes", *, source: str | None = None,
                 phase: str | None = None, reduction: str | None = None, dtype: str | None = None) -> float:
    """Assert the multiplicity-weighted `kind` total over `axes` is within `rel` of `bytes`."""
    __tracebackhide__ = True
    _require_module(ledger)
    select = {"source": source, "phase": phase, "reduction": reduction, "dtype": dtype}
    got = ledger.total_bytes(axes=axes, op=op, kind=kind, **select)
    if abs(got - bytes) > rel * abs(bytes) or (bytes == 0 and got != 0):
        _fail(ledger, f"expected {kind} of {_what(op, axes, ledger, select)} = {bytes:.6g} "
                      f"(rel {rel:g}); got {got:.6g} ({(got - bytes) / bytes:+.2%})"
              if bytes else f"expected {kind} of {_what(op, axes, ledger, select)} = 0; got {got:.6g}",
              _expected(op, axes, ledger, nbytes=f"{bytes:.6g} B ({kind})", select=select),
              _nearest(ledger, op, axes))
    return got


def expect_parsed(ledger: Ledger) -> None:
    """Assert a module was read and every collective-looking HLO line in it was parsed."""
    __tracebackhide__ = True
    _require_module(ledger)
    if ledger.unparsed:
        _fail(ledger, f"{len(ledger.unparsed)} collective-looking HLO lines were not parsed")


def expect_permute(ledger: Ledger, shift: Mapping[str, int], wrap: bool | None = None,
                   count: int | None = None, min_count: int | None = None,
                   max_count: int | None = None) -> Ledger:
    """Assert how many collective-permutes send every device's data exactly `shift` along the mesh
    ({"stage": +1}: to the next stage index); wrap=False a line, True a ring, None either."""
    __tracebackhide__ = True
    _require_module(ledger)
    if not shift:
        raise ValueError("shift names no axis: pass e.g. {'stage': +1}")
    ledger.norm_axes(tuple(shift))  # unknown axes fail loudly
    if any(not isinstance(k, int) or isinstance(k, bool) for k in shift.values()) or not any(shift.values()):
        raise ValueError(f"shift {dict(shift)} must move by whole non-zero steps along some axis: pass e.g. "
                         f"{{'stage': +1}}")
    if wrap is not None and not isinstance(wrap, bool):
        raise ValueError(f"wrap={wrap!r}: pass False (a line), True (a ring) or None (either)")
    wraps = (False, True) if wrap is None else (wrap,)
    wanted = {shift_pairs(ledger.mesh, shift, w) for w in wraps}
    found = ledger.filter(op="collective-permute")
    found = ledger.selected([r for r in found if frozenset(r.source_target_pairs) in wanted
                             and len(set(r.source_target_pairs)) == len(r.source_target_pairs)])
    bounds = _out_of_bounds(found, count, min_count, max_count)
    if bounds:
        what = ", ".join(f"{a} {k:+d}" for a, k in shift.items())
        kind = {None: "line or ring", False: "line, no wrap", True: "ring"}[wrap]
        seen = ", ".join(f"{p!r} x{c}" for p, c in ledger.patterns().items()) or "none"
        _fail(ledger, f"expected collective-permutes shifting {what} ({kind}) with {bounds}; "
                      f"found {sum(r.multiplicity for r in found)} (collective-permutes by "
                      f"pattern: {seen})",
              ("collective-permute", f"{what} ({kind})", bounds, "", "", "", ""),
              ledger.filter(op="collective-permute"))
    return found


# ----------------------------------------------------------------------------- types (Explicit mode)


def expect_sharding(x, spec: P) -> None:
    """Assert that `x` is sharded as `spec`: its partitions, and its `unreduced` / `reduced` mesh
    axes.

    x: a concrete array (its placement, on any mesh: `x.sharding`), or, under JAX's Explicit
    mode, a tracer inside a traced function (checked at trace time) or an aval (`jax.typeof(x)`),
    whose type carries the sharding; or a `jax.ShapeDtypeStruct` with a NamedSharding. The type
    of a value on Auto mesh axes says nothing about where it is (measured, JAX 0.12: an array
    placed P('data') on an Auto mesh has the type sharding P(None, None)), so a tracer or aval
    there is refused. Trailing unsplit dims may be left out of `spec`, a 1-tuple of axes equals
    the axis, and mesh axes of size 1 split nothing (P('data') on a data axis of 1 equals
    P(None)). Raises AssertionError naming both; ValueError where `spec` names an axis the mesh lacks."""
    __tracebackhide__ = True
    shape, sharding, shown, typed = _type_of(x)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise AssertionError(f"expected sharding {spec} for {shown}: its type carries no NamedSharding")
    sizes = dict(sharding.mesh.shape)
    named = {a for entry in (*spec.partitions, tuple(spec.unreduced), tuple(spec.reduced))
             for a in ((entry,) if isinstance(entry, str) else tuple(entry or ()))}
    if unknown := sorted(named - set(sizes)):
        raise ValueError(f"expected sharding {spec} names {unknown}, not axes of the mesh {tuple(sizes)} "
                         f"that {shown} lives on: name axes of that mesh")
    auto = [a for a, t in zip(sharding.mesh.axis_names, sharding.mesh.axis_types)
            if t != jax.sharding.AxisType.Explicit and sizes[a] > 1]
    if typed and auto:
        raise AssertionError(f"expected sharding {spec} for {shown}: its type cannot say, the mesh axes {auto} are "
                             "not Explicit; check the concrete array (outside jit), or use an Explicit mesh.")
    if _canonical(sharding.spec, len(shape), sizes) != _canonical(spec, len(shape), sizes):
        found = f"the type is {shown}, sharding {sharding.spec}" if typed else f"{shown} is sharded {sharding.spec}"
        raise AssertionError(f"expected sharding {spec}; {found}")


def _type_of(x):
    """(shape, sharding, printable type, whether the sharding is read from a type) of an array,
    tracer, aval or ShapeDtypeStruct."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.shape, x.sharding, f"{x.dtype}{list(x.shape)}", False
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return x.shape, x.sharding, jax.typeof(x).str_short(), False  # where it is, on any mesh
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    return aval.shape, aval.sharding, aval.str_short(), True


def _canonical(s: P, ndim: int, sizes: Mapping[str, int]):
    """A spec as (partitions per dim, unreduced, reduced), axes of size 1 dropped."""
    def axes(entry) -> tuple[str, ...]:
        found = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return tuple(a for a in found if sizes.get(a, 2) > 1)
    parts = s.partitions + (None,) * (ndim - len(s.partitions))
    return (tuple(axes(p) for p in parts), frozenset(axes(tuple(s.unreduced))),
            frozenset(axes(tuple(s.reduced))))
