"""A pipeline step read from its compiled program: ticks x stages of F / B / W of which micro-batch.

`pipeline_ticks(compiled, mesh)` finds the tick loop and returns a `Ticks`: its grid (grid[t][s] a `Cell`
or None where stage s idles in tick t), how it was read, and the measured bubble share.

A schedule run from a table (the manual twin's 1F1B and zb_h1, manual_parallel/pp.py) reaches the
program as integer constants [ticks, S] that the loop body indexes by its counter and the stage's
partition id, and a `conditional` (lax.switch) that picks the tick's branch. The reader evaluates the
branch index of every (tick, partition) (twinshard/hlo/evaluate.py), and reads each branch:
- what it does, from its matmuls (dot, or convolution on TPU) by phase: none is idle; forward ones
  alone (no `jvp(` or `transpose(` in their op_name) are F; a forward re-run and its transpose is B; the
  transpose alone (the residuals kept by an earlier B) is W;
- which micro-batch: the index of its dynamic-slice of the tokens [M, B/M, T] (integers, rank 3); a W
  reads no tokens, so its micro-batch is the one whose B wrote the residual slot it reads (the body's
  dynamic-update-slice of that carried ring, evaluated tick by tick).

A loop without a table (GPipe in both twins, the GSPMD twin's circular loop) computes every stage every
tick, useful or not. Its ticks are the trip counts of the loops that shift activations over the stage
axis (the forward loop and its transpose), M the batch's rows over a hand-off's rows, V the forward
loop's ticks less S - 1 over M (its V M + S - 1 ticks; GPipe's V = 1), and the cells follow from the
structure: in tick t of the forward loop stage s runs its op t - s, micro-batch (t - s) % M on its local
chunk (t - s) // M (auto_parallel/pp.py); the transposed loop runs the ticks backwards, so the ops last
first (pipeline.circular draws the same grid from its definition). `Ticks.form` says which reading it is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from twinshard.hlo.evaluate import Frame, LoopFrames, Unreadable, full_text
from twinshard.hlo.groups import mesh_spec
from twinshard.hlo.loops import call_edges_of, trip_count
from twinshard.hlo.parse import Instr, Module, parse_shape
from twinshard.hlo.records import parsed_module

OPS = ("F", "B", "W")
_VIEWS = ("copy", "bitcast", "reshape")


@dataclass(frozen=True)
class Cell:
    """What one stage does in one tick: `op` (F, B or W) of micro-batch `microbatch` on the stage's local
    chunk `chunk` (0 ... V-1; always 0 without interleaving)."""

    op: str
    microbatch: int
    chunk: int = 0

    def label(self, chunked: bool = False) -> str:
        """F3; with `chunked` (V > 1) F3.1, micro-batch 3 on chunk 1, as pipeline.Action labels it."""
        return f"{self.op}{self.microbatch}" + (f".{self.chunk}" if chunked else "")


@dataclass(frozen=True)
class Ticks:
    """A compiled pipeline step: grid[t][s] is what stage s does in tick t (None: idle)."""

    grid: tuple[tuple[Cell | None, ...], ...]
    form: str  # 'table': read from the tick loop's branch tables; 'structure': a GPipe or circular loop's trip counts
    loops: tuple[tuple[str, int], ...]  # (while body, trip count) of the loops read

    @property
    def ticks(self) -> int:
        return len(self.grid)

    @property
    def stages(self) -> int:
        return len(self.grid[0]) if self.grid else 0

    @property
    def virtual(self) -> int:
        """V: the chunks a stage runs (1 + the highest chunk read)."""
        return 1 + max((c.chunk for row in self.grid for c in row if c is not None), default=0)

    def bubble(self) -> Fraction:
        """The share of stage-ticks that do no useful work."""
        return Fraction(sum(c is None for row in self.grid for c in row), self.ticks * self.stages)

    def text(self) -> str:
        """A row per stage, a column per tick, as pipeline.Schedule.text() draws the table."""
        cells = [[c.label(self.virtual > 1) if c else "." for c in row] for row in self.grid]
        width = max(len(c) for row in cells for c in row)
        loops = ", ".join(f"%{body} x{n}" for body, n in self.loops)
        head = f"read from the compiled program ({self.form}; {loops}): {self.ticks} ticks, bubble {float(self.bubble()):.1%}"
        return "\n".join([head] + [f"s{s} " + " ".join(row[s].ljust(width) for row in cells).rstrip()
                                   for s in range(self.stages)])


def pipeline_ticks(compiled: Any, mesh: Any, axis: str = "stage") -> Ticks:
    """The step's ticks x stages (module docstring). `compiled`: a jax.stages.Compiled, or the text of
    `evaluate.full_text(compiled)`; `mesh`: a Mesh or {'stage': 4, ...}, `axis` its pipeline axis."""
    spec = mesh_spec(mesh)
    if axis not in spec.names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {dict(zip(spec.names, spec.shape))}; "
                         "pass the pipeline's axis (stage).")
    mod = parsed_module(full_text(compiled))
    partitions = stage_partitions(spec, axis)
    switch = tick_switch(mod)
    if switch is None:
        return _circular(mod, axis, len(partitions))
    return _from_table(mod, *switch, partitions)


def stage_partitions(spec, axis: str) -> list[int]:
    """The first partition id of each stage of `axis` in a MeshSpec (row-major ids)."""
    stride = math.prod(spec.shape[spec.names.index(axis) + 1:])
    stages = spec.shape[spec.names.index(axis)]
    partitions = [s * stride for s in range(stages)]
    return partitions


def _reaches(mod: Module, comp: str, seen: set[str] | None = None) -> set[str]:
    """`comp` and every computation it calls, transitively."""
    seen = set() if seen is None else seen
    if comp in mod.computations and comp not in seen:
        seen.add(comp)
        for i in mod.computations[comp]:
            for _, c in call_edges_of(i):
                _reaches(mod, c, seen)
    return seen


def tick_switch(mod: Module) -> tuple[Instr, Instr] | None:
    """(the while in ENTRY, the conditional of 3 or more branches in its body), or None."""
    for loop in (i for i in mod.computations[mod.entry] if i.opcode == "while"):
        body = next(c for key, c in call_edges_of(loop) if key == "body")
        switches = [i for i in mod.computations[body] if i.opcode == "conditional"
                    and len(branches(i)) >= 3]
        if switches:
            return loop, max(switches, key=lambda i: len(branches(i)))
    return None


def branches(cond: Instr) -> list[str]:
    """A conditional's branch computations in index order (a pred's: true, then false)."""
    if "branch_computations" in cond.attrs:
        return re.findall(r"[\w.\-]+", cond.attrs["branch_computations"])
    return [c for key in ("true_computation", "false_computation") for c in re.findall(r"[\w.\-]+", cond.attrs.get(key, ""))]


def branch_op(mod: Module, branch: str) -> str | None:
    """F, B, W or None (idle) from the phases of the branch's matmuls (module docstring)."""
    phases, matmuls = set(), 0
    for comp in _reaches(mod, branch):
        for i in mod.computations[comp]:
            if i.opcode in ("dot", "convolution"):
                matmuls += 1
                name = i.attrs.get("metadata", "")
                if "op_name=" in name:  # (XLA:CPU prints some attention dots with a stack frame alone)
                    phases.add("backward" if "transpose(" in name else "forward")
    if not matmuls:
        return None
    if not phases:
        raise Unreadable(f"branch %{branch}: none of its {matmuls} matmuls names its op, so its phase is unknown")
    return {frozenset({"forward"}): "F", frozenset({"backward"}): "W"}.get(frozenset(phases), "B")


def _no_argument(k: int):
    raise Unreadable(f"the tick loop's index depends on the program's argument {k}")


def _from_table(mod: Module, loop: Instr, switch: Instr, partitions: list[int]) -> Ticks:
    trips, _ = trip_count(loop, mod)
    if trips is None:
        raise Unreadable(f"while %{loop.name}: its trip count is neither known nor `i < constant`")
    body = next(c for key, c in call_edges_of(loop) if key == "body")
    ops = [branch_op(mod, b) for b in branches(switch)]
    columns = []
    for p in partitions:
        frames = LoopFrames(mod, loop, p, Frame(mod, mod.entry, _no_argument, p))
        cells: list[Cell | None] = []
        for t in range(trips):
            k, inner = taken(frames.at(t), switch)
            if ops[k] is None:
                cells.append(None)
                continue
            # a W reads no fresh tokens: under the split backward its embedding gradient reads the ids its B kept
            # in a stash ring (int [slots, b, T], a token slice's shape), so its micro-batch comes from that B
            operand = switch.operands[k + 1]
            mb = _token_index(mod, inner) if ops[k] != "W" else None
            mb = mb if mb is not None else _weight_microbatch(mod, frames, t, inner, operand, cells)
            cells.append(Cell(ops[k], mb, _chunk(mod, frames, t, inner, operand)))
        columns.append(cells)
    grid = tuple(tuple(col[t] for col in columns) for t in range(trips))
    return Ticks(grid, "table", ((body, trips),))


def taken(frame: Frame, cond: Instr) -> tuple[int, Frame]:
    """(k, its frame): the branch a conditional in `frame` runs (its index evaluated; a pred's true is
    branch 0) and that branch's frame, its parameter bound to operand k + 1."""
    names = branches(cond)
    k = int(frame.value(cond.operands[0]))
    if parse_shape(frame.instrs[cond.operands[0]].shape_text).dtype == "pred":
        k = 0 if k else 1
    k = k if 0 <= k < len(names) else len(names) - 1  # XLA runs the last branch out of range
    inner = frame.inner(cond, names[k])
    inner.params = lambda _, o=cond.operands[k + 1]: frame.value(o)
    return k, inner


def _walk(mod: Module, frame: Frame, visit) -> None:
    """visit(frame, instr) for every instruction of the frame's computation and of the fusions, calls and
    conditional branches in it (not into loops: a stage's layer loop reads no tokens)."""
    for i in mod.computations[frame.comp]:
        visit(frame, i)
        for inner in _callees(frame, i):
            _walk(mod, inner, visit)


def _callees(frame: Frame, i: Instr) -> list[Frame]:
    """The frames `i` runs: a fusion's or call's computation, each branch of a conditional (branch k
    bound to operand k + 1)."""
    if i.opcode in ("fusion", "call"):
        return [frame.inner(i, next(c for key, c in call_edges_of(i) if key in ("calls", "to_apply")))]
    if i.opcode != "conditional":
        return []
    out = []
    for k, branch in enumerate(branches(i)):
        inner = frame.inner(i, branch)
        inner.params = lambda _, o=i.operands[k + 1]: frame.value(o)
        out.append(inner)
    return out


def _operand_shape(frame: Frame, i: Instr, k: int):
    return parse_shape(frame.instrs[i.operands[k]].shape_text)


def _token_index(mod: Module, frame: Frame) -> int | None:
    """The micro-batch whose tokens [M, B/M, T] the branch slices (None: it reads none)."""
    found: set[int] = set()

    def visit(f: Frame, i: Instr) -> None:
        if i.opcode != "dynamic-slice":
            return
        data = _operand_shape(f, i, 0)
        if data.dtype.startswith(("s", "u")) and len(data.dims) == 3:
            m = data.dims[0]
            found.add(min(max(int(f.value(i.operands[1])), 0), m - 1))

    _walk(mod, frame, visit)
    if len(found) > 1:
        raise Unreadable(f"branch %{frame.comp} slices the tokens of micro-batches {sorted(found)} in one tick")
    return found.pop() if found else None


def _carried(frame: Frame, name: str, chain: list[tuple[Frame, list[str]]]) -> int | None:
    """The index of the loop's carried element that `name` in `frame` is, or None; `chain`: the frames
    that called this one, each with the names its callee's parameters are bound to."""
    i = frame.instrs[name]
    while i.opcode in _VIEWS:
        i = frame.instrs[i.operands[0]]
    if i.opcode == "parameter" and chain:
        outer, bound = chain[-1]
        return _carried(outer, bound[int(i.operands[0])], chain[:-1])
    if i.opcode == "get-tuple-element":
        src, k = frame.instrs[i.operands[0]], int(i.attrs["index"])
        if src.opcode == "parameter" and chain:  # a branch's operand tuple
            outer, bound = chain[-1]
            tup = outer.instrs[bound[int(src.operands[0])]]
            return _carried(outer, tup.operands[k], chain[:-1]) if tup.opcode == "tuple" else None
        if src.opcode == "parameter":  # the loop body's carried state
            return k
    return None


def _carried_slices(mod: Module, body: Frame, branch: Frame, operand: str) -> dict[int, tuple[int, int, int]]:
    """{carried element: (its dim-0 index, the slice's rows, the element's rows)} of the loop's float arrays
    that the branch (run with `operand`) takes a dynamic-slice of."""
    slices: dict[int, tuple[int, int, int]] = {}

    def walk(f: Frame, chain: list[tuple[Frame, list[str]]]) -> None:
        for i in mod.computations[f.comp]:
            if i.opcode == "dynamic-slice" and _operand_shape(f, i, 0).dtype.startswith(("f", "bf")):
                j = _carried(f, i.operands[0], chain)
                if j is not None:
                    rows = _operand_shape(f, i, 0).dims[0]
                    slices[j] = (int(f.value(i.operands[1])), parse_shape(i.shape_text).dims[0], rows)
            if i.opcode == "fusion":
                walk(f.inner(i, next(c for key, c in call_edges_of(i) if key == "calls")), chain + [(f, i.operands)])

    walk(branch, [(body, [operand])])
    return slices


def _ring_reads(mod: Module, frames: LoopFrames, t: int, branch: Frame, operand: str) -> dict[int, int]:
    """{carried element: slot} of the float rings (what the loop rewrites) the branch reads one slot of."""
    return {j: at for j, (at, _, _) in _carried_slices(mod, frames.at(t), branch, operand).items()
            if not frames.carried_unchanged(j)}


def _chunk(mod: Module, frames: LoopFrames, t: int, branch: Frame, operand: str) -> int:
    """The local chunk a branch runs: which of the stage's V equal blocks of layers it slices out of the
    stacked weights (the loop's invariant float arrays sliced on dim 0), 0 where it takes them whole."""
    chunks = {at // size for j, (at, size, rows) in _carried_slices(mod, frames.at(t), branch, operand).items()
              if frames.carried_unchanged(j) and size < rows}
    if len(chunks) > 1:
        raise Unreadable(f"tick {t}: branch %{branch.comp} slices the stage's weights at chunks {sorted(chunks)}")
    return chunks.pop() if chunks else 0


def _ring_write(mod: Module, frames: LoopFrames, t: int, j: int) -> int | None:
    """The slot of carried ring j the body writes at tick t (its dynamic-update-slice's index), or None."""
    body = frames.at(t)
    i = body.instrs[frames.root.operands[j]]
    while i.opcode in _VIEWS:
        i = body.instrs[i.operands[0]]
    if i.opcode == "dynamic-update-slice":
        return int(body.value(i.operands[2]))
    if i.opcode == "fusion":
        callee = next(c for key, c in call_edges_of(i) if key == "calls")
        inner = body.inner(i, callee)
        root = next(x for x in mod.computations[callee] if x.is_root)
        while root.opcode in _VIEWS:
            root = inner.instrs[root.operands[0]]
        if root.opcode == "dynamic-update-slice":
            return int(inner.value(root.operands[2]))
    return None


def _weight_microbatch(mod: Module, frames: LoopFrames, t: int, branch: Frame, operand: str, done: list) -> int:
    """A W's micro-batch: that of the latest earlier B on this stage that wrote a ring slot the W reads."""
    reads = _ring_reads(mod, frames, t, branch, operand)
    for j, slot in reads.items():
        for before in range(t - 1, -1, -1):
            if _ring_write(mod, frames, before, j) == slot:
                cell = done[before]
                if cell is not None and cell.op == "B":
                    return cell.microbatch
                break
    raise Unreadable(f"tick {t}: branch %{branch.comp} reads no ring slot an earlier B wrote")


def _circular(mod: Module, axis: str, stages: int) -> Ticks:
    """A loop without a table (GPipe, the GSPMD twin's circular loop): ticks from the trip counts of the
    loops that hand activations on with a collective-permute, M from the batch's tokens over a hand-off's,
    V from the forward loop's V M + S - 1 ticks (module docstring)."""
    loops, hop = [], None
    for loop in (i for i in mod.computations[mod.entry] if i.opcode == "while"):
        body = next(c for key, c in call_edges_of(loop) if key == "body")
        permutes = [i for c in _reaches(mod, body) for i in mod.computations[c] if i.opcode.startswith("collective-permute")
                    and not i.opcode.endswith("-done")]
        if permutes:
            trips, _ = trip_count(loop, mod)
            backward = all("transpose(" in i.attrs.get("metadata", "") for i in permutes)
            loops.append((body, trips, backward))
            hop = hop or parse_shape(permutes[0].shape_text if not permutes[0].shape_text.startswith("(")
                                     else permutes[0].shape_text[1:].split("]")[0] + "]")
    if not loops or hop is None:
        raise Unreadable(f"no loop of this program hands activations over {axis!r} with a collective-permute, "
                         "and none runs a schedule table: it is not a pipeline step")
    tokens = max((parse_shape(i.shape_text) for i in mod.computations[mod.entry] if i.opcode == "parameter"
                  and not i.shape_text.startswith("(") and re.match(r"[su]32\[\d+,\d+\]", i.shape_text)),
                 key=lambda s: math.prod(s.dims))
    m = math.prod(tokens.dims) // math.prod(hop.dims[:-1])  # the batch's tokens over a hand-off's [B/M, T]
    ops = loops[0][1] - (stages - 1)  # each stage's useful ticks in the forward loop: V M
    if ops <= 0 or ops % m:
        raise Unreadable(f"the forward loop's {loops[0][1]} ticks are not V M + S - 1 for M={m} micro-batches "
                         f"on S={stages} stages")
    grid: list[tuple[Cell | None, ...]] = []
    for _, trips, backward in loops:
        for t in range(trips):
            tick = trips - 1 - t if backward else t  # the transposed loop runs the ticks backwards
            grid.append(tuple(Cell("B" if backward else "F", (tick - s) % m, (tick - s) // m)
                              if 0 <= tick - s < ops else None for s in range(stages)))
    return Ticks(tuple(grid), "structure", tuple((body, trips) for body, trips, _ in loops))
