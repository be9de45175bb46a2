"""A table-driven tick loop priced tick by tick: each trip as long as the stage whose branch is slowest.

The manual twin's 1F1B, interleaved and zb_h1 steps (manual_parallel/pp.py) run one while loop whose
body picks each stage's op with a `lax.switch` over idle / F / B / W, its index read from integer tables
[ticks, S] by the loop counter and the partition id (twinshard/hlo/pipeline_ticks.py evaluates it). Inside
a branch, `lax.cond`s pick per stage and chunk what only some stages run (the embedding on the first
stage, the lm_head and loss on the last stage's last chunk); they are evaluated the same way.

`tick_loop(module, mesh)` reads, for every tick t and stage s, the `Run` stage s takes: the switch's branch
and the branch each nested conditional in it takes. `price(loop, ...)` then prices

    trip t  =  the body's other ops  +  max over s of seconds(Run[t][s])

because the collective-permutes at each tick's end make every stage wait for the slowest (the ticks
run in lockstep), and the loop as the sum of its trips, not trips x its longest branch. A loop without
a table (GPipe, the GSPMD twin's circular loop) has no switch and is priced as any loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from twinshard.hlo.evaluate import Frame, LoopFrames, Unreadable
from twinshard.hlo.groups import mesh_spec
from twinshard.hlo.loops import call_edges_of, trip_count
from twinshard.hlo.parse import Instr, Module
from twinshard.hlo.pipeline_ticks import branches, stage_partitions, taken, tick_switch


@dataclass(frozen=True)
class Run:
    """What one stage runs in one tick: the switch's branch computation and, for each conditional inside
    it (nested ones too), the branch it takes: ((conditional, branch), ...)."""

    branch: str
    choices: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class TickLoop:
    """The tick loop of a pipeline step: `runs[t][s]` is the Run of stage s in trip t."""

    loop: str  # the while in ENTRY
    body: str
    switch: str  # the lax.switch in the body
    branches: tuple[str, ...]  # its branch computations
    runs: tuple[tuple[Run, ...], ...]


@dataclass(frozen=True)
class TickPrices:
    """The tick loop priced trip by trip: `cell_s[t][s]` stage s's Run in trip t, `tick_s[t]` the slowest
    of them (the switch's time in that trip), `trip_s[t]` the whole body's trip."""

    loop: TickLoop
    cell_s: tuple[tuple[float, ...], ...]
    tick_s: tuple[float, ...]
    trip_s: tuple[float, ...]

    @property
    def loop_s(self) -> float:
        return sum(self.trip_s)

    def slowest(self, t: int) -> int:
        """The stage that sets trip t's time (the first of equals)."""
        return max(range(len(self.cell_s[t])), key=lambda s: self.cell_s[t][s])


def tick_loop(mod: Module, mesh, axis: str = "stage") -> TickLoop | None:
    """The step's tick loop read per tick and stage, or None: no `axis` in the mesh, no switch of 3 or
    more branches in a while of ENTRY, a trip count unknown, or a switch index the evaluator cannot
    compute (the loop is then priced at its longest branch, as any loop)."""
    spec = mesh_spec(mesh)
    found = tick_switch(mod) if axis in spec.names else None
    if found is None:
        return None
    loop, switch = found
    trips, _ = trip_count(loop, mod)
    if trips is None:
        return None
    columns = []
    try:
        for p in stage_partitions(spec, axis):
            frames = LoopFrames(mod, loop, p, Frame(mod, mod.entry, _no_argument, p))
            columns.append([_run(mod, frames.at(t), switch) for t in range(trips)])
    except Unreadable:
        return None
    body = next(c for key, c in call_edges_of(loop) if key == "body")
    return TickLoop(loop.name, body, switch.name, tuple(branches(switch)), tuple(tuple(col[t] for col in columns) for t in range(trips)))


def _no_argument(k: int):
    raise Unreadable(f"the tick loop's index depends on the program's argument {k}")


def _run(mod: Module, body: Frame, switch: Instr) -> Run:
    k, frame = taken(body, switch)
    return Run(branches(switch)[k], tuple(_choices(mod, frame)))


def _choices(mod: Module, frame: Frame) -> list[tuple[str, str]]:
    """(conditional, branch taken) of each conditional in the frame's computation and, recursively, in the
    branches taken; a conditional whose index the evaluator cannot compute is left out (its longest
    branch is priced)."""
    out = []
    for cond in (i for i in mod.computations[frame.comp] if i.opcode == "conditional"):
        try:
            k, inner = taken(frame, cond)
        except Unreadable:
            continue
        out += [(cond.name, branches(cond)[k])] + _choices(mod, inner)
    return out


# simulate(sequence name, instr -> its seconds or None for the default) -> one run's seconds
Simulate = Callable[[str, Callable[[Instr], float | None]], float]


def price(loop: TickLoop, simulate: Simulate) -> TickPrices:
    """Each Run's seconds (its branch with the nested conditionals' taken branches), each trip's slowest
    stage, and the body's trip with its switch priced at that (module docstring)."""
    run_s: dict[Run, float] = {}

    def seconds_of(run: Run) -> float:
        if run not in run_s:
            chosen = dict(run.choices)

            def sequence_s(seq: str) -> float:
                return simulate(seq, lambda i: sequence_s(chosen[i.name]) if i.name in chosen else None)

            run_s[run] = sequence_s(run.branch)
        return run_s[run]

    cells = tuple(tuple(seconds_of(r) for r in row) for row in loop.runs)
    ticks = tuple(max(row) for row in cells)
    trip: dict[float, float] = {}
    for tick in set(ticks):
        trip[tick] = simulate(loop.body, lambda i, d=tick: d if i.name == loop.switch else None)
    return TickPrices(loop, cells, ticks, tuple(trip[t] for t in ticks))


def on_the_critical_path(prices: TickPrices, sched, ops: list, colls: list) -> tuple[list, list]:
    """The OpTime and CollectiveTime rows with those under the switch counting only the trips in which
    their Run sets the tick's time (critical_share), so that compute_s + exposed_s == step_s."""
    share = critical_share(prices, sched)

    def scaled(row, comp: str):
        return dataclasses.replace(row, runs=round(row.runs * share[comp])) if comp in share else row

    return [scaled(o, o.computation) for o in ops], [scaled(c, c.window.computation) for c in colls]


def critical_share(prices: TickPrices, sched) -> dict[str, float]:
    """{sequence under the switch: the share of trips in which the slowest stage's Run runs it}. The rows
    of these sequences count only those runs, so that the rows add up to the step as it is priced: a
    tick's time is its slowest stage's branch, the other stages' branches run beside it."""
    runs: dict[str, int] = {}
    for t, row in enumerate(prices.loop.runs):
        for seq in _runs_through(sched, row[prices.slowest(t)]):
            runs[seq] = runs.get(seq, 0) + 1
    under = {seq for b in prices.loop.branches for seq in _runs_through(sched, Run(b), every=True)}
    return {seq: runs.get(seq, 0) / len(prices.tick_s) for seq in under}


def _runs_through(sched, run: Run, every: bool = False) -> set[str]:
    """The sequences a Run runs: its branch, the branches its conditionals take (`every`: all of them),
    and every loop body and called computation inside (a conditional not evaluated: all its branches)."""
    chosen, out = dict(run.choices), set()

    def visit(seq) -> None:
        if seq.name in out:
            return
        out.add(seq.name)
        for instr in seq.order:
            inner = sched.branches(instr)
            if instr.name in chosen and not every:
                inner = [sched.sequences[chosen[instr.name]]]
            for s in inner:
                visit(s)

    visit(sched.sequences[run.branch])
    return out
