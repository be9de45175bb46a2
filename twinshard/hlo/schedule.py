"""The compiled schedule: the order XLA runs a program's instructions in, and when each collective is in flight.

`schedule(compiled, mesh)` reads a compiled program (`is_scheduled=true`: every computation prints its
instructions in the order they run) into one `Sequence` per computation that runs as a stream of
instructions (ENTRY, each while body with its trip count, conditional branches, called computations)
and one `Window` per collective: from the instruction that issues it to the one that waits for it,
with the instructions scheduled in between, the compute that can hide it.

Forms (measured, JAX 0.12.0.1, libtpu 0.0.50.1):
- TPU async collective fusions: a fusion whose computation's ROOT is custom-call "AsyncCollectiveStart"
  issues the collective; continuation fusions take its state (and may compute beside it); the fusion
  whose computation's ROOT is "AsyncCollectiveDone" completes it. The chain is followed by data flow.
- `all-gather-start` / `all-gather-done` (GPU), `async-start` / `async-update` / `async-done`: the
  done that takes the start's state.
- Across TPU slices (twinshard/hlo/megascale.py): the megascale send issues the collective, the
  recv-done of its result completes it.
- Synchronous collectives (all of XLA:CPU's, the TPU's it left synchronous, and those it fused with
  compute into one fusion): a zero-width window.
A start whose done is not in its own computation (its state carried into a loop) is open to the
computation's end (`Window.carried`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twinshard.hlo import megascale
from twinshard.hlo.groups import mesh_spec
from twinshard.hlo.loops import call_edges_of, multiplicities, root_call_target, trip_count
from twinshard.hlo.parse import Instr, Module, base_opcode
from twinshard.hlo.records import Collective, Ledger, hlo_text, is_scheduled, ledger_of_module, parsed_module

# Instructions that take no time of their own: names, views of buffers, and buffers the TPU allocates.
FREE_OPCODES = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                          "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
                          # TPU's async copies and slices run on its DMA engines beside the compute stream
                          "copy-start", "copy-done", "slice-start", "slice-done"})
# TPU custom calls that move no data: a buffer allocated, adjacent slices viewed as one (by name, inferred)
_FREE_CUSTOM_CALLS = ("AllocateBuffer", "ConcatBitcast")
_HOST_TRANSFERS = ("send", "recv", "send-done", "recv-done")
# Edges along which a computation runs as its own stream of instructions (not fused into one op).
_STREAM_EDGES = {"while": ("body",), "conditional": ("true_computation", "false_computation",
                                                     "branch_computations"), "call": ("to_apply", "calls")}


def is_free(instr: Instr) -> bool:
    """Takes no time of its own (FREE_OPCODES, the TPU's AllocateBuffer custom calls, the send/recv that hand a
    buffer to the megascale runtime, which carries it across slices beside the compute: its window is priced)."""
    if instr.opcode in _HOST_TRANSFERS and "is_host_transfer=true" in instr.attr_text:
        return True
    return instr.opcode in FREE_OPCODES or (
        instr.opcode == "custom-call" and any(t in instr.attr_text for t in _FREE_CUSTOM_CALLS))


def phase(op_name: str) -> str:
    """'backward' (JAX names the transposed ops `transpose(jvp(...))`), 'forward' (`jvp(...)`) or 'other'
    (the optimizer, the loss's reductions, a program that takes no gradient)."""
    return "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "other"


@dataclass(frozen=True)
class Window:
    """One collective in flight in `computation`: issued at position `issue` of its sequence's order,
    waited for at `done` (== issue when synchronous); `inside` names the instructions scheduled
    strictly between (free ones left out), `continuations` the TPU fusions that carry its state."""

    computation: str
    issue: int
    done: int
    start: str
    finish: str
    records: tuple[Collective, ...]
    inside: tuple[str, ...] = ()
    continuations: tuple[str, ...] = ()
    carried: bool = False

    @property
    def synchronous(self) -> bool:
        return self.issue == self.done

    @property
    def op(self) -> str:
        return self.records[0].op

    @property
    def axes(self) -> tuple[str, ...]:
        return self.records[0].axes

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    @property
    def ring_bytes(self) -> float:
        return sum(r.ring_bytes for r in self.records)

    @property
    def source(self) -> str:
        return next((r.source for r in self.records if r.source), "")

    @property
    def phase(self) -> str:
        return phase(self.records[0].op_name)

    @property
    def tensor(self) -> str:
        """dtype[shape] of the result, e.g. 'bf16[1,64,192]' (several for a tuple all-reduce)."""
        return " ".join(f"{r.dtype}[{','.join(map(str, r.shape))}]" for r in self.records)


@dataclass
class Sequence:
    """One computation run as a stream: `order` is its instructions in schedule order; it runs `runs`
    times per step (a while body: the product of the enclosing trip counts, `trips` its own loop's)."""

    name: str
    kind: str  # 'entry', 'while body', 'branch' or 'called'
    order: list[Instr]
    runs: int
    runs_exact: bool
    windows: list[Window] = field(default_factory=list)
    trips: int | None = None
    caller: str | None = None  # the instruction (in its parent sequence) that runs it

    def position(self, name: str) -> int:
        return next(k for k, i in enumerate(self.order) if i.name == name)


@dataclass
class Schedule:
    """The scheduled program: ENTRY and every stream it runs, each collective's window, and the ledger."""

    module: Module
    sequences: dict[str, Sequence]
    ledger: Ledger
    scheduled: bool
    warnings: list[str] = field(default_factory=list)

    @property
    def entry(self) -> Sequence:
        return self.sequences[self.module.entry]

    @property
    def loops(self) -> list[Sequence]:
        return [s for s in self.sequences.values() if s.kind == "while body"]

    def windows(self) -> list[Window]:
        return [w for s in self.sequences.values() for w in s.windows]

    def branches(self, instr: Instr) -> list[Sequence]:
        """The sequences a while (its body), conditional (its branches) or call instruction runs."""
        return [self.sequences[c] for key, c in call_edges_of(instr)
                if key in _STREAM_EDGES.get(instr.opcode, ()) and c in self.sequences]


def schedule(compiled_or_hlo_text: Any, mesh: Any) -> Schedule:
    """The schedule of a compiled program (or its HLO text) on `mesh` ({'data': 2, ...} or a Mesh)."""
    text = hlo_text(compiled_or_hlo_text)
    mod = parsed_module(text)
    led = ledger_of_module(mod, mesh_spec(mesh))
    warnings: list[str] = []
    scheduled = is_scheduled(text)
    if not scheduled:
        warnings.append("the module is not scheduled (no is_scheduled=true): the printed order is read as the order")
    runs = multiplicities(mod, [])
    sequences = _streams(mod, runs)
    by_instr: dict[tuple[str, str], list[Collective]] = {}
    by_comp: dict[str, list[Collective]] = {}
    for r in led.records:
        by_instr.setdefault((r.computation, r.name), []).append(r)
        by_comp.setdefault(r.computation, []).append(r)
    starts, dones = _async_fusion_computations(mod)
    dcn_ends = {(t.computation, t.send): t.recv_done for t in megascale.transfers(mod)} if led.dcn else {}
    for seq in sequences.values():
        seq.windows = _windows(seq, mod, by_instr, by_comp, starts, dones, dcn_ends, warnings)
    timed = {id(r) for seq in sequences.values() for w in seq.windows for r in w.records}
    for r in led.records:
        if id(r) not in timed:
            warnings.append(f"{r.op} %{r.name} in %{r.computation}: in no window of the schedule; not timed")
    return Schedule(mod, sequences, led, scheduled, warnings)


def _streams(mod: Module, runs: dict[str, tuple[int, bool, bool]]) -> dict[str, Sequence]:
    """ENTRY and every computation it runs as a stream (while bodies, branches, calls), depth first."""
    out: dict[str, Sequence] = {}

    def visit(comp: str, kind: str, trips: int | None, caller: str | None) -> None:
        if comp in out or comp not in mod.computations:
            return
        n, exact, _ = runs.get(comp, (1, False, False))
        out[comp] = Sequence(comp, kind, mod.computations[comp], n, exact, trips=trips, caller=caller)
        for instr in mod.computations[comp]:
            keys = _STREAM_EDGES.get(instr.opcode, ())
            for key, callee in call_edges_of(instr):
                if key not in keys:
                    continue
                if instr.opcode == "while":
                    visit(callee, "while body", trip_count(instr, mod)[0], instr.name)
                else:
                    visit(callee, "branch" if instr.opcode == "conditional" else "called", None, instr.name)

    visit(mod.entry, "entry", None, None)
    return out


def _async_fusion_computations(mod: Module) -> tuple[set[str], set[str]]:
    """(computations that issue a TPU async collective, those that complete one)."""
    starts, dones = set(), set()
    for comp, instrs in mod.computations.items():
        target = root_call_target(instrs)
        if target == "AsyncCollectiveStart":
            starts.add(comp)
        elif target == "AsyncCollectiveDone":
            dones.add(comp)
    return starts, dones


def _has_collective(mod: Module, comp: str) -> bool:
    return any(base_opcode(i.opcode)[0] is not None for i in mod.computations.get(comp, []))


def _follow(order: list[Instr], k: int, is_done, is_link) -> tuple[int | None, list[str]]:
    """(position of the done, continuation names) of the chain from order[k], by data flow through
    get-tuple-element, bitcast and the chain's links."""
    chain, links = {order[k].name}, []
    for j in range(k + 1, len(order)):
        instr = order[j]
        if not any(o in chain for o in instr.operands):
            continue
        if is_done(instr):
            return j, links
        if instr.opcode in ("get-tuple-element", "bitcast"):
            chain.add(instr.name)
        elif is_link(instr):
            chain.add(instr.name)
            links.append(instr.name)
    return None, links


def _windows(seq: Sequence, mod: Module, by_instr, by_comp, starts: set[str], dones: set[str],
             dcn_ends: dict[tuple[str, str], str], warnings: list[str]) -> list[Window]:
    order, out = seq.order, []
    calls = lambda i: [c for key, c in call_edges_of(i) if key == "calls"]  # noqa: E731
    for k, instr in enumerate(order):
        op, form = base_opcode(instr.opcode)
        callees = calls(instr)
        if op is not None and form == "sync":
            done, links, records = k, [], by_instr.get((seq.name, instr.name), [])
        elif op is not None and form == "start":
            done, links = _follow(order, k, lambda i: base_opcode(i.opcode)[1] == "done",
                                  lambda i: base_opcode(i.opcode)[1] == "update")
            records = by_instr.get((seq.name, instr.name)) or [r for c in callees for r in by_comp.get(c, [])]
        elif (seq.name, instr.name) in dcn_ends:  # across slices: from the send to the recv-done of its result
            done, links = seq.position(dcn_ends[(seq.name, instr.name)]), []
            records = by_instr.get((seq.name, instr.name), [])
        elif instr.opcode == "async-start" and any(_has_collective(mod, c) for c in callees):
            done, links = _follow(order, k, lambda i: i.opcode == "async-done", lambda i: i.opcode == "async-update")
            records = [r for c in callees for r in by_comp.get(c, [])]
        elif instr.opcode == "fusion" and any(c in starts for c in callees):
            done, links = _follow(order, k, lambda i: i.opcode == "fusion" and any(c in dones for c in calls(i)),
                                  lambda i: i.opcode == "fusion" and any(_has_collective(mod, c) for c in calls(i)))
            records = [r for c in callees for r in by_comp.get(c, [])]
        elif instr.opcode == "fusion" and any(c in by_comp for c in callees):
            # a collective fused with compute (TPU's all-reduce-scatter fusions, measured): synchronous
            done, links, records = k, [], [r for c in callees for r in by_comp.get(c, [])]
        else:
            continue
        if not records:
            warnings.append(f"%{instr.name} in %{seq.name}: a collective the ledger has no record of; not timed")
            continue
        carried = done is None
        end = len(order) - 1 if carried else done
        inside = tuple(i.name for i in order[k + 1:end + (1 if carried else 0)] if not is_free(i))
        out.append(Window(seq.name, k, end, instr.name, "" if carried else order[end].name,
                          tuple(records), inside, tuple(links), carried))
    return out
