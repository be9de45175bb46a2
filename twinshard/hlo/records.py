"""The collective ledger: every collective of a compiled XLA program, one record each.

`ledger(compiled, mesh)` reads the optimized HLO text of a `jax.stages.Compiled` (or HLO module
text) into a `Ledger` of `Collective` records: op, mesh axes, bytes, runs per step and the source
line; anything else raises `NotCompiledHLO` saying what to pass. Forms (docs/hlo-assertions.md):
sync ops print once; XLA:CPU's tuple all-reduce is split into one record per operand; its tuple
all-to-all (one operand per peer) is ONE record with `parts` = n; GPU/TPU async pairs count once
at `-start`, the shape from `-done` (measured: XLA's printer turns a hand-written `async-start`
wrapping a reduce-scatter into `reduce-scatter-start` and stops printing the computation).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from twinshard.hlo import megascale
from twinshard.hlo.groups import (MeshSpec, Shift, classify, decode_replica_groups, describe_permute,
                                  explicit_groups, mesh_spec, pair_components)
from twinshard.hlo.loops import async_fusion_copies, call_edges, multiplicities
from twinshard.hlo.parse import DTYPES, OPS, Instr, Module, Shape, base_opcode, parse_shape, unescape
from twinshard.hlo.text import NotCompiledHLO, hlo_text, is_scheduled, parsed_module  # noqa: F401  (the ledger's API)


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Collective:
    """One collective of the program (one operand of a tuple all-reduce)."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    ring_bytes: float
    replica_groups: tuple[tuple[int, ...], ...]
    source_target_pairs: tuple[tuple[int, int], ...]
    axes: tuple[str, ...]
    partial_axes: tuple[str, ...]
    group_size: int
    multiplicity: int
    source: str
    op_name: str
    name: str
    computation: str
    is_async: bool = False
    tuple_index: int | None = None
    parts: int = 1
    multiplicity_exact: bool = True
    # collective-permute only: the pairs as mesh coordinates, one Shift per axis, `pattern` in words
    coordinate_pairs: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    shifts: tuple[Shift, ...] = ()
    pattern: str = ""
    # all-reduce and reduce-scatter: how the group combines its values, from the root of the
    # `to_apply` computation (REDUCTIONS); "" for other ops, or when that computation is not printed
    reduction: str = ""
    # as the op_name says: "backward" under JAX's `transpose(...)` (with any forward ops a remat
    # recomputes there), "forward" under `jvp(...)`, or anywhere in a program that differentiates
    # nothing; "" outside the differentiated function (a gradient sync, the optimizer) or without metadata
    phase: str = ""


# the root opcode of a reduction computation -> the record's `reduction`
REDUCTIONS = {"add": "sum", "maximum": "max", "minimum": "min", "and": "and", "or": "or",
              "multiply": "product"}
PHASES = ("forward", "backward")


def ring_bytes(op: str, nbytes: int, n: int) -> float:
    """Per-device bytes a ring algorithm sends for `op` on a group of `n`."""
    if n <= 1 and op not in ("collective-permute", "collective-broadcast"):
        return 0.0
    return {
        "all-gather": (n - 1) / n * nbytes,
        "reduce-scatter": float((n - 1) * nbytes),
        "all-reduce": 2 * (n - 1) / n * nbytes,
        "all-to-all": (n - 1) / n * nbytes,
        "ragged-all-to-all": (n - 1) / n * nbytes,
        "collective-permute": float(nbytes),
        "collective-broadcast": float(nbytes),
    }[op]


# ----------------------------------------------------------------------------- ledger


def flat_shapes(shape: Shape | list) -> list[Shape]:
    return [shape] if isinstance(shape, Shape) else [s for x in shape for s in flat_shapes(x)]


def source_metadata(attrs: dict[str, str], frames: dict[int, str]) -> tuple[str, str]:
    """(op_name, 'file:line') from a metadata={...} attribute."""
    meta = attrs.get("metadata", "")
    op = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
    file = re.search(r'source_file="((?:[^"\\]|\\.)*)"', meta)
    line = re.search(r"source_line=(\d+)", meta)
    frame = re.search(r"stack_frame_id=(\d+)", meta)
    source = ""
    if file:
        source = unescape(file.group(1)) + (f":{line.group(1)}" if line else "")
    elif frame:
        source = frames.get(int(frame.group(1)), "")
    return (unescape(op.group(1)) if op else ""), source


def _phase(op_name: str) -> str:
    """forward / backward as the op_name says (JAX names the passes `jvp(...)`, `transpose(jvp(...))`)."""
    return "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else ""


def _reduction(instr: Instr, mod: Module) -> str:
    """sum / max / min / and / or / product: the root of the op's `to_apply` computation, looked
    through converts (a bf16 reduction may add in f32); "" when the computation is not printed."""
    instrs = mod.computations.get(instr.attrs.get("to_apply", "").lstrip("%"), [])
    if not instrs:
        return ""
    by_name = {i.name: i for i in instrs}
    node = next((i for i in instrs if i.is_root), instrs[-1])
    while node.opcode in ("convert", "copy", "bitcast") and node.operands and node.operands[0] in by_name:
        node = by_name[node.operands[0]]
    return REDUCTIONS.get(node.opcode, node.opcode)


def source_matches(source: str, want: str) -> bool:
    """Whether a record's `path:line` is `want`: a file (`tp.py`, `manual_parallel/tp.py`, a full
    path) or a file and line (`tp.py:42`); a file matches whole path components only."""
    path, _, line = source.rpartition(":")
    want_path, sep, want_line = want.rpartition(":")
    if not (sep and want_line.isdigit()):
        want_path, want_line = want, ""
    return bool(path) and (path == want_path or path.endswith("/" + want_path)) and (
        not want_line or line == want_line)


def _result_shapes(instr: Instr, base_op: str, done: Instr | None) -> list[Shape] | list:
    """Result shape (list of parts) of a sync op or of an async start (from its done)."""
    if done is not None:
        return parse_shape(done.shape_text)
    shape = parse_shape(instr.shape_text)
    if not instr.opcode.endswith("-start") or base_op == "all-reduce":
        return shape
    if isinstance(shape, list) and len(shape) > 1:
        return shape[1]  # (operands, result[, context...])
    return shape


@dataclass
class Ledger:
    """All collectives of one compiled program, plus what could not be read; `instructions` is 0
    only for a Ledger built by hand, which every `twinshard.testing.expect_*` refuses."""

    records: list[Collective]
    mesh: MeshSpec
    unparsed: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    instructions: int = 0
    # every `path:line` the program's instructions name (collective or not): what `source=` may select
    sources: frozenset[str] = frozenset()
    # the mesh axes across TPU slices, whose collectives the megascale runtime sends over DCN ((): none)
    dcn: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[Collective]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Collective:
        return self.records[i]

    def norm_axes(self, axes: str | Iterable[str] | None) -> tuple[str, ...] | None:
        """'data' -> ('data',); put names in mesh order; unknown names fail loudly."""
        if axes is None:
            return None
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes if a not in self.mesh.names]
        if unknown:
            raise ValueError(f"axes {unknown} are not mesh axes {self.mesh.names}: name axes of the "
                             f"mesh the program was compiled for")
        return tuple(a for a in self.mesh.names if a in axes)

    def filter(self, op: str | Iterable[str] | None = None,
               axes: str | Iterable[str] | None = None, dtype: str | None = None, *,
               source: str | None = None, phase: str | None = None,
               reduction: str | None = None) -> Ledger:
        """Records with this op (or ops), exactly these axes, this dtype, from this `source` file
        or `file:line` (`source_matches`), in this `phase` (forward / backward), with this
        `reduction` (sum / max / min / and / or / product)."""
        ops = None if op is None else ((op,) if isinstance(op, str) else tuple(op))
        for o in ops or ():
            if o not in OPS:
                raise ValueError(f"unknown collective {o!r}; expected one of {OPS}")
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        if reduction is not None and reduction not in REDUCTIONS.values():
            raise ValueError(f"unknown reduction {reduction!r}; expected one of {tuple(REDUCTIONS.values())}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of HLO's element types {DTYPES}")
        if source is not None:
            self._check_source(source)
        want = self.norm_axes(axes)
        keep = [r for r in self.records
                if (ops is None or r.op in ops) and (want is None or r.axes == want)
                and (dtype is None or r.dtype == dtype) and (phase is None or r.phase == phase)
                and (reduction is None or r.reduction == reduction)
                and (source is None or source_matches(r.source, source))]
        return self.selected(keep)

    def selected(self, records: list[Collective]) -> Ledger:
        """A ledger of these records of the same program (its mesh, unparsed lines, sources)."""
        return dataclasses.replace(self, records=list(records))

    def _check_source(self, source: str) -> None:
        """Refuse a `source=` that names no instruction of the program (a typo would select nothing)."""
        if any(source_matches(s, source) for s in self.sources):
            return
        files = sorted({s.rpartition(":")[0] for s in self.sources})
        lines = sorted({int(s.rpartition(":")[2]) for s in self.sources
                        if source_matches(s, source.rpartition(":")[0] or source)}
                       if ":" in source else ())
        where = (f"lines of that file in the program: {lines[:40]}" if lines else
                 f"files in the program: {[os.path.basename(f) for f in files][:20]}" if files else
                 "the program carries no source metadata")
        raise ValueError(f"source {source!r} names no instruction of this program, so it would select "
                         f"nothing; {where}")

    def count(self, op: str | None = None, axes: str | Iterable[str] | None = None, **select: Any) -> int:
        """Multiplicity-weighted number of collectives (`select`: `filter`'s keywords)."""
        return sum(r.multiplicity for r in self.filter(op, axes, **select))

    def total_bytes(self, axes: str | Iterable[str] | None = None, op: str | None = None,
                    kind: str = "bytes", **select: Any) -> float:
        """Sum of `bytes` (or `ring_bytes`) x multiplicity over the matching records."""
        if kind not in ("bytes", "ring_bytes"):
            raise ValueError(f"kind must be 'bytes' or 'ring_bytes', got {kind!r}")
        return sum(getattr(r, kind) * r.multiplicity for r in self.filter(op, axes, **select))

    def summary(self) -> dict[tuple[str, tuple[str, ...]], dict[str, Any]]:
        """(op, axes) -> {count, bytes, ring_bytes} multiplicity-weighted (+ a permute's `patterns`)."""
        out: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
        for r in self.records:
            s = out.setdefault((r.op, r.axes), {"count": 0, "bytes": 0, "ring_bytes": 0.0})
            s["count"] += r.multiplicity
            s["bytes"] += r.bytes * r.multiplicity
            s["ring_bytes"] += r.ring_bytes * r.multiplicity
            if r.op == "collective-permute":
                patterns = s.setdefault("patterns", {})
                patterns[r.pattern] = patterns.get(r.pattern, 0) + r.multiplicity
        return out

    def patterns(self, axes: str | Iterable[str] | None = None) -> dict[str, int]:
        """pattern -> multiplicity-weighted count of the collective-permutes over `axes`."""
        out: dict[str, int] = {}
        for r in self.filter("collective-permute", axes):
            out[r.pattern] = out.get(r.pattern, 0) + r.multiplicity
        return out

    def rows(self) -> list[tuple[str, ...]]:
        """The table's rows: one per (op, reduction, axes, partial axes, permute pattern)."""
        groups: dict[tuple, list[Collective]] = {}
        for r in self.records:
            groups.setdefault((r.op, r.reduction, r.axes, r.partial_axes, r.pattern), []).append(r)
        lines = []
        for (op, reduction, axes, partial, pattern), recs in groups.items():
            names = [pattern] if pattern else [a + ("(part)" if a in partial else "") + ("(DCN)" if a in self.dcn else "")
                                               for a in axes]
            shapes = list(dict.fromkeys(f"{r.dtype}[{','.join(map(str, r.shape))}]"
                                        + (f"x{r.parts}" if r.parts > 1 else "") for r in recs))
            srcs = list(dict.fromkeys(_short_source(r) for r in recs))
            count = sum(r.multiplicity for r in recs)
            lines.append((
                f"{op} {reduction}".strip(), ",".join(names) or "-",
                f"{count}" + ("" if all(r.multiplicity_exact for r in recs) else "?"),
                " ".join(shapes[:2]) + (f" +{len(shapes) - 2}" if len(shapes) > 2 else ""),
                _human(sum(r.bytes * r.multiplicity for r in recs)),
                _human(sum(r.ring_bytes * r.multiplicity for r in recs)),
                ", ".join(srcs[:2]) + (f" +{len(srcs) - 2}" if len(srcs) > 2 else ""),
            ))
        return lines

    def table(self) -> str:
        """Fixed-width table, one row per (op, reduction, axes, partial axes, permute pattern)."""
        lines = self.rows()
        out = fixed_width(TABLE_HEAD, lines)
        if not lines:
            out.append("(no collectives)")
        mesh = ",".join(f"{n}={s}" for n, s in zip(self.mesh.names, self.mesh.shape))
        out.append(f"mesh: {mesh}   instructions: {self.instructions}"
                   f"   collectives: {sum(r.multiplicity for r in self.records)}"
                   f"   records: {len(self.records)}   unparsed: {len(self.unparsed)}")
        out += [f"  unparsed: {u[:200]}" for u in self.unparsed]
        out += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        """Plain-data form: mesh, instruction count, records, summary rows, unparsed lines, warnings."""
        return {
            "mesh": dict(zip(self.mesh.names, self.mesh.shape)),
            "instructions": self.instructions,
            "records": [dataclasses.asdict(r) for r in self.records],
            "summary": [{"op": op, "axes": list(axes), **v} for (op, axes), v in self.summary().items()],
            "unparsed": list(self.unparsed),
            "warnings": list(self.warnings),
        }

    def to_json(self, **kwargs: Any) -> str:
        """`as_dict()` as JSON text."""
        return json.dumps(self.as_dict(), **kwargs)

    def __str__(self) -> str:
        return self.table()


TABLE_HEAD = ("op", "axes", "count", "dtype[shape] examples", "bytes", "ring bytes", "source")


def fixed_width(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Header, rule and rows in columns as wide as their widest cell."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def fmt(row: Iterable[object]) -> str:
        return "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()

    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _short_source(r: Collective) -> str:
    if r.source:
        path, _, rest = r.source.partition(":")
        return os.path.basename(path) + ":" + rest.split(" ")[0]
    return r.op_name.rsplit("/", 1)[-1] if r.op_name else "-"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def _records(instr: Instr, op: str, mod: Module, mesh: MeshSpec, mult: tuple[int, bool, bool],
             done: Instr | None, gte_meta: dict[tuple[str, int], dict[str, str]]) -> list[Collective]:
    """Records of one collective instruction (several for a tuple all-reduce)."""
    nparts = mod.num_partitions or mesh.size
    pairs: tuple[tuple[int, int], ...] = ()
    if op == "collective-permute":
        if "source_target_pairs" not in instr.attrs:
            raise ValueError("collective-permute without source_target_pairs")
        pairs = tuple((a, b) for a, b in
                      (tuple(g) for g in explicit_groups(instr.attrs["source_target_pairs"])))
        if any(len(p) != 2 for p in pairs):
            raise ValueError("bad source_target_pairs")
        id_groups, pos_groups = [], pair_components(pairs)
        n = max((len(c) for c in pos_groups), default=1)
    else:
        rg = instr.attrs.get("replica_groups", "{}")
        id_groups, pos_groups = decode_replica_groups(rg, nparts)
        n = max(len(g) for g in pos_groups)
        if len({len(g) for g in pos_groups}) > 1:
            raise ValueError(f"replica groups of unequal size: {rg}")
    axes, partial = classify(pos_groups, mesh)
    permute: dict[str, Any] = {}
    if op == "collective-permute":
        coords, shifts, pattern = describe_permute(pairs, mesh)
        permute = {"coordinate_pairs": coords, "shifts": shifts, "pattern": pattern}
    shapes = _result_shapes(instr, op, done)
    parts = flat_shapes(shapes)
    if not parts:
        raise ValueError("collective with no array result")
    op_name, source = source_metadata(instr.attrs, mod.frames)
    common: dict[str, Any] = {
        "op": op, "replica_groups": tuple(tuple(g) for g in id_groups),
        "source_target_pairs": pairs, "axes": axes, "partial_axes": partial, "group_size": n,
        "multiplicity": mult[0], "name": instr.name, "computation": instr.computation,
        "is_async": instr.opcode.endswith("-start") or mult[2], "multiplicity_exact": mult[1],
        **permute,
    }
    if op in ("all-reduce", "reduce-scatter"):
        common["reduction"] = _reduction(instr, mod)
    if op in ("all-to-all", "ragged-all-to-all") or len(parts) == 1:
        total = sum(p.bytes for p in parts)
        return [Collective(dtype=parts[0].dtype, shape=parts[0].dims, bytes=total,
                           ring_bytes=ring_bytes(op, total, n), source=source, op_name=op_name,
                           phase=_phase(op_name), parts=len(parts), **common)]
    out = []
    for k, p in enumerate(parts):
        meta = gte_meta.get((done.name if done is not None else instr.name, k))
        k_op, k_src = source_metadata(meta, mod.frames) if meta else ("", "")
        out.append(Collective(dtype=p.dtype, shape=p.dims, bytes=p.bytes,
                              ring_bytes=ring_bytes(op, p.bytes, n), source=k_src or source,
                              op_name=k_op or op_name, phase=_phase(k_op or op_name),
                              tuple_index=k, **common))
    return out


def ledger(compiled_or_hlo_text: Any, mesh: Any) -> Ledger:
    """Every collective of a compiled program (or HLO module text) on `mesh` (a Mesh, AbstractMesh
    or {'data': 2, ...}; group ids read as row-major partition ids)."""
    return ledger_of_module(parsed_module(hlo_text(compiled_or_hlo_text)), mesh_spec(mesh))


def ledger_of_module(mod: Module, spec: MeshSpec) -> Ledger:
    """`ledger` of an already parsed module (the schedule reader parses once for both)."""
    instructions = sum(len(instrs) for instrs in mod.computations.values())
    dcn = megascale.dcn_axes(mod, spec)  # a program compiled for several slices is one slice's
    if mod.num_partitions not in (None, 1) and mod.num_partitions != spec.size and not dcn:
        raise ValueError(
            f"the program has num_partitions={mod.num_partitions} but the mesh "
            f"{dict(zip(spec.names, spec.shape))} has {spec.size} devices: pass the mesh it was compiled for"
        )
    warnings: list[str] = []
    mults = multiplicities(mod, warnings)
    async_starts, async_copies = async_fusion_copies(mod, warnings)
    done_of: dict[tuple[str, str], Instr] = {}
    gte_meta: dict[tuple[str, int], dict[str, str]] = {}
    for instrs in mod.computations.values():
        for i in instrs:
            if i.operands and (base_opcode(i.opcode)[1] == "done" or i.opcode == "async-done"):
                done_of[(i.computation, i.operands[0])] = i
            if i.opcode == "get-tuple-element" and "metadata=" in i.attr_text and "metadata" in i.attrs:
                idx = re.match(r"\d+", i.attrs.get("index", ""))
                if idx:
                    gte_meta[(i.operands[0], int(idx.group()))] = i.attrs
    records: list[Collective] = []
    unparsed = list(mod.bad_lines)
    sources = frozenset(src for instrs in mod.computations.values() for i in instrs
                        if "source_file" in i.attr_text or "stack_frame_id" in i.attr_text
                        for src in [source_metadata({"metadata": i.attr_text}, mod.frames)[1]] if src)
    for comp, instrs in mod.computations.items():
        for i in instrs:
            op, form = base_opcode(i.opcode)
            if op is None:
                if any(name in i.opcode for name in OPS):
                    unparsed.append(i.line)
                elif i.opcode == "async-start" and not any(
                        c in mod.computations for _, c in call_edges(i)) and any(
                        name in i.line for name in OPS):
                    unparsed.append(i.line)  # wrapped computation not printed
                continue
            if form in ("done", "update") or (comp, i.name) in async_copies:
                continue
            if form == "start" and any(c in mod.computations and _has_collective(mod.computations[c])
                                       for k, c in call_edges(i) if k == "calls"):
                continue  # sugared async wrapper whose computation is printed: counted inside
            try:
                mult = mults[comp]
                if comp in async_starts:
                    mult = (mult[0], mult[1], True)
                records += _records(i, op, mod, spec, mult, done_of.get((comp, i.name)), gte_meta)
            except (ValueError, KeyError, IndexError) as e:
                unparsed.append(f"{i.line}  [{e}]")
    records += _dcn_records(mod, spec, dcn, mults) if dcn else []
    if not any("jvp(" in i.attr_text for instrs in mod.computations.values() for i in instrs):  # nothing differentiated: every collective with metadata is the forward's
        records = [dataclasses.replace(r, phase="forward") if r.op_name else r for r in records]
    return Ledger(records, spec, unparsed, warnings, instructions, sources, dcn)


def _dcn_records(mod: Module, spec: MeshSpec, dcn: tuple[str, ...], mults) -> list[Collective]:
    """One record per megascale send/recv pair (twinshard/hlo/megascale.py): the collective across the
    slices over the `dcn` axes, named by its send (where the schedule reader's window opens)."""
    n = megascale.slices_of(spec, dcn)
    return [Collective(t.op, t.payload.dtype, t.payload.dims, t.payload.bytes, ring_bytes(t.op, t.payload.bytes, n),
                       (), (), dcn, (), n, mults[t.computation][0], "", "", t.send, t.computation, is_async=True,
                       multiplicity_exact=mults[t.computation][1], reduction=t.reduction)
            for t in megascale.transfers(mod)]


def _has_collective(instrs: list[Instr]) -> bool:
    return any(base_opcode(i.opcode)[0] is not None for i in instrs)
