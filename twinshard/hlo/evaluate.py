"""Integer values of a compiled program, computed from its HLO text: what index a loop body computes.

A pipeline's schedule reaches the compiled program as integer tables (constants [ticks, S]) that the
tick loop's body indexes by its counter and the stage's partition id, and a `conditional` whose
branch index is one such lookup. `Frame.value(name)` evaluates one instruction of one computation
with NumPy, following its operands through fusions, tuples and the loop's carried state, without
running anything else: a value that depends on floating point data or on the program's arguments
raises `Unreadable`. `LoopFrames(mod, while_instr, partition)` gives the body's frame at each tick:
a carried element the body passes on unchanged is the loop's initial one (evaluated in ENTRY), any
other (the counter) is the body's ROOT of the tick before.

Measured (JAX 0.12, XLA:CPU and XLA:TPU): the compiled text prints a constant of more than 10
elements as `constant({...})`; `full_text` prints the module with its constants.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from twinshard.hlo.loops import call_edges_of
from twinshard.hlo.parse import Instr, Module, match_close, parse_shape

_INTEGER = {"pred": np.bool_, "s8": np.int64, "s16": np.int64, "s32": np.int64, "s64": np.int64,
            "u8": np.int64, "u16": np.int64, "u32": np.int64, "u64": np.int64}
_BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
           "minimum": np.minimum, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
           "shift-left": np.left_shift, "shift-right-logical": np.right_shift, "shift-right-arithmetic": np.right_shift,
           "remainder": np.fmod, "divide": lambda a, b: np.trunc(a / b).astype(np.int64)}
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal, "GT": np.greater,
            "GE": np.greater_equal}
_VIEWS = ("bitcast", "reshape", "copy", "bitcast-convert")


class Unreadable(ValueError):
    """An integer the reader cannot compute from the text (it depends on data, or on an op it does not know)."""


def full_text(compiled: Any) -> str:
    """The compiled module's text with every constant printed (`as_text()` elides those of more than 10
    elements). A string is returned as it is."""
    if isinstance(compiled, str):
        return compiled
    from jaxlib import _hlo  # the printer's options; jax 0.12 has no public accessor for them

    options = _hlo.HloPrintOptions()
    options.print_large_constants = True
    return compiled.runtime_executable().hlo_modules()[0].to_string(options)


class Lazy:
    """A tuple whose elements are computed when read."""

    def __init__(self, get: Callable[[int], Any]):
        self.get = get


def _literal(instr: Instr) -> np.ndarray:
    shape = parse_shape(instr.shape_text)
    line = instr.line
    start = line.index("constant(") + len("constant")
    body = line[start + 1:match_close(line, start)]
    if "..." in body:
        raise Unreadable(f"constant %{instr.name} is printed as {{...}}: read the module with full_text(compiled)")
    words = re.findall(r"true|false|-?\d+", body)
    values = [w == "true" if w in ("true", "false") else int(w) for w in words]
    return np.array(values, dtype=_dtype(shape.dtype)).reshape(shape.dims)


def _dtype(hlo_type: str):
    if hlo_type not in _INTEGER:
        raise Unreadable(f"a {hlo_type} value: the reader computes integers only")
    return _INTEGER[hlo_type]


def by_name(mod: Module, comp: str) -> dict[str, Instr]:
    """A computation's instructions by name, indexed once per module."""
    index = mod.__dict__.setdefault("_by_name", {})
    if comp not in index:
        index[comp] = {i.name: i for i in mod.computations[comp]}
    return index[comp]


def _no_value(instr: Instr, what: str):
    raise Unreadable(f"%{instr.name} ({instr.opcode}): {what} is not an integer the reader computes")


class Frame:
    """One run of computation `comp`: `params(k)` gives its parameter k; `partition` its partition id."""

    def __init__(self, mod: Module, comp: str, params: Callable[[int], Any], partition: int):
        self.mod, self.comp, self.params, self.partition = mod, comp, params, partition
        self.instrs = by_name(mod, comp)
        self.memo: dict[str, Any] = {}

    def value(self, name: str) -> Any:
        if name not in self.memo:
            self.memo[name] = self._compute(self.instrs[name])
        return self.memo[name]

    def inner(self, instr: Instr, callee: str) -> Frame:
        """The frame of `callee` run by `instr` (a fusion or call) with this frame's operands."""
        return Frame(self.mod, callee, lambda k: self.value(instr.operands[k]), self.partition)

    def _compute(self, i: Instr) -> Any:
        op, a = i.opcode, i.attrs
        if op == "parameter":
            return self.params(int(i.operands[0]))
        if op == "get-tuple-element":
            t = self.value(i.operands[0])
            return t.get(int(a["index"])) if isinstance(t, Lazy) else t[int(a["index"])]
        if op == "tuple":
            return Lazy(lambda k: self.value(i.operands[k]))
        if op in ("fusion", "call"):
            callee = next(c for key, c in call_edges_of(i) if key in ("calls", "to_apply"))
            return self.inner(i, callee).root()
        if op == "copy-start":  # an async copy to another memory space: (destination, source, context)
            return Lazy(lambda k: self.value(i.operands[0]) if k < 2 else _no_value(i, "its context"))
        if op == "copy-done":
            return self.value(i.operands[0]).get(0)
        if op in ("partition-id", "replica-id"):
            return np.array(self.partition if op == "partition-id" else 0, np.int64)
        shape = parse_shape(i.shape_text)
        if isinstance(shape, list):
            raise Unreadable(f"%{i.name} ({op}) in %{self.comp} makes a tuple the reader cannot compute")
        dtype = _dtype(shape.dtype)
        if op == "constant":
            return _literal(i)
        if op == "iota":
            n = shape.dims[int(a["iota_dimension"])]
            ramp = np.arange(n).reshape([n if d == int(a["iota_dimension"]) else 1 for d in range(len(shape.dims))])
            return np.broadcast_to(ramp, shape.dims).astype(dtype)
        args = [self.value(o) for o in i.operands]
        return np.asarray(self._array_op(i, op, a, args, shape.dims)).astype(dtype)

    def _array_op(self, i: Instr, op: str, a: dict, args: list, dims: tuple) -> Any:
        if op in _VIEWS or op == "convert":
            return np.reshape(args[0], dims)
        if op in _BINARY:
            return _BINARY[op](*args)
        if op == "compare":
            return _COMPARE[a["direction"]](*args)
        if op == "select":
            return np.where(*args)
        if op == "clamp":
            return np.clip(args[1], args[0], args[2])
        if op == "not":
            return np.invert(args[0])  # logical on pred, bitwise on integers, as XLA's
        if op == "negate":
            return np.negative(args[0])
        if op == "broadcast":
            keep = [int(d) for d in re.findall(r"\d+", a.get("dimensions", ""))]
            shape = [dims[d] if d in keep else 1 for d in range(len(dims))]
            return np.broadcast_to(np.reshape(args[0], shape), dims)
        if op == "dynamic-slice":
            sizes = [int(s) for s in re.findall(r"\d+", a["dynamic_slice_sizes"])]
            starts = [int(np.clip(int(s), 0, n - k)) for s, n, k in zip(args[1:], np.shape(args[0]), sizes)]
            return args[0][tuple(slice(s, s + k) for s, k in zip(starts, sizes))]
        if op == "slice":
            spans = [[int(x) for x in s.split(":")] for s in re.findall(r"\[([\d:]+)\]", a["slice"])]
            return args[0][tuple(slice(s[0], s[1], s[2] if len(s) > 2 else 1) for s in spans)]
        if op == "concatenate":
            return np.concatenate(args, axis=int(re.findall(r"\d+", a["dimensions"])[0]))
        raise Unreadable(f"%{i.name} ({op}) in %{self.comp}: an op the reader does not compute")

    def root(self) -> Any:
        return self.value(next(i.name for i in self.mod.computations[self.comp] if i.is_root))


class LoopFrames:
    """The frames of a while loop's body, one per iteration, on one partition (module docstring)."""

    def __init__(self, mod: Module, loop: Instr, partition: int, outer: Frame):
        self.mod, self.loop, self.partition, self.outer = mod, loop, partition, outer
        self.body = next(c for key, c in call_edges_of(loop) if key == "body")
        instrs = mod.computations[self.body]
        self.root = next(i for i in instrs if i.is_root)
        self.param = next(i.name for i in instrs if i.opcode == "parameter")
        self.by_name = by_name(mod, self.body)
        self.frames: dict[int, Frame] = {}

    def carried_unchanged(self, k: int) -> bool:
        """Whether the body's ROOT passes element k of its parameter on as it is."""
        name = self.root.operands[k]
        while self.by_name[name].opcode in ("copy", "bitcast"):
            name = self.by_name[name].operands[0]
        i = self.by_name[name]
        return i.opcode == "get-tuple-element" and i.operands[0] == self.param and int(i.attrs["index"]) == k

    def element(self, k: int, tick: int) -> Any:
        if tick == 0 or self.carried_unchanged(k):
            return self.outer.value(self.loop.operands[0]).get(k)
        return self.at(tick - 1).value(self.root.operands[k])

    def at(self, tick: int) -> Frame:
        if tick not in self.frames:
            self.frames[tick] = Frame(self.mod, self.body, lambda _: Lazy(lambda k: self.element(k, tick)),
                                      self.partition)
        return self.frames[tick]
