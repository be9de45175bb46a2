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
bytes are multiplicity-weighted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from twinshard.hlo import OPS, Ledger, shift_pairs
from twinshard.parallel.sharding import expect_sharding  # re-exported: tests assert layouts with it

Axes = str | Iterable[str] | None


def _fail(ledger: Ledger, message: str) -> None:
    raise AssertionError(f"{message}\n{ledger.table()}")


def _require_module(ledger: Ledger) -> None:
    if not isinstance(ledger, Ledger):
        raise AssertionError(f"expected a twinshard.hlo.Ledger (from hlo.ledger(compiled, mesh)), "
                             f"got {type(ledger).__name__}")
    if ledger.instructions <= 0:
        _fail(ledger, "this ledger parsed no HLO instructions (instructions=0): it did not come "
                      "from hlo.ledger() on a compiled program, so it proves nothing; build it "
                      "with hlo.ledger(jax.jit(f).lower(*args).compile(), mesh)")


def _what(op: str | None, axes: Axes, ledger: Ledger) -> str:
    want = ledger.norm_axes(axes)
    return f"{op or 'any collective'} over {'any axes' if want is None else want}"


def expect_collectives(ledger: Ledger, op: str, axes: Axes = None, count: int | None = None,
                       min_count: int | None = None, max_count: int | None = None) -> Ledger:
    """Assert how many `op` collectives run over `axes` (at least one if no bound given)."""
    _require_module(ledger)
    found = ledger.filter(op=op, axes=axes)
    bounds = _out_of_bounds(found, count, min_count, max_count)
    if bounds:
        _fail(ledger, f"expected {_what(op, axes, ledger)} with {bounds}; "
                      f"found {sum(r.multiplicity for r in found)}")
    return found


def _out_of_bounds(found: Ledger, count: int | None, min_count: int | None,
                   max_count: int | None) -> str:
    """The bounds as text when the count breaks them ('' when not; no bound means at least one)."""
    n = sum(r.multiplicity for r in found)
    if count is None and min_count is None and max_count is None:
        min_count = 1
    bad = ((count is not None and n != count) or (min_count is not None and n < min_count)
           or (max_count is not None and n > max_count))
    return " ".join(f"{k}={v}" for k, v in (("count", count), ("min_count", min_count),
                                             ("max_count", max_count)) if v is not None) if bad else ""


def expect_no_collective(ledger: Ledger, op: str | None = None, axes: Axes = None,
                         larger_than: int | None = None) -> None:
    """Assert no `op` over `axes` exists (or none whose result exceeds `larger_than` bytes)."""
    _require_module(ledger)
    ops = OPS if op is None else (op,)
    hidden = [u for u in ledger.unparsed if any(o in u for o in ops)]
    if hidden:
        _fail(ledger, f"cannot assert no {op or 'collective'}: {len(hidden)} collective-looking "
                      f"HLO line(s) were not parsed and may be one")
    found = [r for r in ledger.filter(op=op, axes=axes)
             if larger_than is None or r.bytes > larger_than]
    if found:
        size = "" if larger_than is None else f" larger than {larger_than} bytes"
        names = ", ".join(f"%{r.name} ({r.bytes} B, {r.source or r.op_name})" for r in found[:5])
        _fail(ledger, f"expected no {_what(op, axes, ledger)}{size}; found {len(found)}: {names}")


def expect_bytes(ledger: Ledger, axes: Axes, bytes: float, rel: float = 0.01,
                 op: str | None = None, kind: str = "bytes") -> float:
    """Assert the multiplicity-weighted `kind` total over `axes` is within `rel` of `bytes`."""
    _require_module(ledger)
    got = ledger.total_bytes(axes=axes, op=op, kind=kind)
    if abs(got - bytes) > rel * abs(bytes) or (bytes == 0 and got != 0):
        _fail(ledger, f"expected {kind} of {_what(op, axes, ledger)} = {bytes:.6g} "
                      f"(rel {rel:g}); got {got:.6g} ({(got - bytes) / bytes:+.2%})"
              if bytes else f"expected {kind} of {_what(op, axes, ledger)} = 0; got {got:.6g}")
    return got


def expect_parsed(ledger: Ledger) -> None:
    """Assert a module was read and every collective-looking HLO line in it was parsed."""
    _require_module(ledger)
    if ledger.unparsed:
        _fail(ledger, f"{len(ledger.unparsed)} collective-looking HLO lines were not parsed")


def expect_permute(ledger: Ledger, shift: Mapping[str, int], wrap: bool | None = None,
                   count: int | None = None, min_count: int | None = None,
                   max_count: int | None = None) -> Ledger:
    """Assert how many collective-permutes send every device's data exactly `shift` along the mesh
    ({"stage": +1}: to the next stage index); wrap=False a line, True a ring, None either."""
    _require_module(ledger)
    if not shift:
        raise ValueError("shift names no axis: pass e.g. {'stage': +1}")
    ledger.norm_axes(tuple(shift))  # unknown axes fail loudly
    wraps = (False, True) if wrap is None else (wrap,)
    wanted = {shift_pairs(ledger.mesh, shift, w) for w in wraps}
    found = ledger.filter(op="collective-permute")
    found = Ledger([r for r in found if frozenset(r.source_target_pairs) in wanted
                    and len(set(r.source_target_pairs)) == len(r.source_target_pairs)],
                   ledger.mesh, ledger.unparsed, ledger.warnings, ledger.instructions)
    bounds = _out_of_bounds(found, count, min_count, max_count)
    if bounds:
        what = ", ".join(f"{a} {k:+d}" for a, k in shift.items())
        kind = {None: "line or ring", False: "line, no wrap", True: "ring"}[wrap]
        seen = ", ".join(f"{p!r} x{c}" for p, c in ledger.patterns().items()) or "none"
        _fail(ledger, f"expected collective-permutes shifting {what} ({kind}) with {bounds}; "
                      f"found {sum(r.multiplicity for r in found)} (collective-permutes by "
                      f"pattern: {seen})")
    return found
