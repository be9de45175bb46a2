"""A compiled program's step time on a chip, from its schedule: each op's cost, each collective hidden or exposed.

    pred = predict(compiled, rates, mesh, link_seconds)   # or, from a chip's name and topology:
    pred = twinshard.hardware.step_time.predict_step(compiled, "v5e", mesh, axis_links(topo, mesh))
    pred.step_s, pred.axes["data"].exposed_s, print(pred.table())

Each op of the schedule (twinshard/hlo/schedule.py) costs, from its shapes (one chip):
- matmuls and convolutions, also inside fusions: their FLOPs at the chip's matmul peak x `matmul_efficiency`;
- the splash attention kernel: 2 B H T^2 dh per matmul (2 forward; 5 in the fused backward, 4 and 3 in the
  split one), causal counting half, at the peak x its efficiency at that head_dim (`Rates.splash_share`);
  other custom calls by their bytes;
- every op also moves its operands and result through HBM at `hbm_bytes_per_s` x `hbm_efficiency`
  (a slice reads only the slice, an in-place update writes only the update, and an array whose layout
  puts it in on-chip memory moves nothing), and takes the longer of its compute and its memory time
  (a roofline);
- a collective sends its ring bytes (the ledger's) over the link of its mesh axis (`link_seconds`:
  twinshard.hardware.links.collective_seconds, what the planner uses): one link per axis, collectives
  on it one after another.
Nothing here knows a chip: `Rates` carries the peaks and efficiencies (twinshard.hardware.step_time
fills one from the chip tables), so the reader installs alone with the ledger.
The compute stream runs the ops in schedule order; a collective's transfer starts when it is issued
(and its axis's link is free) and the op that completes it waits for it: that wait is its exposed
time, the rest of its transfer is hidden. A while loop takes trips x its body, a conditional its
longest branch; but a pipeline's tick loop (a switch over idle / F / B / W read from tables) takes
the sum of its trips, each with the branch of its slowest stage (twinshard/hlo/tick_timing.py). So
the predicted step is the compute and memory time of the schedule plus the exposed communication;
`compute_s + exposed_s == step_s` (conditionals aside: the totals count every branch once a run; a
tick loop's branches count the trips in which they set the tick's time, so there it holds).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from twinshard.hlo.evaluate import full_text
from twinshard.hlo.loops import call_edges_of
from twinshard.hlo.matmul_flops import conv_flops, dot_flops
from twinshard.hlo.parse import Instr, Module, Shape, base_opcode, hbm_bytes as _bytes, parse_shape, split_top
from twinshard.hlo.records import flat_shapes, source_metadata
from twinshard.hlo.schedule import Schedule, Sequence, Window, is_free, phase, schedule
from twinshard.hlo.tick_timing import TickPrices, on_the_critical_path, price, tick_loop


@dataclass(frozen=True)
class Rates:
    """A chip as `predict` prices it: its datasheet peaks and the fraction of each its kernels reach,
    measured apart from any step (twinshard.hardware.step_time.rates fills one from the chip tables)."""

    chip: str
    matmul_flops_per_s: Mapping[str, float]  # matmul operand dtype ('bfloat16', 'float32') -> peak FLOP/s
    hbm_bytes_per_s: float
    matmul_efficiency: float = 1.0
    hbm_efficiency: float = 1.0
    splash_efficiency: float = 1.0  # at a head_dim splash_by_head_dim does not list
    splash_by_head_dim: tuple[tuple[int, float], ...] = ()  # (head_dim, efficiency): the kernel is softmax-bound
    source: str = "the datasheet peaks"

    def peak(self, dtype: str) -> float:
        """FLOP/s of `dtype` matmuls: its own peak, else the bfloat16 one (a dtype the table lists no peak for)."""
        if dtype in self.matmul_flops_per_s:
            return self.matmul_flops_per_s[dtype]
        if "bfloat16" in self.matmul_flops_per_s:
            return self.matmul_flops_per_s["bfloat16"]
        raise ValueError(f"Rates({self.chip!r}).matmul_flops_per_s={dict(self.matmul_flops_per_s)} has no peak for "
                         f"{dtype} matmuls and no bfloat16 one to price them at: add a {dtype!r} or 'bfloat16' entry")

    def splash_share(self, head_dim: int) -> float:
        """The splash kernel's fraction of the peak at `head_dim`: the listed head_dim nearest below it
        (the smallest listed above it when none is below), else splash_efficiency."""
        below = [e for d, e in sorted(self.splash_by_head_dim) if d <= head_dim]
        above = [e for d, e in sorted(self.splash_by_head_dim) if d > head_dim]
        return below[-1] if below else above[0] if above else self.splash_efficiency


LinkSeconds = Callable[[str, tuple[str, ...], float], tuple[str, float]]  # (op, axes, ring bytes) -> (axis, s)


@dataclass(frozen=True)
class OpTime:
    """One scheduled instruction: what it costs once, and when it runs in one run of its sequence."""

    computation: str
    name: str
    opcode: str
    kind: str  # 'matmul', 'attention', 'memory', 'collective' (its transfer is timed in its window), 'loop'
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    seconds: float  # on the compute stream, once (a loop: trips x its body, waits included)
    start_s: float
    runs: int  # per step
    phase: str
    source: str


@dataclass(frozen=True)
class CollectiveTime:
    """One collective's transfer in one run of its sequence: issued at `issue_s`, on the link from
    `begin_s` to `end_s`, completed (its done op passed) at `done_s`; `exposed_s` the compute stream's
    wait at the done; `hidden_s` the part of its transfer during which the compute stream was not
    waiting for its link (a transfer that runs while a later collective's done waits behind it hides
    nothing, and that done's wait is longer than its own transfer)."""

    window: Window
    axis: str  # the link it is charged to (the slowest of its axes); '' for a group of one
    comm_s: float
    issue_s: float
    begin_s: float
    end_s: float
    done_s: float
    exposed_s: float
    runs: int
    hidden_s: float


@dataclass(frozen=True)
class AxisTime:
    """Per step, over one mesh axis's link: transfer time, the part exposed (the compute stream waited for the
    link) and the rest, hidden (it computed, or waited for another link): comm_s == hidden_s + exposed_s."""

    comm_s: float
    hidden_s: float
    exposed_s: float


@dataclass
class Prediction:
    """The predicted step of one compiled program on one chip (module docstring)."""

    rates: Rates
    ops: list[OpTime]
    collectives: list[CollectiveTime]
    sequence_s: dict[str, float]  # one run of each sequence (a tick loop's body: its mean trip)
    schedule: Schedule = field(repr=False)
    ticks: TickPrices | None = None  # a pipeline's tick loop priced trip by trip

    @property
    def step_s(self) -> float:
        return self.sequence_s[self.schedule.module.entry]

    @property
    def compute_s(self) -> float:
        """Compute and memory time of the ops on the compute stream, per step."""
        return sum(o.seconds * o.runs for o in self.ops if o.kind != "loop")

    @property
    def exposed_s(self) -> float:
        return sum(c.exposed_s * c.runs for c in self.collectives)

    @property
    def axes(self) -> dict[str, AxisTime]:
        """Each axis's collectives summed. A wait for a transfer is time its link is busy (from the issue
        on, one transfer after another), so each wait lies in the transfers on that link and is hidden by
        none of them: hidden + exposed == comm."""
        out: dict[str, list[float]] = {}
        for c in self.collectives:
            t = out.setdefault(c.axis or "-", [0.0, 0.0, 0.0])
            t[0] += c.comm_s * c.runs
            t[1] += c.hidden_s * c.runs
            t[2] += c.exposed_s * c.runs
        return {a: AxisTime(*v) for a, v in out.items()}

    def lane_name(self, axis: str) -> str:
        """'data (DCN)' for an axis across TPU slices (the ledger's `dcn`), else the axis."""
        return f"{axis} (DCN)" if axis in self.schedule.ledger.dcn else axis

    def by_kind(self) -> dict[str, float]:
        """Seconds per step of each op kind on the compute stream."""
        out: dict[str, float] = {}
        for o in self.ops:
            if o.kind not in ("loop", "collective"):
                out[o.kind] = out.get(o.kind, 0.0) + o.seconds * o.runs
        return out

    @property
    def chip(self) -> str:
        return self.rates.chip

    def table(self) -> str:
        r = self.rates
        splash = ", ".join(f"{e:g} at head_dim {d}" for d, e in r.splash_by_head_dim) or f"{r.splash_efficiency:g}"
        lines = [f"predicted step on one {self.chip}: {seconds(self.step_s)} = compute and memory "
                 f"{seconds(self.compute_s)} + exposed communication {seconds(self.exposed_s)}",
                 f"  efficiencies: matmul {r.matmul_efficiency:g}, hbm {r.hbm_efficiency:g}, splash "
                 f"{splash} ({r.source})",
                 "  by kind: " + ", ".join(f"{k} {seconds(v)}" for k, v in sorted(self.by_kind().items()))]
        for axis, t in self.axes.items():
            lines.append(f"  axis {self.lane_name(axis)}: communication {seconds(t.comm_s)}, hidden {seconds(t.hidden_s)}, "
                         f"exposed {seconds(t.exposed_s)}")
        for seq in self.schedule.loops:
            lines.append(f"  loop %{seq.name}: {seconds(self.sequence_s[seq.name])} per iteration, "
                         f"{seq.runs} runs per step")
        if self.ticks is not None:
            slow = [self.ticks.slowest(t) for t in range(len(self.ticks.tick_s))]
            lines.append(f"  tick loop %{self.ticks.loop.body}: each trip its slowest stage's branch, "
                         f"{min(self.ticks.tick_s) * 1e3:.3f}-{max(self.ticks.tick_s) * 1e3:.3f} ms; slowest stage "
                         "by trip " + "".join(map(str, slow)))
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "chip": self.chip, "rates": dataclasses.asdict(self.rates),
            "step_s": self.step_s, "compute_s": self.compute_s, "exposed_s": self.exposed_s,
            "by_kind": self.by_kind(),
            "axes": {a: dataclasses.asdict(t) for a, t in self.axes.items()},
            "sequences": [{"name": s.name, "kind": s.kind, "runs": s.runs, "trips": s.trips,
                           "seconds": self.sequence_s[s.name]} for s in self.schedule.sequences.values()],
            "ticks": None if self.ticks is None else {"tick_s": self.ticks.tick_s, "trip_s": self.ticks.trip_s,
                                                       "cell_s": self.ticks.cell_s},
            "collectives": [collective_row(c) for c in self.collectives],
            "ops": [dataclasses.asdict(o) for o in self.ops],
        }


def seconds(s: float) -> str:
    """'12.3 ms', '4.56 us'."""
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def collective_row(c: CollectiveTime) -> dict[str, Any]:
    w = c.window
    return {"computation": w.computation, "start": w.start, "finish": w.finish, "op": w.op, "axes": list(w.axes),
            "axis": c.axis, "tensor": w.tensor, "bytes": w.bytes, "ring_bytes": w.ring_bytes, "source": w.source,
            "phase": w.phase, "synchronous": w.synchronous, "inside": list(w.inside), "runs": c.runs,
            "records": len(w.records),
            "comm_s": c.comm_s, "issue_s": c.issue_s, "begin_s": c.begin_s, "end_s": c.end_s, "done_s": c.done_s,
            "hidden_s": c.hidden_s, "exposed_s": c.exposed_s}


def predict(compiled_or_hlo_text: Any, rates: Rates, mesh: Any = None, link_seconds: LinkSeconds | None = None,
            causal_attention: bool = True) -> Prediction:
    """The predicted step of a compiled program (or its HLO text) at `rates` (module docstring).

    mesh: what the program was compiled for ({'data': 4} or a Mesh; default one device); link_seconds:
    (op, mesh axes, ring bytes) -> (the axis charged, seconds), needed once a collective crosses an axis;
    causal_attention: the splash kernels' mask is causal (counted half)."""
    mesh = {"data": 1} if mesh is None else mesh
    if hasattr(compiled_or_hlo_text, "runtime_executable"):  # a Compiled: its tick tables' constants printed whole
        compiled_or_hlo_text = full_text(compiled_or_hlo_text)
    sched = schedule(compiled_or_hlo_text, mesh)
    pricer = _Pricer(sched.module, rates, link_seconds, causal_attention)
    ops: list[OpTime] = []
    colls: list[CollectiveTime] = []
    seconds: dict[str, float] = {}
    loop, ticks = tick_loop(sched.module, mesh), None
    for seq in _innermost_first(sched):
        seconds[seq.name] = _simulate(seq, sched, pricer, seconds, ops, colls)
        if loop is not None and seq.name == loop.body:  # its branches are priced: price it trip by trip
            ticks = price(loop, lambda name, took: _simulate(sched.sequences[name], sched, pricer, seconds, took=took))
            seconds[seq.name] = ticks.loop_s / len(ticks.trip_s)
    if ticks is not None:  # a branch's rows count the trips in which it sets the tick's time
        ops, colls = on_the_critical_path(ticks, sched, ops, colls)
    return Prediction(rates, ops, colls, seconds, sched, ticks)


def _innermost_first(sched: Schedule) -> list[Sequence]:
    """Sequences ordered so that each comes after every sequence it runs."""
    done: dict[str, Sequence] = {}

    def visit(seq: Sequence) -> None:
        if seq.name in done:
            return
        for instr in seq.order:
            for inner in sched.branches(instr):
                visit(inner)
        done[seq.name] = seq

    visit(sched.entry)
    return list(done.values())


def _simulate(seq: Sequence, sched: Schedule, pricer: _Pricer, seconds: dict[str, float],
              ops: list[OpTime] | None = None, colls: list[CollectiveTime] | None = None,
              took: Callable[[Instr], float | None] = lambda instr: None) -> float:
    """One run of `seq`: its ops on the compute stream, its collectives on their links; its duration.
    Rows are appended to `ops` and `colls` where given; `took(instr)`, where not None, is the seconds
    of a loop, call or conditional instead of its priced ones (a tick's branch)."""
    issued = {w.issue: w for w in seq.windows}
    completing: dict[int, list[Window]] = {}
    for w in seq.windows:
        completing.setdefault(w.done, []).append(w)
    t, link_free, open_ = 0.0, {}, {}
    waits: dict[str, list[tuple[float, float]]] = {}  # per link: when the compute stream waited for it
    for k, instr in enumerate(seq.order):
        w = issued.get(k)
        if w is not None:
            axis, comm = pricer.transfer(w)
            begin = max(t, link_free.get(axis, 0.0))
            link_free[axis] = begin + comm
            open_[w.start] = (axis, comm, t, begin)
        inner = sched.branches(instr)
        if inner:
            trips = inner[0].trips if instr.opcode == "while" and inner[0].trips is not None else 1
            fixed = took(instr)
            spent = trips * max(seconds[s.name] for s in inner) if fixed is None else fixed
            row = OpTime(seq.name, instr.name, instr.opcode, "loop", 0.0, 0.0, 0.0, 0.0, spent, t, seq.runs,
                         _phase(instr, sched.module), _source(instr, sched.module))
        elif not is_free(instr):
            row = pricer.op(instr, seq, t)
        else:
            row = None
        if row is not None:
            t += row.seconds
            if ops is not None:
                ops.append(row)
        for w in completing.get(k, []):
            axis, comm, issue_s, begin = open_.pop(w.start)
            wait = max(begin + comm - t, 0.0)
            waits.setdefault(axis, []).append((t, t + wait))
            end = begin + comm  # the waits after this done begin after its transfer ends
            waited = sum(max(min(b, end) - max(a, begin), 0.0) for a, b in waits[axis])
            if colls is not None:
                colls.append(CollectiveTime(w, axis, comm, issue_s, begin, end, t + wait, wait, seq.runs,
                                            max(comm - waited, 0.0)))
            t += wait
    return t


def _phase(instr: Instr, mod: Module) -> str:
    return phase(source_metadata(instr.attrs, mod.frames)[0]) if "metadata=" in instr.attr_text else "other"


def _source(instr: Instr, mod: Module) -> str:
    return source_metadata(instr.attrs, mod.frames)[1] if "metadata=" in instr.attr_text else ""


# ----------------------------------------------------------------------------- op costs


_SLICES = ("dynamic-slice", "slice", "gather")  # read only what they return
_HLO_TO_JNP = {"bf16": "bfloat16", "f16": "bfloat16", "f32": "float32", "f64": "float32", "s8": "int8"}


class _Pricer:
    """Costs of one module's ops on one chip (module docstring)."""

    def __init__(self, mod: Module, rates: Rates, link_seconds: LinkSeconds | None, causal: bool):
        self.mod, self.rates, self.link_seconds, self.causal = mod, rates, link_seconds, causal
        self.named = {c: {i.name: i for i in instrs} for c, instrs in mod.computations.items()}
        self.async_comps = {c for c, instrs in mod.computations.items()
                            if any(base_opcode(i.opcode)[0] for i in instrs)}

    def transfer(self, w: Window) -> tuple[str, float]:
        if not w.axes or w.ring_bytes == 0:
            return "", 0.0
        if self.link_seconds is None:
            raise ValueError(f"{w.op} over mesh axes {list(w.axes)} needs a link bandwidth: pass link_seconds "
                             "(twinshard.hardware.step_time.predict_step builds it from the topology's links)")
        return self.link_seconds(w.op, w.axes, w.ring_bytes)

    def op(self, instr: Instr, seq: Sequence, t: float) -> OpTime:
        kind, flops_by_dtype, moved = self._cost(instr)
        r = self.rates
        peak_share = r.splash_share(self._splash_q(instr).dims[-1]) if kind == "attention" else r.matmul_efficiency
        compute = sum(f / (r.peak(d) * peak_share) for d, f in flops_by_dtype.items())
        memory = moved / (r.hbm_bytes_per_s * r.hbm_efficiency)
        flops = sum(flops_by_dtype.values())
        return OpTime(seq.name, instr.name, instr.opcode, kind, flops, moved, compute, memory, max(compute, memory),
                      t, seq.runs, _phase(instr, self.mod), _source(instr, self.mod))

    def _cost(self, instr: Instr) -> tuple[str, dict[str, float], float]:
        """(kind, FLOPs per matmul dtype, HBM bytes) of one top-level instruction."""
        callees = [c for key, c in call_edges_of(instr) if key == "calls"]
        if base_opcode(instr.opcode)[0] is not None or instr.opcode.startswith("async-") or (
                instr.opcode == "fusion" and callees and _is_async_end(self.mod, callees[0])):
            return "collective", {}, 0.0
        if instr.opcode == "custom-call" and "splash" in instr.name:
            return "attention", {"bfloat16": self._splash_flops(instr)}, self._plain_bytes(instr)
        flops: dict[str, float] = {}
        self._flops(instr, instr.computation, flops)
        moved = self._fusion_bytes(instr, callees[0]) if instr.opcode == "fusion" and callees else \
            self._plain_bytes(instr)
        return ("matmul" if flops else "memory"), flops, moved

    # ---- FLOPs

    def _flops(self, instr: Instr, comp: str, out: dict[str, float]) -> None:
        if instr.opcode in ("dot", "convolution"):
            lhs, rhs = (self._shape(comp, o) for o in instr.operands[:2])
            res = parse_shape(instr.shape_text)
            if isinstance(lhs, Shape) and isinstance(rhs, Shape) and isinstance(res, Shape):
                f = dot_flops(instr, lhs, res) if instr.opcode == "dot" else conv_flops(instr, lhs, rhs, res)
                dtype = _HLO_TO_JNP.get(lhs.dtype, "bfloat16")
                out[dtype] = out.get(dtype, 0.0) + f
            return
        if instr.opcode in ("fusion", "call"):
            for key, c in call_edges_of(instr):
                if key in ("calls", "to_apply"):
                    for inner in self.mod.computations.get(c, []):
                        self._flops(inner, c, out)

    def _splash_flops(self, instr: Instr) -> float:
        """2 B H T^2 dh per matmul of the kernel (module docstring), from its q operand [B, H, T, dh]."""
        q = self._splash_q(instr)
        b, h, t, dh = (1,) * (4 - len(q.dims)) + q.dims[-4:]  # a batch of one prints q as [H, T, dh] (measured)
        parts = len(flat_shapes(parse_shape(instr.shape_text)))
        matmuls = (5 if parts == 3 else 4) if "dkv" in instr.name else 3 if "dq" in instr.name else 2
        return matmuls * 2.0 * b * h * t * t * dh * (0.5 if self.causal else 1.0)

    def _splash_q(self, instr: Instr) -> Shape:
        """The splash kernel's q operand [B, H, T, dh] (or [H, T, dh])."""
        shapes = [parse_shape(s) for s in split_top(instr.attrs.get("operand_layout_constraints", "{}")[1:-1])]
        if len(shapes) != len(instr.operands):
            shapes = [self._shape(instr.computation, o) for o in instr.operands]
        named = [s for o, s in zip(instr.operands, shapes) if o.endswith("q_ref") and isinstance(s, Shape)]
        return (named or [s for s in shapes if isinstance(s, Shape) and len(s.dims) >= 3 and s.dtype[0] in "bf"])[0]

    # ---- bytes

    def _shape(self, comp: str, name: str) -> Shape | list | None:
        i = self.named.get(comp, {}).get(name)
        return parse_shape(i.shape_text) if i is not None else None

    def _operand_bytes(self, instr: Instr) -> int:
        named = self.named.get(instr.computation, {})
        return sum(_bytes(named[o].shape_text) for o in instr.operands if o in named)

    def _plain_bytes(self, instr: Instr) -> float:
        """Operands + result; a slice reads and writes its result, an in-place update its update."""
        named = self.named.get(instr.computation, {})
        if instr.opcode in _SLICES:
            return 2.0 * _bytes(instr.shape_text)
        if instr.opcode in ("dynamic-update-slice", "scatter") and len(instr.operands) > 1:
            update = instr.operands[1] if instr.opcode == "dynamic-update-slice" else instr.operands[-1]
            return 2.0 * (_bytes(named[update].shape_text) if update in named else 0)
        return float(self._operand_bytes(instr) + _bytes(instr.shape_text))

    def _fusion_bytes(self, instr: Instr, callee: str) -> float:
        """What a fusion reads and writes: each parameter whole, or only the slices read of it (also in
        nested fusions), or nothing where it is updated in place or only carries a collective's state;
        each root part whole, or the update of an in-place one, or nothing where it passes state on."""
        body = self.mod.computations.get(callee, [])
        moved = sum(self._read(callee, p) for p in body if p.opcode == "parameter")
        root = next((i for i in body if i.is_root), None)
        if root is None:
            return moved + _bytes(instr.shape_text)
        named = self.named.get(callee, {})
        parts = [named[o] for o in root.operands if o in named] if root.opcode == "tuple" else [root]
        for part in parts:
            while part.opcode == "bitcast" and part.operands and part.operands[0] in named:
                part = named[part.operands[0]]
            if part.opcode == "dynamic-update-slice":
                moved += _bytes(named[part.operands[1]].shape_text) if part.operands[1] in named else 0
            elif not (part.opcode == "parameter" or _carries_state(part)):
                moved += _bytes(part.shape_text)
        return moved

    def _read(self, comp: str, param: Instr) -> float:
        """Bytes a fused computation reads of one parameter: the slices taken of it, nothing where it is
        updated in place or passed on as a collective's state, else the whole of it."""
        whole = _bytes(param.shape_text)
        read = 0.0
        for user, pos in self._uses(comp, param.name):
            if user.opcode in _SLICES and pos == 0:
                read += _bytes(user.shape_text)
            elif (user.opcode == "dynamic-update-slice" and pos == 0) or _carries_state(user):
                continue
            elif user.opcode == "fusion" and (inner := [c for k, c in call_edges_of(user) if k == "calls"]):
                sub = next((p for p in self.mod.computations.get(inner[0], [])
                            if p.opcode == "parameter" and p.operands == [str(pos)]), None)
                read += whole if sub is None else self._read(inner[0], sub)
            else:
                return whole
        return min(read, whole)

    def _uses(self, comp: str, name: str) -> list[tuple[Instr, int]]:
        """(user, operand position) of `name` in `comp`, looking through bitcasts."""
        out = []
        for i in self.mod.computations.get(comp, []):
            for pos, o in enumerate(i.operands):
                if o == name:
                    out += self._uses(comp, i.name) if i.opcode == "bitcast" else [(i, pos)]
        return out


def _carries_state(instr: Instr) -> bool:
    """A collective, or a custom call of a TPU async collective's chain, or the root tuple passing it on."""
    if base_opcode(instr.opcode)[0] is not None or (instr.opcode == "tuple" and instr.is_root):
        return True
    return instr.opcode == "custom-call" and "AsyncCollective" in instr.attr_text


def _is_async_end(mod: Module, comp: str) -> bool:
    from twinshard.hlo.loops import root_call_target

    return root_call_target(mod.computations.get(comp, [])) in ("AsyncCollectiveStart", "AsyncCollectiveDone")
