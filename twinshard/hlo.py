"""The collective ledger: every collective of a compiled XLA program, one record each.

`ledger(compiled, mesh)` reads the optimized HLO text of a `jax.stages.Compiled`
(or any HLO module text) and returns a `Ledger` of `Collective` records: which
op, over which mesh axes, how many bytes, how many times per step, and which
line of our code asked for it. Tests assert on it (see `twinshard.testing`).
What is not a compiled program's HLO raises `NotCompiledHLO` (a ValueError)
saying what to pass: a `Lowered`, StableHLO text (`lowered.as_text()`), HLO
not yet compiled (`lowered.as_text(dialect='hlo')`), empty or unreadable text.

HLO formats handled (real lines, JAX 0.12.0.1 / XLA:CPU unless marked):

Replica groups. Group ids are *partition ids* = row-major positions in the
mesh, NOT `device.id`: a shard_map over a mesh whose devices are reversed still
prints `source_target_pairs={{0,4},{4,0},...}` for a ppermute over 'data'.

- mesh-named ("RGV3"), what shard_map emits, also GSPMD with renamed axes::

    %all_gather.3 = f32[16,4]{1,0} all-gather(%param.1), channel_id=1,
        replica_groups=mesh['data'=2,'tensor'=4] {'tensor'}, dimensions={0}, ...
    %all-reduce = f32[8,8]{1,0} all-reduce(%ynn_fusion), channel_id=1,
        replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, ...      (GSPMD)

  Sub-axes are `'name':(pre)size` (Shardy notation: split the axis into
  pre x size x rest and take the middle factor). Measured on the same program
  with `--xla_enable_rgv3_materialization=false`:
  `{'tensor':(1)2}` == `[4,2]<=[4,2]T(1,0)` and `{'tensor':(2)2}` == `[4,2]<=[8]`.
  Never seen printed here, but accepted by XLA's HLO parser, so decoded too:
  `mesh[...] {}` (no axes: every device alone) and
  `mesh[...], device_ids=(7,6,...) {'data'}` (ids = device_ids[position];
  axes are classified from positions).
- iota, with and without transpose (GSPMD, even with RGV3 on: mixed formats
  in one module)::

    %all-reduce = f32[8,2]{1,0} all-reduce(%ynn_fusion), channel_id=1,
        replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, ...
    %all-gather = f32[4,8]{0,1} all-gather(%all-reduce), channel_id=2,
        replica_groups=[4,2]<=[8], dimensions={1}, ...

- explicit `replica_groups={{0,4},{1,5},{2,6},{3,7}}` and `{}` (= all
  partitions in one group): accepted by the XLA parser, not printed by JAX
  0.12 on CPU for the programs tried; older JAX and hand-written HLO use them.

Ops and forms:

- sync ops print once: `all-gather`, `reduce-scatter`, `all-reduce`,
  `all-to-all`, `collective-permute` (with `source_target_pairs={{0,1},...}`),
  `collective-broadcast`, `ragged-all-to-all`.
- tuple all-reduce from the CPU combiner, split into one record per operand
  (each operand's source comes from its `get-tuple-element` user)::

    %all-reduce = (f32[4,4]{1,0}, f32[4,4]{1,0}) all-reduce(%param.1,
        %broadcast_multiply_fusion), channel_id=1, replica_groups=mesh[...] {'data'}, ...

- tuple all-to-all: XLA:CPU lowers `lax.all_to_all` over a group of n to an
  all-to-all of n operands, one per peer. That is ONE collective: one record,
  `shape` = one part, `parts` = n, `bytes` = all parts::

    %all-to-all = (f32[1,4]{1,0}, f32[1,4]{1,0}, f32[1,4]{1,0}, f32[1,4]{1,0})
        all-to-all(%wrapped_slice, ...), channel_id=1, replica_groups=mesh[...] {'tensor'}

- async pairs (GPU/TPU; CPU has none), counted once at `-start`, the result
  shape taken from the matching `-done` (TPU, libtpu 0.0.50.1)::

    %collective-permute-start = (f32[64,256]{1,0:T(8,128)S(1)}, f32[64,256]{...},
        u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%reduce_scatter.7), ...
    %collective-permute-done = f32[64,256]{1,0:T(8,128)S(1)} collective-permute-done(...)

  Also `all-gather-start/done`, `all-reduce-start/done` and the sugared async
  forms `reduce-scatter-start/done`, `all-to-all-start/done`.
  Measured: XLA's printer turns a hand-written `async-start(...),
  calls=%comp` wrapping a reduce-scatter into `reduce-scatter-start` /
  `reduce-scatter-done` and stops printing `%comp`.
- generic `async-start(...), calls=%comp`: the collective is the instruction
  inside `%comp`; it is counted there, once. XLA prints `calls=` on async-done
  too: call edges from `*-done` / `async-update` ops and from fusions named
  `*done*` are not call sites, unless the done side is the computation's only
  caller (next item).
- TPU async collective fusions (measured, libtpu 0.0.50.1 on v5e:4x4, for both
  GSPMD FSDP and shard_map all_gather programs): ONE collective is printed in
  every computation of its chain::

    %fused_computation.16 (...) -> (...) {            <- start: counted here
      %all-gather.25 = bf16[256,256]{...} all-gather(%param_0.42), channel_id=4, ...
      ROOT %custom-call.1 = (...) custom-call(%all-gather.25),
          custom_call_target="AsyncCollectiveStart" }
    %async_collective_fusion.19 (...) {              <- continuation: a copy
      ... compute overlapped with the gather ...
      %all-gather.27 = ... all-gather(%param_0.45), channel_id=4, ... }
    %fused_computation.18 (...) -> bf16[256,256] {    <- done: a copy
      %all-gather.29 = ... all-gather(%param_0.47), channel_id=4, ...
      ROOT %custom-call.3 = ... custom-call(..., %all-gather.29, ...),
          custom_call_target="AsyncCollectiveDone" }
    ENTRY ... {
      %async-collective-start = (...) fusion(%convert_element_type.13), kind=kCustom,
          calls=%fused_computation.16
      %fusion.19 = (...) fusion(%get-tuple-element.4, ...), kind=kOutput, calls=%async_collective_fusion.19
      %async-collective-done = bf16[256,256]{...} fusion(%get-tuple-element.19, ...),
          kind=kCustom, calls=%fused_computation.18

  Start computations: ROOT custom-call "AsyncCollectiveStart", or called by a
  fusion named `*async*start*`. Done computations: ROOT custom-call
  "AsyncCollectiveDone", or called only from the done side (whose fusion is
  then their call site: multiplicity as usual, no "no caller" warning).
  Continuations: 0 or more per collective (3 seen in one FSDP step). The
  collective is counted once, at the start. The copies are found by data flow:
  fusions that take the start's results (through get-tuple-element, then each
  continuation's) and whose computation holds a collective with the same op,
  channel_id, groups, dimensions and shape applied to those values. channel_id
  alone does not identify it: in a shard_map program three different
  all-gathers (two async) all printed channel_id=1. Where the flow does not
  reach, a done's collective with a start's key is still a copy; one with none
  is counted at the done, and a continuation-like one is counted, both with a
  ledger warning. Other TPU compiles here (v5e 2x4 / 4x4 and v5p 2x2x2, even
  with LIBTPU_INIT_ARGS=--xla_tpu_enable_async_collective_fusion...=true)
  printed plain sync all-gather / reduce-scatter / all-reduce and only
  `collective-permute-start/done`.

Loops. A collective inside a `while` body (a `lax.scan`) prints once; its
`multiplicity` is the product of the enclosing loops' trip counts, read from
`backend_config={..."known_trip_count":{"n":"3"}}` (XLA:CPU). Surprise: the
TPU compiler drops `known_trip_count` from the `while` (measured, libtpu
0.0.50.1: `%while.10 = (...) while(%tuple.20), condition=%wide.region_3.0_spmd,
body=%wide.region_1.0_spmd.sunk`), so it is inferred from a condition whose ROOT
is `compare(..., constant(N)), direction=LT` and the record is marked
`multiplicity_exact=False` (with a ledger warning). Conditional branches count
as taken (an upper bound); a computation called from k sites runs k times.

Sources. JAX 0.12 metadata carries `stack_frame_id=N`, not `source_file`:
`metadata={op_name="jit(f)/shard_map/all_gather" stack_frame_id=4}`; the module
header has `FileNames` / `FunctionNames` / `FileLocations` / `StackFrames`
tables, and the frame's own location is our line: `source` is "path:line".
Older `source_file="..." source_line=N` metadata is read too.

Measured on XLA:CPU: shard_map's `psum_scatter` is a real `reduce-scatter`
(GSPMD's FSDP backward is the one that becomes all-reduce + dynamic-slice);
`--xla_backend_optimization_level=0` leaves every record unchanged (same ops,
groups, shapes, multiplicities, tuple combining) for all programs in
tests/test_hlo.py.

Ring bytes (per device sent by a ring algorithm, n = group size):
all-gather (n-1)/n x result; reduce-scatter (n-1) x result (= (n-1)/n x operand);
all-reduce 2(n-1)/n x bytes; all-to-all and ragged-all-to-all (n-1)/n x bytes;
collective-permute and collective-broadcast: bytes.

Who sends to whom. A collective-permute's `source_target_pairs` are decoded to
mesh coordinates (`coordinate_pairs`), one `Shift` per axis they move along, and
a `pattern`: 'stage +1' when every device sends one step along `stage` and the
last sends nothing (a line), 'context ring -1' when every device sends one step
back around a ring, and a description marked irregular for any other set (a
pair extra or missing, both directions, a pair moving along two axes). The
pattern is the permute's axes column in `table()` and counted per pattern in
`summary()`; `twinshard.testing.expect_permute` asserts it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

OPS: tuple[str, ...] = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)
_LOOKS_COLLECTIVE = re.compile(
    r"(?:ragged-all-to-all|all-gather|reduce-scatter|all-reduce|all-to-all"
    r"|collective-permute|collective-broadcast)[\w-]*\("
)
_DTYPE_BITS: dict[str, int] = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8,
    "f8e4m3fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e3m4": 8, "token": 0,
}


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
    # collective-permute only: the pairs as mesh coordinates (mesh order), one Shift per
    # axis they move along, and `pattern`, what the pairs do in words (see describe_permute)
    coordinate_pairs: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    shifts: tuple[Shift, ...] = ()
    pattern: str = ""


@dataclass(frozen=True)
class Shift:
    """How a collective-permute moves data along one mesh axis.

    `steps`: the signed steps of its pairs along `axis`, sorted (+1 = to the next index);
    `wrap`: some pair goes around the end (n-1 -> 0 is a step of +1), as a ring does; a line
    (no wrap) leaves the device whose target would fall off the end sending nothing.
    """

    axis: str
    steps: tuple[int, ...]
    wrap: bool


@dataclass(frozen=True)
class MeshSpec:
    """Axis names and sizes; partition id = row-major position."""

    names: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def mesh_spec(mesh: Any) -> MeshSpec:
    """Normalise a `jax.sharding.Mesh`, `AbstractMesh` or `{'data': 2, ...}` dict."""
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, Mapping):
        names, sizes = tuple(mesh), tuple(int(v) for v in mesh.values())
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "axis_sizes"):
        names, sizes = tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes)
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "devices"):
        names, sizes = tuple(mesh.axis_names), tuple(np.shape(mesh.devices))
    else:
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh or a dict like {{'data': 2, 'tensor': 4}}, "
            f"got {type(mesh).__name__}"
        )
    if len(names) != len(sizes) or any(s < 1 for s in sizes):
        raise ValueError(f"mesh axes {names} and sizes {sizes} do not match")
    return MeshSpec(tuple(str(n) for n in names), sizes)


# ----------------------------------------------------------------------------- text utils



def _unquoted(s: str, start: int = 0):
    """(index, char, bracket depth after it) for every character outside double quotes."""
    depth, quote = 0, False
    for j in range(start, len(s)):
        c = s[j]
        if quote:
            if c == '"' and s[j - 1] != "\\":
                quote = False
            continue
        if c == '"':
            quote = True
            continue
        depth += (c in "([{") - (c in ")]}")
        yield j, c, depth


def _match_close(s: str, i: int) -> int:
    """Index of the bracket closing s[i], skipping double-quoted strings."""
    for j, c, depth in _unquoted(s, i):
        if depth == 0 and c in ")]}":
            return j
    raise ValueError(f"unbalanced brackets in {s[i:i + 80]!r}")


def _split_top(s: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside brackets and double quotes."""
    parts, start = [], 0
    for j, c, depth in _unquoted(s):
        if c == sep and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_attrs(tail: str) -> dict[str, str]:
    """`, a=1, b={..}` -> {'a': '1', 'b': '{..}'}; re-joins `mesh[..], device_ids=(..) {..}`."""
    out: dict[str, str] = {}
    last = None
    for piece in _split_top(tail):
        key, eq, value = piece.partition("=")
        if not eq:
            continue
        key = key.strip()
        if key == "device_ids" and last == "replica_groups" and out[last].startswith("mesh"):
            out[last] += ", " + piece
            continue
        out[key] = value.strip()
        last = key
    return out


@dataclass(frozen=True)
class _Shape:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        if self.dtype not in _DTYPE_BITS:
            raise ValueError(f"unknown HLO element type {self.dtype!r}")
        return math.prod(self.dims) * _DTYPE_BITS[self.dtype] // 8


_ARRAY = re.compile(r"^([a-z][a-z0-9]*)\[([^\]]*)\]")


def _parse_shape(text: str) -> _Shape | list:
    """`f32[16,4]{1,0}` -> _Shape; `(a, (b, c))` -> nested list of _Shape."""
    text = text.strip()
    if text.startswith("("):
        inner = text[1:_match_close(text, 0)]
        return [_parse_shape(p) for p in _split_top(inner)]
    m = _ARRAY.match(text)
    if not m:
        raise ValueError(f"cannot read shape {text!r}")
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    return _Shape(m.group(1), dims)


# ----------------------------------------------------------------------------- module parse


@dataclass
class _Instr:
    name: str
    shape_text: str
    opcode: str
    operands: list[str]
    attr_text: str
    computation: str
    line: str
    is_root: bool

    @functools.cached_property
    def attrs(self) -> dict[str, str]:
        """Attributes, parsed on first use (most instructions never need them)."""
        return _parse_attrs(self.attr_text)


@dataclass
class _Module:
    computations: dict[str, list[_Instr]] = field(default_factory=dict)
    entry: str | None = None
    num_partitions: int | None = None
    frames: dict[int, str] = field(default_factory=dict)  # stack_frame_id -> "file:line"
    bad_lines: list[str] = field(default_factory=list)  # collective-looking, unreadable


_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")


def _parse_instr(line: str, computation: str) -> _Instr:
    m = _INSTR.match(line)
    if not m:
        raise ValueError("not an instruction")
    rest = m.group(3).strip()
    if rest.startswith("("):
        end = _match_close(rest, 0)
        shape_text, rest = rest[: end + 1], rest[end + 1 :]
    else:
        shape_text, _, rest = rest.partition(" ")
    om = re.match(r"\s*([\w\-]+)\(", rest)
    if not om:
        raise ValueError("no opcode")
    open_at = om.end() - 1
    close_at = _match_close(rest, open_at)
    operands = [p.split()[-1].lstrip("%") for p in _split_top(rest[open_at + 1 : close_at])]
    return _Instr(m.group(2), shape_text, om.group(1), operands, rest[close_at + 1 :], computation,
                  line.strip(), bool(m.group(1)))


def _parse_frames(sections: dict[str, list[str]]) -> dict[int, str]:
    """Resolve the StackFrames table to 'file:line' per frame id (the frame's own line)."""
    def table(name: str) -> dict[int, str]:
        rows = {}
        for row in sections.get(name, []):
            k, _, v = row.strip().partition(" ")
            if k.isdigit():
                rows[int(k)] = v.strip()
        return rows

    files = {k: v.strip('"') for k, v in table("FileNames").items()}
    locs = {}
    for k, v in table("FileLocations").items():
        f = re.search(r"file_name_id=(\d+)", v)
        ln = re.search(r"\bline=(\d+)", v)
        if f and ln:
            locs[k] = f"{files.get(int(f.group(1)), '?')}:{ln.group(1)}"
    frames = {}
    for k, v in table("StackFrames").items():
        loc = re.search(r"file_location_id=(\d+)", v)
        if loc and int(loc.group(1)) in locs:
            frames[k] = locs[int(loc.group(1))]
    return frames


def _parse_module(text: str) -> _Module:
    """Split HLO module text into computations of instructions (linear scan)."""
    mod = _Module()
    current: str | None = None
    sections: dict[str, list[str]] = {}
    section: str | None = None
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw).rstrip()
        stripped = line.strip()
        if stripped.startswith("//"):
            continue
        if not stripped:
            section = None if current is None else section
            continue
        if current is None:
            if stripped.startswith("HloModule"):
                m = re.search(r"num_partitions=(\d+)", stripped)
                mod.num_partitions = int(m.group(1)) if m else None
                continue
            if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section = stripped
                sections[section] = []
                continue
            if section is not None and re.match(r"^\d+ ", stripped):
                sections[section].append(stripped)
                continue
            h = _HEADER.match(line)
            if h and not _INSTR.match(line):
                current = h.group(2)
                mod.computations[current] = []
                if h.group(1):
                    mod.entry = current
                continue
            if _LOOKS_COLLECTIVE.search(stripped):
                mod.bad_lines.append(stripped)
            continue
        if stripped == "}":
            current = None
            continue
        try:
            mod.computations[current].append(_parse_instr(line, current))
        except ValueError:
            if _LOOKS_COLLECTIVE.search(stripped):
                mod.bad_lines.append(stripped)
    mod.frames = _parse_frames(sections)
    return mod


# ----------------------------------------------------------------------------- replica groups


def _iota_groups(text: str) -> list[list[int]]:
    """`[4,2]<=[2,4]T(1,0)` -> reshape(transpose(iota.reshape(2,4), (1,0)), (4,2))."""
    m = re.fullmatch(r"\[([\d,\s]+)\]\s*<=\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?", text.strip())
    if not m:
        raise ValueError(f"bad iota replica groups {text!r}")
    out_shape = [int(x) for x in m.group(1).split(",")]
    src_shape = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(src_shape)).reshape(src_shape)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(out_shape[0], -1).tolist()


def _explicit_groups(text: str) -> list[list[int]]:
    """`{{0,4},{1,5}}` -> [[0,4],[1,5]]; `{}` -> []."""
    inner = text.strip()
    if not (inner.startswith("{") and inner.endswith("}")):
        raise ValueError(f"bad replica groups {text!r}")
    return [[int(x) for x in g.split(",") if x.strip()]
            for g in re.findall(r"\{([^{}]*)\}", inner[1:-1])]


def _mesh_groups(text: str) -> tuple[list[list[int]], list[list[int]]]:
    """`mesh['data'=2,'tensor'=4] {'tensor':(1)2}` -> (id groups, position groups)."""
    m = re.fullmatch(
        r"mesh\[([^\]]*)\]\s*(?:,\s*device_ids=\((.*?)\))?\s*\{([^{}]*)\}", text.strip()
    )
    if not m:
        raise ValueError(f"bad mesh replica groups {text!r}")
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    refs = []  # (axis index, stride, size): sub-coordinate = coord // stride % size
    for ref in _split_top(m.group(3)):
        r = re.fullmatch(r"'([^']+)'(?::\((\d+)\)(\d+))?", ref)
        if not r or r.group(1) not in names:
            raise ValueError(f"bad mesh axis {ref!r} in {text!r}")
        i = names.index(r.group(1))
        pre, size = (int(r.group(2)), int(r.group(3))) if r.group(2) else (1, sizes[i])
        if sizes[i] % (pre * size):
            raise ValueError(f"sub-axis {ref!r} does not divide {names[i]}={sizes[i]}")
        refs.append((i, sizes[i] // (pre * size), size))
    coords = np.indices(sizes).reshape(len(sizes), -1)  # [axis, position]
    key = coords.copy()
    rank = np.zeros(coords.shape[1], dtype=np.int64)
    for i, stride, size in refs:
        sub = coords[i] // stride % size
        key[i] -= sub * stride
        rank = rank * size + sub
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for pos in range(coords.shape[1]):
        groups.setdefault(tuple(key[:, pos]), []).append((int(rank[pos]), pos))
    pos_groups = sorted([p for _, p in sorted(g)] for g in groups.values())
    device_ids = None
    if m.group(2):
        device_ids = (_iota_groups(m.group(2))[0] if "<=" in m.group(2)
                      else [int(x) for x in m.group(2).split(",")])
    id_groups = pos_groups if device_ids is None else [[device_ids[p] for p in g] for g in pos_groups]
    return id_groups, pos_groups


def decode_replica_groups(text: str, num_partitions: int) -> tuple[list[list[int]], list[list[int]]]:
    """Any printed replica_groups -> (groups of ids, groups of mesh positions)."""
    text = text.strip()
    if text.startswith("mesh"):
        return _mesh_groups(text)
    groups = _iota_groups(text) if text.startswith("[") else _explicit_groups(text)
    if not groups:
        groups = [list(range(num_partitions))]
    return groups, groups


# ----------------------------------------------------------------------------- axes


def classify(groups: Iterable[Iterable[int]], mesh: MeshSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Mesh axes whose coordinate varies within a group, and those not fully covered."""
    varying, partial = set(), set()
    for g in groups:
        g = sorted(set(g))
        if not g:
            continue
        if max(g) >= mesh.size or min(g) < 0:
            raise ValueError(f"partition id {max(g)} is outside mesh {dict(zip(mesh.names, mesh.shape))}")
        coords = np.array(np.unravel_index(g, mesh.shape))  # [axis, member]
        vary = [i for i in range(len(mesh.shape)) if len(set(coords[i])) > 1]
        varying.update(vary)
        full = math.prod(mesh.shape[i] for i in vary)
        for i in vary:
            if len(set(coords[i])) < mesh.shape[i] or len(g) < full:
                partial.add(i)
    def in_mesh_order(axes: set[int]) -> tuple[str, ...]:
        return tuple(mesh.names[i] for i in sorted(axes))

    return in_mesh_order(varying), in_mesh_order(partial)


def _components(pairs: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Connected components of a permutation's pair graph."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s, t in pairs:
        parent[find(s)] = find(t)
    comps: dict[int, list[int]] = {}
    for x in list(parent):
        comps.setdefault(find(x), []).append(x)
    return sorted(sorted(c) for c in comps.values())


# ----------------------------------------------------------------------------- permutes


def shift_pairs(mesh: Any, shift: Mapping[str, int], wrap: bool) -> frozenset[tuple[int, int]]:
    """Source-target pairs (partition ids) of every device sending `shift[axis]` steps along
    each named axis, its other coordinates kept. wrap=True: modulo the axis size (a ring,
    every device sends); wrap=False: a device whose target falls off the end sends nothing
    (a line: the last stage of a pipeline)."""
    spec = mesh_spec(mesh)
    coords = np.indices(spec.shape).reshape(len(spec.shape), -1)  # [axis, position]
    target = coords.copy()
    for axis, k in shift.items():
        if axis not in spec.names:
            raise ValueError(f"axis {axis!r} is not a mesh axis {spec.names}")
        target[spec.names.index(axis)] += int(k)
    size = np.array(spec.shape)[:, None]
    keep = np.ones(coords.shape[1], bool) if wrap else ((target >= 0) & (target < size)).all(0)
    src = np.ravel_multi_index(coords[:, keep], spec.shape)
    dst = np.ravel_multi_index(target[:, keep] % size, spec.shape)
    return frozenset(zip(src.tolist(), dst.tolist()))


def ring_step(k: int, n: int) -> int:
    """The step of a ring of n printed for `k`: k mod n in (-n/2, n/2] (on 2 devices +1 and -1
    are one ring, printed +1)."""
    r = k % n
    return r - n if r > n / 2 else r


def shift_pattern(axis: str, k: int, n: int, wrap: bool) -> str:
    """`pattern` of a permute sending every device k steps along `axis` of size n:
    'stage +1' (a line), 'context ring -1' (a ring)."""
    return f"{axis} ring {ring_step(k, n):+d}" if wrap else f"{axis} {k:+d}"


def _pair_step(d: int, n: int) -> tuple[int, bool]:
    """(step, wraps) of one pair moving d along an axis of n: the shorter way round; a tie
    does not wrap."""
    w = d - n if d > 0 else d + n
    return (w, True) if abs(w) < abs(d) else (d, False)


def describe_permute(pairs: Iterable[tuple[int, int]], mesh: Any) -> tuple[
        tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], tuple[Shift, ...], str]:
    """(pairs as mesh coordinates, shifts, pattern) of a collective-permute's pairs.

    The pattern is `shift_pattern`'s when the pairs are exactly `shift_pairs(mesh, {axis: k},
    wrap)` for one axis: a line ('stage +1', every device but the last sends to the next) or
    a ring ('context ring +1'). Any other set - a pair missing or extra, steps of both signs,
    a pair that moves along two axes - is described per axis and marked irregular:
    'stage -1/+1 (irregular, 4 pairs)'.
    """
    spec = mesh_spec(mesh)
    pairs = tuple(pairs)
    if not pairs:
        return (), (), "no pairs"
    ids = np.array(pairs)
    if ids.min() < 0 or ids.max() >= spec.size:
        raise ValueError(f"partition id {ids.max()} is outside mesh {dict(zip(spec.names, spec.shape))}")
    src = np.array(np.unravel_index(ids[:, 0], spec.shape)).T  # [pair, axis]
    dst = np.array(np.unravel_index(ids[:, 1], spec.shape)).T
    coords = tuple((tuple(map(int, s)), tuple(map(int, t))) for s, t in zip(src, dst))
    delta = dst - src
    moved = [i for i in range(len(spec.shape)) if delta[:, i].any()]
    got = frozenset(pairs)
    if len(moved) == 1 and len(got) == len(pairs):
        i = moved[0]
        axis, n, raw = spec.names[i], spec.shape[i], sorted(set(delta[:, i].tolist()))
        if len(raw) == 1 and shift_pairs(spec, {axis: raw[0]}, False) == got:
            return coords, (Shift(axis, (raw[0],), False),), shift_pattern(axis, raw[0], n, False)
        k = ring_step(raw[0], n)
        if shift_pairs(spec, {axis: k}, True) == got:
            return coords, (Shift(axis, (k,), True),), shift_pattern(axis, k, n, True)
    shifts = []
    for i in moved:
        steps = [_pair_step(int(d), spec.shape[i]) for d in delta[:, i] if d]
        shifts.append(Shift(spec.names[i], tuple(sorted({s for s, _ in steps})), any(w for _, w in steps)))
    words = ", ".join(f"{s.axis} {'ring ' if s.wrap else ''}{'/'.join(f'{k:+d}' for k in s.steps)}"
                      for s in shifts) or "none"
    cross = ", crosses axes" if ((delta != 0).sum(1) > 1).any() else ""
    return coords, tuple(shifts), f"{words} (irregular{cross}, {len(pairs)} pairs)"


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


# ----------------------------------------------------------------------------- multiplicity


_CALL_KEYS = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation"
    r"|branch_computations|called_computations)="
)


def _is_done_side(instr: _Instr) -> bool:
    """`*-done`, `async-update`/`async-done`, and fusions named `*done*` (TPU)."""
    op = instr.opcode
    return (op.endswith("-done") or op in ("async-update", "async-done")
            or (op == "fusion" and "done" in instr.name))


def _call_edges(instr: _Instr) -> list[tuple[str, str]]:
    """(attribute, callee) edges of an instruction, minus async-done style back edges."""
    return [] if _is_done_side(instr) else _edges(instr)


def _done_edges(instr: _Instr) -> list[tuple[str, str]]:
    """The edges `_call_edges` leaves out: those of done-side ops."""
    return _edges(instr) if _is_done_side(instr) else []


def _edges(instr: _Instr) -> list[tuple[str, str]]:
    if not _CALL_KEYS.search(instr.attr_text):
        return []
    edges = []
    for key in ("calls", "to_apply", "body", "condition", "true_computation", "false_computation"):
        if key in instr.attrs:
            edges += [(key, c) for c in re.findall(r"%?([\w.\-]+)", instr.attrs[key])]
    for key in ("branch_computations", "called_computations"):
        if key in instr.attrs:
            edges += [(key, c) for c in re.findall(r"%?([\w.\-]+)", instr.attrs[key])]
    return edges


def _trip_count(w: _Instr, mod: _Module) -> tuple[int | None, bool]:
    """(trip count, exact) of a while: known_trip_count, else `i < constant(N)`."""
    config = w.attrs.get("backend_config", "")
    m = re.search(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)', config)
    if m:
        return int(m.group(1)), True
    cond = re.findall(r"%?([\w.\-]+)", w.attrs.get("condition", ""))
    instrs = mod.computations.get(cond[0], []) if cond else []
    consts = {i.name: i for i in instrs if i.opcode == "constant"}
    for i in instrs:
        if i.is_root and i.opcode == "compare" and i.attrs.get("direction") == "LT":
            c = consts.get(i.operands[-1]) if i.operands else None
            if c is not None:
                n = re.match(r"\s*(-?\d+)", c.line.split("constant(", 1)[1])
                if n:
                    return max(int(n.group(1)), 0), False
    return None, False


def _multiplicities(mod: _Module, warnings: list[str]) -> dict[str, tuple[int, bool, bool]]:
    """computation -> (times run per call of ENTRY, exact?, reached through async?)."""
    callers: dict[str, list[tuple[str, _Instr, str]]] = {}
    done_callers: dict[str, list[tuple[str, _Instr, str]]] = {}
    for comp, instrs in mod.computations.items():
        for instr in instrs:
            for key, callee in _call_edges(instr):
                callers.setdefault(callee, []).append((comp, instr, key))
            for key, callee in _done_edges(instr):
                done_callers.setdefault(callee, []).append((comp, instr, key))
    # A computation called only from the done side (TPU `%async-collective-done =
    # fusion(...), calls=%c`) runs once per done: that is its caller. Where the
    # start also calls it (generic async-start/-done), the done edge is a back edge.
    for callee, sites in done_callers.items():
        callers.setdefault(callee, sites)
    memo: dict[str, tuple[int, bool, bool]] = {}
    warned: set[str] = set()

    def visit(comp: str, stack: frozenset[str]) -> tuple[int, bool, bool]:
        if comp in memo:
            return memo[comp]
        if comp == mod.entry:
            return 1, True, False
        if comp in stack:
            return 0, False, False
        sites = callers.get(comp, [])
        if not sites:
            if mod.entry is not None:
                warnings.append(f"computation %{comp} has no caller; its collectives counted once")
            return 1, True, False
        total, exact, is_async = 0, True, False
        for parent, instr, key in sites:
            n, ex, asy = visit(parent, stack | {comp})
            factor = 1
            if instr.opcode == "while" and key in ("body", "condition"):
                trips, known = _trip_count(instr, mod)
                if trips is None:
                    trips, known = 1, False
                    msg = f"while %{instr.name}: trip count unknown, body counted once"
                else:
                    msg = (f"while %{instr.name}: no known_trip_count, inferred {trips} "
                           f"from its condition")
                if not known and instr.name not in warned:
                    warned.add(instr.name)
                    warnings.append(msg)
                factor = trips + (1 if key == "condition" else 0)
                ex = ex and known
            asy = asy or instr.opcode == "async-start" or (
                instr.opcode == "fusion" and "async" in instr.name)
            total += n * factor
            exact, is_async = exact and ex, is_async or asy
        memo[comp] = (total, exact, is_async)
        return memo[comp]

    return {comp: visit(comp, frozenset()) for comp in mod.computations}


# ----------------------------------------------------------------------------- TPU async collective fusions


def _root_call_target(instrs: list[_Instr]) -> str:
    """custom_call_target of a computation's ROOT custom-call ('' if none)."""
    root = next((i for i in instrs if i.is_root), None)
    if root is None or root.opcode != "custom-call":
        return ""
    return root.attrs.get("custom_call_target", "").strip('"')


def _copy_key(instr: _Instr) -> tuple | None:
    """What every printed copy of one async collective shares (None: not a collective).

    channel_id alone is not enough: measured (libtpu 0.0.50.1, shard_map FSDP on
    v5e:4x4), three distinct all-gathers, two of them async, all had channel_id=1.
    """
    op = _base_op(instr.opcode)[0]
    if op is None:
        return None
    a = instr.attrs
    try:
        shape = repr(_parse_shape(instr.shape_text))  # layouts differ between copies
    except ValueError:
        shape = instr.shape_text
    return (op, a.get("channel_id"), a.get("replica_groups"), a.get("source_target_pairs"),
            a.get("dimensions"), shape)


def _chain_copies(start: _Instr, instrs: list[_Instr], keys: set[tuple], mod: _Module,
                  dones: set[str]) -> set[tuple[str, str]]:
    """Copies of the start's collective along its chain, followed by data flow.

    The chain's values are the start fusion, each continuation fusion, and their
    get-tuple-elements. A fusion that takes chain values is a continuation (or the
    done, which ends the chain) when its computation holds a collective with the
    start's key whose operands are all parameters bound to chain values.
    """
    state, found, changed = {start.name}, set(), True
    while changed:
        changed = False
        for i in instrs:
            if i.name in state:
                continue
            bound = {n for n, o in enumerate(i.operands) if o in state}
            if not bound:
                continue
            if i.opcode == "get-tuple-element":
                state.add(i.name)
                changed = True
            if i.opcode != "fusion":
                continue
            hits = []
            for key, c in _edges(i):
                body = mod.computations.get(c, []) if key == "calls" else []
                params = {x.name: int(x.operands[0]) for x in body
                          if x.opcode == "parameter" and x.operands and x.operands[0].isdigit()}
                hits += [(c, x.name) for x in body if x.operands and _copy_key(x) in keys
                         and all(params.get(o) in bound for o in x.operands)]
            found.update(hits)
            if hits and not (_is_done_side(i) or any(c in dones for c, _ in hits)):
                state.add(i.name)
                changed = True
    return found


def _async_fusion_copies(mod: _Module, warnings: list[str]) -> tuple[set[str], set[tuple[str, str]]]:
    """(start computations, {(computation, instr)} of copies) of TPU async collective fusions.

    One async collective is printed once per computation of its chain: the
    start's (ROOT custom-call "AsyncCollectiveStart", or called by a fusion named
    *async*start*), each continuation's (compute fused with the in-flight
    collective, called by a plain fusion) and the done's (ROOT custom-call
    "AsyncCollectiveDone", or called only from the done side). It is counted at
    the start; the others are copies, found by data flow from the start fusion.
    Fallbacks, where data flow does not reach (e.g. state carried through a
    loop): a done's collective with a start's key is a copy; one without is
    counted at the done, with a warning; a continuation-like one is counted,
    with a warning.
    """
    regular, done_only, fusion_only = set(), set(), {}
    for instrs in mod.computations.values():
        for i in instrs:
            for _, callee in _call_edges(i):
                regular.add(callee)
                fusion_only[callee] = fusion_only.get(callee, True) and i.opcode == "fusion"
            done_only.update(c for _, c in _done_edges(i))
    done_only -= regular
    starts, dones = set(), set()
    for comp, instrs in mod.computations.items():
        target = _root_call_target(instrs)
        if target == "AsyncCollectiveStart":
            starts.add(comp)
        elif target == "AsyncCollectiveDone" or comp in done_only:
            dones.add(comp)
        for i in instrs:
            if i.opcode == "fusion" and "async" in i.name and "start" in i.name:
                starts.update(c for k, c in _call_edges(i) if k == "calls")
    keys_of = {c: {k for i in mod.computations.get(c, []) if (k := _copy_key(i))} for c in starts}
    all_keys = set().union(*keys_of.values())
    copies: set[tuple[str, str]] = set()
    for instrs in mod.computations.values():
        for i in instrs:
            if i.opcode == "fusion":
                keys = set().union(*(keys_of.get(c, set()) for k, c in _edges(i) if k == "calls"))
                if keys:
                    copies |= _chain_copies(i, instrs, keys, mod, dones)
    for comp, instrs in mod.computations.items():
        if comp in starts or not (comp in dones or fusion_only.get(comp)):
            continue
        for i in instrs:
            k = _copy_key(i)
            if k is None or (comp, i.name) in copies:
                continue
            if comp in dones and k in all_keys:
                copies.add((comp, i.name))
            elif comp in dones:
                warnings.append(f"async done %{comp}: %{i.name} matches no async start; "
                                f"counted at the done")
            elif k in all_keys:
                warnings.append(f"%{i.name} in %{comp} looks like a copy of an async start's "
                                f"collective but does not take its state; counted")
    return starts, copies


# ----------------------------------------------------------------------------- ledger


def _flat(shape: _Shape | list) -> list[_Shape]:
    return [shape] if isinstance(shape, _Shape) else [s for x in shape for s in _flat(x)]


def _metadata(attrs: dict[str, str], frames: dict[int, str]) -> tuple[str, str]:
    """(op_name, 'file:line') from a metadata={...} attribute."""
    meta = attrs.get("metadata", "")
    op = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
    file = re.search(r'source_file="((?:[^"\\]|\\.)*)"', meta)
    line = re.search(r"source_line=(\d+)", meta)
    frame = re.search(r"stack_frame_id=(\d+)", meta)
    source = ""
    if file:
        source = file.group(1) + (f":{line.group(1)}" if line else "")
    elif frame:
        source = frames.get(int(frame.group(1)), "")
    return (op.group(1) if op else ""), source


def _result_shapes(instr: _Instr, base_op: str, done: _Instr | None) -> list[_Shape] | list:
    """Result shape (list of parts) of a sync op or of an async start (from its done)."""
    if done is not None:
        return _parse_shape(done.shape_text)
    shape = _parse_shape(instr.shape_text)
    if not instr.opcode.endswith("-start") or base_op == "all-reduce":
        return shape
    if isinstance(shape, list) and len(shape) > 1:
        return shape[1]  # (operands, result[, context...])
    return shape


@dataclass
class Ledger:
    """All collectives of one compiled program, plus what could not be read.

    `instructions` is how many HLO instructions `ledger()` parsed from the
    module (> 0 for any real program, even one with no collectives). A Ledger
    built by hand has 0, and every `twinshard.testing.expect_*` refuses it: an
    empty ledger proves "no collectives" only when a module was actually read.
    """

    records: list[Collective]
    mesh: MeshSpec
    unparsed: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    instructions: int = 0

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
            raise ValueError(f"axes {unknown} are not mesh axes {self.mesh.names}")
        return tuple(a for a in self.mesh.names if a in axes)

    def filter(self, op: str | Iterable[str] | None = None,
               axes: str | Iterable[str] | None = None, dtype: str | None = None) -> Ledger:
        """Records with this op (or ops), exactly these axes, this dtype."""
        ops = None if op is None else ((op,) if isinstance(op, str) else tuple(op))
        for o in ops or ():
            if o not in OPS:
                raise ValueError(f"unknown collective {o!r}; expected one of {OPS}")
        want = self.norm_axes(axes)
        keep = [r for r in self.records
                if (ops is None or r.op in ops) and (want is None or r.axes == want)
                and (dtype is None or r.dtype == dtype)]
        return Ledger(keep, self.mesh, self.unparsed, self.warnings, self.instructions)

    def count(self, op: str | None = None, axes: str | Iterable[str] | None = None) -> int:
        """Multiplicity-weighted number of collectives."""
        return sum(r.multiplicity for r in self.filter(op, axes))

    def total_bytes(self, axes: str | Iterable[str] | None = None, op: str | None = None,
                    kind: str = "bytes") -> float:
        """Sum of `bytes` (or `ring_bytes`) x multiplicity over the matching records."""
        if kind not in ("bytes", "ring_bytes"):
            raise ValueError(f"kind must be 'bytes' or 'ring_bytes', got {kind!r}")
        return sum(getattr(r, kind) * r.multiplicity for r in self.filter(op, axes))

    def summary(self) -> dict[tuple[str, tuple[str, ...]], dict[str, Any]]:
        """(op, axes) -> {count, bytes, ring_bytes}, all multiplicity-weighted; a
        collective-permute's entry also has `patterns`: {pattern: count}."""
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
        """pattern -> multiplicity-weighted count of the collective-permutes over `axes`
        (None: any), e.g. {'stage +1': 7, 'stage -1': 7}."""
        out: dict[str, int] = {}
        for r in self.filter("collective-permute", axes):
            out[r.pattern] = out.get(r.pattern, 0) + r.multiplicity
        return out

    def table(self) -> str:
        """Fixed-width table, one row per (op, axes, partial axes, permute pattern); a
        collective-permute's axes column is its pattern ('stage +1', 'context ring -1')."""
        rows: dict[tuple, list[Collective]] = {}
        for r in self.records:
            rows.setdefault((r.op, r.axes, r.partial_axes, r.pattern), []).append(r)
        head = ("op", "axes", "count", "dtype[shape] examples", "bytes", "ring bytes", "source")
        lines = []
        for (op, axes, partial, pattern), recs in rows.items():
            names = [pattern] if pattern else [a + ("(part)" if a in partial else "") for a in axes]
            shapes = list(dict.fromkeys(f"{r.dtype}[{','.join(map(str, r.shape))}]"
                                        + (f"x{r.parts}" if r.parts > 1 else "") for r in recs))
            srcs = list(dict.fromkeys(_short_source(r) for r in recs))
            count = sum(r.multiplicity for r in recs)
            lines.append((
                op, ",".join(names) or "-",
                f"{count}" + ("" if all(r.multiplicity_exact for r in recs) else "?"),
                " ".join(shapes[:2]) + (f" +{len(shapes) - 2}" if len(shapes) > 2 else ""),
                _human(sum(r.bytes * r.multiplicity for r in recs)),
                _human(sum(r.ring_bytes * r.multiplicity for r in recs)),
                ", ".join(srcs[:2]) + (f" +{len(srcs) - 2}" if len(srcs) > 2 else ""),
            ))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]

        def fmt(row: Iterable[object]) -> str:
            return "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()

        out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines]
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


def _base_op(opcode: str) -> tuple[str | None, str]:
    """opcode -> (collective op, form) with form in sync/start/done/other."""
    if opcode in OPS:
        return opcode, "sync"
    for suffix in ("start", "done", "update"):
        if opcode.endswith("-" + suffix) and opcode[: -len(suffix) - 1] in OPS:
            return opcode[: -len(suffix) - 1], suffix
    return None, "other"


def _records(instr: _Instr, op: str, mod: _Module, mesh: MeshSpec, mult: tuple[int, bool, bool],
             done: _Instr | None, gte_meta: dict[tuple[str, int], dict[str, str]]) -> list[Collective]:
    """Records of one collective instruction (several for a tuple all-reduce)."""
    nparts = mod.num_partitions or mesh.size
    pairs: tuple[tuple[int, int], ...] = ()
    if op == "collective-permute":
        if "source_target_pairs" not in instr.attrs:
            raise ValueError("collective-permute without source_target_pairs")
        pairs = tuple((a, b) for a, b in
                      (tuple(g) for g in _explicit_groups(instr.attrs["source_target_pairs"])))
        if any(len(p) != 2 for p in pairs):
            raise ValueError("bad source_target_pairs")
        id_groups, pos_groups = [], _components(pairs)
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
    parts = _flat(shapes)
    if not parts:
        raise ValueError("collective with no array result")
    op_name, source = _metadata(instr.attrs, mod.frames)
    common: dict[str, Any] = {
        "op": op, "replica_groups": tuple(tuple(g) for g in id_groups),
        "source_target_pairs": pairs, "axes": axes, "partial_axes": partial, "group_size": n,
        "multiplicity": mult[0], "name": instr.name, "computation": instr.computation,
        "is_async": instr.opcode.endswith("-start") or mult[2], "multiplicity_exact": mult[1],
        **permute,
    }
    if op in ("all-to-all", "ragged-all-to-all") or len(parts) == 1:
        total = sum(p.bytes for p in parts)
        return [Collective(dtype=parts[0].dtype, shape=parts[0].dims, bytes=total,
                           ring_bytes=ring_bytes(op, total, n), source=source, op_name=op_name,
                           parts=len(parts), **common)]
    out = []
    for k, p in enumerate(parts):
        meta = gte_meta.get((done.name if done is not None else instr.name, k))
        k_op, k_src = _metadata(meta, mod.frames) if meta else ("", "")
        out.append(Collective(dtype=p.dtype, shape=p.dims, bytes=p.bytes,
                              ring_bytes=ring_bytes(op, p.bytes, n), source=k_src or source,
                              op_name=k_op or op_name, tuple_index=k, **common))
    return out


class NotCompiledHLO(ValueError, TypeError):
    """`ledger` was given something that is not the optimized HLO of a compiled program.

    A ValueError; also a TypeError, which is what a `Lowered` used to raise."""


_PASS_COMPILED = "pass `jax.jit(f).lower(*args).compile()` (a jax.stages.Compiled) or its `.as_text()`"
# StableHLO / MLIR text, what `lowered.as_text()` prints (measured, JAX 0.12):
#   module @jit_f attributes {mhlo.num_partitions = 8 : i32, ...} {
#     func.func public @main(%arg0: tensor<8x4xf32> {...}) -> (tensor<f32> ...) {
#       %0 = stablehlo.sine %arg0 : tensor<8x4xf32>
# No line of HLO text starts like these (HLO instructions are `name = shape opcode(...)`).
_MLIR = re.compile(r'^\s*(?:module\s+(?:@|attributes\b)|func\.func\b'
                   r'|%[\w#:]+\s*=\s*"?(?:stablehlo|mhlo|sdy|func)\.)', re.M)
# HLO of a `Lowered` before compilation (`lowered.as_text(dialect="hlo")`): not
# partitioned yet, so GSPMD's collectives do not exist. Measured, JAX 0.12: its
# header holds `frontend_attributes={xla.sdy.meshes=...}` and shard_map bodies sit
# between `custom_call_target="xla.sdy.GlobalToLocalShape"` / `"...LocalToGlobalShape"`;
# no compiled module prints `xla.sdy.` (measured: CPU GSPMD and shard_map programs,
# every train step in tests/, the v5e:4x4 AOT compiles of tests/test_tpu_topology.py).
# The other three are GSPMD's markers when Shardy is off (inferred, not seen here).
_UNCOMPILED = re.compile(r'xla\.sdy\.|custom_call_target="(?:Sharding|SPMDFullToShardShape|SPMDShardToFullShape)"')


def _hlo_text(compiled_or_text: Any) -> str:
    """The HLO module text of a `Compiled` (or the text itself); anything else is refused."""
    obj, kind = compiled_or_text, type(compiled_or_text).__name__
    if isinstance(obj, str):
        return obj
    if hasattr(obj, "compile"):  # jax.stages.Lowered (a Compiled has no .compile)
        raise NotCompiledHLO(f"ledger got a {kind}, which is not compiled yet (XLA inserts the "
                             f"collectives when it compiles): call its `.compile()`; {_PASS_COMPILED}.")
    if hasattr(obj, "lower"):  # a jitted function or jax.stages.Traced
        raise NotCompiledHLO(f"ledger got a {kind} (a function, not a compiled program); {_PASS_COMPILED}.")
    text = obj.as_text() if hasattr(obj, "as_text") else None
    if not isinstance(text, str):
        raise NotCompiledHLO(f"ledger got a {kind}; {_PASS_COMPILED}.")
    return text


def _parsed_module(text: str) -> _Module:
    """Parse HLO module text, refusing text that is not a compiled program's HLO."""
    if _MLIR.search(text):
        raise NotCompiledHLO(
            "ledger got StableHLO/MLIR text (what `jax.jit(f).lower(x).as_text()` returns, before XLA "
            f"compiles and partitions the program, so before its collectives exist); {_PASS_COMPILED}.")
    if not text.strip():
        raise NotCompiledHLO(f"ledger got empty text; {_PASS_COMPILED}.")
    if _UNCOMPILED.search(text):
        raise NotCompiledHLO(
            "ledger got HLO that XLA has not compiled yet (it still carries xla.sdy / sharding "
            "custom-calls, as `lowered.as_text(dialect='hlo')` prints); the collectives of a "
            f"GSPMD program exist only after compilation: {_PASS_COMPILED}.")
    mod = _parse_module(text)
    if not any(mod.computations.values()):
        raise NotCompiledHLO(f"ledger read no HLO instruction in this text (it starts "
                             f"{text.strip()[:60]!r}): it is not an HLO module; {_PASS_COMPILED}.")
    return mod


def ledger(compiled_or_hlo_text: Any, mesh: Any) -> Ledger:
    """Every collective of a compiled program (or HLO module text) on `mesh`.

    Group ids are read as partition ids = row-major positions in `mesh`
    (`jax.sharding.Mesh`, `AbstractMesh`, or `{'data': 2, 'tensor': 4}`).
    Raises `NotCompiledHLO` for anything but a compiled program's HLO; a module
    with no collectives (a single-device step) gives an empty Ledger whose
    `instructions` is > 0.
    """
    spec = mesh_spec(mesh)
    mod = _parsed_module(_hlo_text(compiled_or_hlo_text))
    instructions = sum(len(instrs) for instrs in mod.computations.values())
    if mod.num_partitions not in (None, 1) and mod.num_partitions != spec.size:
        raise ValueError(
            f"the program has num_partitions={mod.num_partitions} but the mesh "
            f"{dict(zip(spec.names, spec.shape))} has {spec.size} devices: pass the mesh it was compiled for"
        )
    warnings: list[str] = []
    mults = _multiplicities(mod, warnings)
    async_starts, async_copies = _async_fusion_copies(mod, warnings)
    done_of: dict[tuple[str, str], _Instr] = {}
    gte_meta: dict[tuple[str, int], dict[str, str]] = {}
    for instrs in mod.computations.values():
        for i in instrs:
            if i.operands and (_base_op(i.opcode)[1] == "done" or i.opcode == "async-done"):
                done_of[(i.computation, i.operands[0])] = i
            if i.opcode == "get-tuple-element" and "metadata=" in i.attr_text and "metadata" in i.attrs:
                idx = re.match(r"\d+", i.attrs.get("index", ""))
                if idx:
                    gte_meta[(i.operands[0], int(idx.group()))] = i.attrs
    records: list[Collective] = []
    unparsed = list(mod.bad_lines)
    for comp, instrs in mod.computations.items():
        for i in instrs:
            op, form = _base_op(i.opcode)
            if op is None:
                if any(name in i.opcode for name in OPS):
                    unparsed.append(i.line)
                elif i.opcode == "async-start" and not any(
                        c in mod.computations for _, c in _call_edges(i)) and any(
                        name in i.line for name in OPS):
                    unparsed.append(i.line)  # wrapped computation not printed
                continue
            if form in ("done", "update") or (comp, i.name) in async_copies:
                continue
            if form == "start" and any(c in mod.computations and _has_collective(mod.computations[c])
                                       for k, c in _call_edges(i) if k == "calls"):
                continue  # sugared async wrapper whose computation is printed: counted inside
            try:
                mult = mults[comp]
                if comp in async_starts:
                    mult = (mult[0], mult[1], True)
                records += _records(i, op, mod, spec, mult, done_of.get((comp, i.name)), gte_meta)
            except (ValueError, KeyError, IndexError) as e:
                unparsed.append(f"{i.line}  [{e}]")
    return Ledger(records, spec, unparsed, warnings, instructions)


def _has_collective(instrs: list[_Instr]) -> bool:
    return any(_base_op(i.opcode)[0] is not None for i in instrs)
