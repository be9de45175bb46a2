"""How many times each computation runs, and which printed collectives are copies of one.

`multiplicities` walks the call graph from ENTRY and gives every computation its runs per
step; `async_fusion_copies` finds the collectives that TPU async collective fusions print
more than once, so the ledger counts each once.

A collective in a `while` body runs the product of the enclosing trip counts
(`known_trip_count`); the TPU compiler drops it (measured, libtpu 0.0.50.1), so it is inferred
from a condition `compare(..., constant(N)), direction=LT` (less the counter's first value, where the
while's initial tuple holds it as a constant) and marked `multiplicity_exact=False`.
Conditional branches count as taken; a computation called from k sites runs k times. In a generic
`async-start(...), calls=%comp` the collective is counted inside `%comp`; edges from done-side ops
are not call sites unless they are the only caller.

TPU async collective fusions (measured, libtpu 0.0.50.1, v5e:4x4) print ONE collective in every
computation of its chain: the start (ROOT custom-call "AsyncCollectiveStart"), 0 or more
continuations and the done ("AsyncCollectiveDone"). It is counted at the start; the copies are
found by data flow from the start fusion (`_chain_copies`), else by `_copy_key` with a warning.
"""

from __future__ import annotations

import re

from twinshard.hlo.parse import Instr, Module, base_opcode, parse_shape


# ----------------------------------------------------------------------------- multiplicity


_CALL_KEYS = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation"
    r"|branch_computations|called_computations)="
)


def _is_done_side(instr: Instr) -> bool:
    """`*-done`, `async-update`/`async-done`, and fusions named `*done*` (TPU)."""
    op = instr.opcode
    return (op.endswith("-done") or op in ("async-update", "async-done")
            or (op == "fusion" and "done" in instr.name))


def call_edges(instr: Instr) -> list[tuple[str, str]]:
    """(attribute, callee) edges of an instruction, minus async-done style back edges."""
    return [] if _is_done_side(instr) else call_edges_of(instr)


def _done_edges(instr: Instr) -> list[tuple[str, str]]:
    """The edges `call_edges` leaves out: those of done-side ops."""
    return call_edges_of(instr) if _is_done_side(instr) else []


def call_edges_of(instr: Instr) -> list[tuple[str, str]]:
    """Every (attribute, computation) edge of `instr`, whichever side of an async pair it is."""
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


def trip_count(w: Instr, mod: Module) -> tuple[int | None, bool]:
    """(trip count, exact) of a while: known_trip_count, else `i < constant(N)`."""
    config = w.attrs.get("backend_config", "")
    m = re.search(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)', config)
    if m:
        return int(m.group(1)), True
    cond = re.findall(r"%?([\w.\-]+)", w.attrs.get("condition", ""))
    instrs = mod.computations.get(cond[0], []) if cond else []
    named = {i.name: i for i in instrs}
    for i in instrs:
        if i.is_root and i.opcode == "compare" and i.attrs.get("direction") == "LT" and len(i.operands) == 2:
            bound = _constant(named.get(i.operands[1]))
            if bound is not None:
                return max(bound - _start(w, named.get(i.operands[0]), mod), 0), False
    return None, False


def _constant(instr: Instr | None) -> int | None:
    """An integer constant's value (None: not one)."""
    if instr is None or instr.opcode != "constant":
        return None
    n = re.match(r"\s*(-?\d+)", instr.line.split("constant(", 1)[1])
    return int(n.group(1)) if n else None


def _start(w: Instr, counter: Instr | None, mod: Module) -> int:
    """The first value of the loop counter `counter` (the condition's get-tuple-element of its parameter):
    the constant the while's initial tuple holds there, through copies; 0 where it is not one. Measured
    (libtpu 0.0.50.1): a loop whose first iteration XLA peeled off (its transfers across slices
    pipelined into the next) starts its counter at constant(1), still bounded by `i < L`."""
    if counter is None or counter.opcode != "get-tuple-element" or not w.operands:
        return 0
    index = re.match(r"\s*(\d+)", counter.attrs.get("index", ""))
    caller = {i.name: i for i in mod.computations.get(w.computation, [])}
    init = caller.get(w.operands[0])
    if index is None or init is None or init.opcode != "tuple" or int(index.group(1)) >= len(init.operands):
        return 0
    value = caller.get(init.operands[int(index.group(1))])
    while value is not None and value.opcode in ("copy", "bitcast") and value.operands:
        value = caller.get(value.operands[0])
    start = _constant(value)
    return 0 if start is None else start


def multiplicities(mod: Module, warnings: list[str]) -> dict[str, tuple[int, bool, bool]]:
    """computation -> (times run per call of ENTRY, exact?, reached through async?)."""
    callers: dict[str, list[tuple[str, Instr, str]]] = {}
    done_callers: dict[str, list[tuple[str, Instr, str]]] = {}
    for comp, instrs in mod.computations.items():
        for instr in instrs:
            for key, callee in call_edges(instr):
                callers.setdefault(callee, []).append((comp, instr, key))
            for key, callee in _done_edges(instr):
                done_callers.setdefault(callee, []).append((comp, instr, key))
    # A computation called only from the done side runs once per done; where the start also calls it, the done edge is a back edge.
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
                trips, known = trip_count(instr, mod)
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


def root_call_target(instrs: list[Instr]) -> str:
    """custom_call_target of a computation's ROOT custom-call ('' if none)."""
    root = next((i for i in instrs if i.is_root), None)
    if root is None or root.opcode != "custom-call":
        return ""
    return root.attrs.get("custom_call_target", "").strip('"')


def _copy_key(instr: Instr) -> tuple | None:
    """What every printed copy of one async collective shares (channel_id alone is not: measured,
    libtpu 0.0.50.1, three distinct all-gathers all had channel_id=1)."""
    op = base_opcode(instr.opcode)[0]
    if op is None:
        return None
    a = instr.attrs
    try:
        shape = repr(parse_shape(instr.shape_text))  # layouts differ between copies
    except ValueError:
        shape = instr.shape_text
    return (op, a.get("channel_id"), a.get("replica_groups"), a.get("source_target_pairs"),
            a.get("dimensions"), shape)


def _chain_copies(start: Instr, instrs: list[Instr], keys: set[tuple], mod: Module,
                  dones: set[str], starts: set[str]) -> set[tuple[str, str]]:
    """Copies of the start's collective along its chain, followed by data flow through the chain's fusions.
    Another start is never a copy, even when its operand comes out of this chain and its collective has
    the same key: measured, libtpu 0.0.50.1, fsdp_tp with 4 chunks of the batch, where one chunk's
    all-reduce start read what the previous chunk's chain computed, with the same shape and channel_id."""
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
            for key, c in call_edges_of(i):
                body = mod.computations.get(c, []) if key == "calls" else []
                params = {x.name: int(x.operands[0]) for x in body
                          if x.opcode == "parameter" and x.operands and x.operands[0].isdigit()}
                hits += [(c, x.name) for x in body if c not in starts and x.operands and _copy_key(x) in keys
                         and all(params.get(o) in bound for o in x.operands)]
            found.update(hits)
            if hits and not (_is_done_side(i) or any(c in dones for c, _ in hits)):
                state.add(i.name)
                changed = True
    return found


def async_fusion_copies(mod: Module, warnings: list[str]) -> tuple[set[str], set[tuple[str, str]]]:
    """(start computations, {(computation, instr)} of copies) of TPU async collective fusions (module docstring)."""
    regular, done_only, fusion_only = set(), set(), {}
    for instrs in mod.computations.values():
        for i in instrs:
            for _, callee in call_edges(i):
                regular.add(callee)
                fusion_only[callee] = fusion_only.get(callee, True) and i.opcode == "fusion"
            done_only.update(c for _, c in _done_edges(i))
    done_only -= regular
    starts, dones = set(), set()
    for comp, instrs in mod.computations.items():
        target = root_call_target(instrs)
        if target == "AsyncCollectiveStart":
            starts.add(comp)
        elif target == "AsyncCollectiveDone" or comp in done_only:
            dones.add(comp)
        for i in instrs:
            if i.opcode == "fusion" and "async" in i.name and "start" in i.name:
                starts.update(c for k, c in call_edges(i) if k == "calls")
    keys_of = {c: {k for i in mod.computations.get(c, []) if (k := _copy_key(i))} for c in starts}
    all_keys = set().union(*keys_of.values())
    copies: set[tuple[str, str]] = set()
    for instrs in mod.computations.values():
        for i in instrs:
            if i.opcode == "fusion":
                keys = set().union(*(keys_of.get(c, set()) for k, c in call_edges_of(i) if k == "calls"))
                if keys:
                    copies |= _chain_copies(i, instrs, keys, mod, dones, starts)
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
