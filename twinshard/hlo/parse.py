"""Reading HLO module text: computations of instructions, shapes, attributes, source tables.

`parse_module` splits the text of an HLO module (what a `jax.stages.Compiled` prints with
`.as_text()`) into computations of `Instr` in one linear scan; attributes and shapes are
parsed on demand (`Instr.attrs`, `parse_shape`). Lines that look like a collective but
cannot be read are kept in `Module.bad_lines` (the ledger's `unparsed`). `base_opcode` says
which collective an opcode is and in which form (sync, async start / done / update).

Sources (JAX 0.12.0.1). Metadata carries `stack_frame_id=N`, not `source_file`:
`metadata={op_name="jit(f)/shard_map/all_gather" stack_frame_id=4}`; the module header has
`FileNames` / `FunctionNames` / `FileLocations` / `StackFrames` tables, and the frame's own
location is our line: `_parse_frames` resolves each frame id to "path:line" (a record's
`source`). Older `source_file="..." source_line=N` metadata is read too.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field


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
DTYPES = tuple(t for t in _DTYPE_BITS if t != "token")  # HLO's names of a collective's element types


# ----------------------------------------------------------------------------- text utils

_ESCAPE = re.compile(rb"\\([0-7]{1,3}|x[0-9a-fA-F]{2}|.)", re.S)
_SIMPLE_ESCAPES = {b"n": b"\n", b"t": b"\t", b"r": b"\r"}


def unescape(text: str) -> str:
    """The value of a quoted HLO string: XLA prints C escapes (`op_name="...params[\\'lm_head\\']"`,
    `\\"`, `\\\\`, octal bytes), which a reader should not see."""
    if "\\" not in text:
        return text

    def one(m: re.Match) -> bytes:
        e = m.group(1)
        if e[:1].isdigit():
            return bytes([int(e, 8) & 0xFF])
        if e[:1] == b"x" and len(e) == 3:
            return bytes([int(e[1:], 16)])
        return _SIMPLE_ESCAPES.get(e, e)

    return _ESCAPE.sub(one, text.encode()).decode(errors="replace")


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


def match_close(s: str, i: int) -> int:
    """Index of the bracket closing s[i], skipping double-quoted strings."""
    for j, c, depth in _unquoted(s, i):
        if depth == 0 and c in ")]}":
            return j
    raise ValueError(f"unbalanced brackets in {s[i:i + 80]!r}")


def split_top(s: str, sep: str = ",") -> list[str]:
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
    for piece in split_top(tail):
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
class Shape:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        if self.dtype not in _DTYPE_BITS:
            raise ValueError(f"unknown HLO element type {self.dtype!r}")
        return math.prod(self.dims) * _DTYPE_BITS[self.dtype] // 8


_ARRAY = re.compile(r"^([a-z][a-z0-9]*)\[([^\]]*)\]")


def parse_shape(text: str) -> Shape | list:
    """`f32[16,4]{1,0}` -> Shape; `(a, (b, c))` -> nested list of Shape."""
    text = text.strip()
    if text.startswith("("):
        inner = text[1:match_close(text, 0)]
        return [parse_shape(p) for p in split_top(inner)]
    m = _ARRAY.match(text)
    if not m:
        raise ValueError(f"cannot read shape {text!r}")
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    return Shape(m.group(1), dims)


# An array and its layout; a layout naming a memory space S(n), n > 0, keeps the buffer on the chip
# (XLA:TPU: S(1) VMEM, S(2)/S(6) sync flags and scalars; a v5e llama_v5e step places 700 operands in VMEM).
_ARRAY_IN_SPACE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^{}]*)\})?")
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")


def hbm_bytes(shape_text: str) -> int:
    """HBM bytes of a shape (each element of a tuple): arrays whose layout puts them on the chip count 0."""
    total = 0
    for dtype, dims, layout in _ARRAY_IN_SPACE.findall(shape_text):
        if layout and _ON_CHIP.search(layout):
            continue
        try:
            total += parse_shape(f"{dtype}[{dims}]").bytes
        except ValueError:
            continue
    return total


# ----------------------------------------------------------------------------- module parse


@dataclass
class Instr:
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
class Module:
    computations: dict[str, list[Instr]] = field(default_factory=dict)
    entry: str | None = None
    num_partitions: int | None = None
    frames: dict[int, str] = field(default_factory=dict)  # stack_frame_id -> "file:line"
    bad_lines: list[str] = field(default_factory=list)  # collective-looking, unreadable


_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")


def _parse_instr(line: str, computation: str) -> Instr:
    m = _INSTR.match(line)
    if not m:
        raise ValueError("not an instruction")
    rest = m.group(3).strip()
    if rest.startswith("("):
        end = match_close(rest, 0)
        shape_text, rest = rest[: end + 1], rest[end + 1 :]
    else:
        shape_text, _, rest = rest.partition(" ")
    om = re.match(r"\s*([\w\-]+)\(", rest)
    if not om:
        raise ValueError("no opcode")
    open_at = om.end() - 1
    close_at = match_close(rest, open_at)
    operands = [p.split()[-1].lstrip("%") for p in split_top(rest[open_at + 1 : close_at])]
    return Instr(m.group(2), shape_text, om.group(1), operands, rest[close_at + 1 :], computation,
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

    files = {k: unescape(v.strip('"')) for k, v in table("FileNames").items()}
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


def parse_module(text: str) -> Module:
    """Split HLO module text into computations of instructions (linear scan)."""
    mod = Module()
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


def base_opcode(opcode: str) -> tuple[str | None, str]:
    """opcode -> (collective op, form) with form in sync/start/done/other."""
    if opcode in OPS:
        return opcode, "sync"
    for suffix in ("start", "done", "update"):
        if opcode.endswith("-" + suffix) and opcode[: -len(suffix) - 1] in OPS:
            return opcode[: -len(suffix) - 1], suffix
    return None, "other"
