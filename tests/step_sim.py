"""Random schedules as HLO text, and a brute-force simulator of the step they take: the independent
reference tests/test_step_time_model.py holds twinshard.hlo.timing's model against.

`random_program(rng)` draws a program on a ('data'=2, 'tensor'=4) mesh: ENTRY and up to two levels of
while loops (1-4 trips each), each computation a random list of matmuls, elementwise ops and collectives
(all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute; synchronous, or async pairs
that overlap, nest, hold an async-update, or are left open to their computation's end). `hlo_text(program)`
writes it as a scheduled HLO module; `simulate(program, chip)` runs it event by event in float64:
loops unrolled trip by trip, one compute stream, one FIFO link per mesh axis.

The model's documented semantics the simulator follows (twinshard/hlo/timing.py, schedule.py): an op
takes max(FLOPs / (peak x efficiency), HBM bytes / (bandwidth x efficiency)); a collective sends its
ring bytes over the slowest link of its axes from when it is issued and that link is free (one transfer
at a time, in issue order); the op that completes it waits for it; a start whose done is not in its
computation waits at that computation's end. A loop body is timed as one run alone, so a collective
in flight over a loop never shares a link the loop's body uses (the generator keeps them apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twinshard import hlo
from twinshard.hardware.links import Link, collective_seconds

MESH = {"data": 2, "tensor": 4}
GROUPS = {  # mesh axes -> (replica groups, group size)
    ("tensor",): ("{{0,1,2,3},{4,5,6,7}}", 4),
    ("data",): ("{{0,4},{1,5},{2,6},{3,7}}", 2),
    ("data", "tensor"): ("{{0,1,2,3,4,5,6,7}}", 8),
}
RINGS = {  # a shift by one along the axis, with wraparound
    ("tensor",): "{{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}",
    ("data",): "{{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}",
}
SQUARES = (8, 16, 32, 64)  # f32[n,n] operands of the matmuls and elementwise ops
COLUMNS = (4, 8, 16, 32, 64)  # f32[r,4] operands of the collectives
PHASES = ("forward", "backward", "other")  # as JAX names them in op_name: jvp(...), transpose(jvp(...)), neither
_OP_NAMES = {"forward": "jit(step)/jvp(loss)/", "backward": "jit(step)/transpose(jvp(loss))/", "other": "jit(step)/"}
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass
class Chip:
    """What the simulator prices at: peak FLOP/s (f32 matmuls), HBM bytes/s, efficiencies, and per mesh
    axis (bytes/s, all-to-all factor, one hop's bytes/s)."""

    peak: float
    hbm: float
    matmul_eff: float
    hbm_eff: float
    links: dict[str, tuple[float, float, float]]

    def op_seconds(self, flops: float, moved: float) -> float:
        return max(flops / (self.peak * self.matmul_eff), moved / (self.hbm * self.hbm_eff))

    def transfer(self, c: Coll) -> tuple[str, float]:
        """(the link charged, seconds): ring bytes by hand, per op, over the slowest of its axes."""
        b, n = c.result_bytes, c.n
        ring = {"all-gather": (n - 1) / n * b, "all-reduce": 2 * (n - 1) / n * b, "reduce-scatter": (n - 1) * b,
                "all-to-all": (n - 1) / n * b, "collective-permute": b}[c.kind]
        axis = min(c.axes, key=lambda a: self.links[a][0])
        rate, a2a, hop = self.links[axis]
        if c.kind == "collective-permute":
            return axis, ring / hop
        return axis, ring * (a2a if c.kind == "all-to-all" else 1.0) / rate


@dataclass
class Coll:
    name: str
    kind: str
    axes: tuple[str, ...]
    rows: int  # the result is f32[rows, 4]
    form: str  # 'sync', 'async' (start ... done), 'update' (start ... update ... done), 'open' (no done)

    @property
    def n(self) -> int:
        return GROUPS[self.axes][1]

    @property
    def result_bytes(self) -> int:
        return 16 * self.rows


@dataclass
class Comp:
    """One computation: tokens in schedule order ('dot', n[, phase]) ('tanh', n[, phase]) ('count',) ('sync', c)
    ('start', c) ('update', c) ('done', c) ('loop', Comp); a loop body has `trips`."""

    name: str
    tokens: list[tuple] = field(default_factory=list)
    trips: int = 1


def _operand_rows(c: Coll) -> int:
    return {"reduce-scatter": c.rows * c.n, "all-gather": c.rows // c.n}.get(c.kind, c.rows)


def _draw_coll(rng: np.random.Generator, name: str, forbidden_links: set[str], chip: Chip) -> Coll:
    kind = KINDS[rng.integers(len(KINDS))]
    choices = [("tensor",), ("data",)] + ([] if kind == "collective-permute" else [("data", "tensor")])
    axes = choices[rng.integers(len(choices))]
    if kind == "all-gather":
        rows = int(rng.choice(COLUMNS)) * GROUPS[axes][1]
    elif kind == "reduce-scatter":
        rows = int(rng.choice([r for r in COLUMNS if r * GROUPS[axes][1] in COLUMNS]))
    else:
        rows = int(rng.choice([r for r in COLUMNS if r >= GROUPS[axes][1]]))
    form = ("sync", "async", "async", "update", "open")[rng.integers(5)]
    if form == "update" and kind != "reduce-scatter":
        form = "async"  # async-update exists for the async-start wrapper only
    c = Coll(name, kind, axes, rows, form)
    if form != "sync" and chip.transfer(c)[0] in forbidden_links:
        c.form = "sync"
    return c


def _links_used(comp: Comp, chip: Chip) -> set[str]:
    out = set()
    for t in comp.tokens:
        if t[0] in ("sync", "start"):
            out.add(chip.transfer(t[1])[0])
        elif t[0] == "loop":
            out |= _links_used(t[1], chip)
    return out


def _draw_comp(rng: np.random.Generator, name: str, depth: int, chip: Chip, counter: list[int]) -> Comp:
    comp = Comp(name, trips=int(rng.integers(1, 5)))
    tokens: list[tuple] = [(("dot", "tanh")[rng.integers(2)], int(rng.choice(SQUARES)), PHASES[rng.integers(3)])
                           for _ in range(int(rng.integers(1, 7)))]
    if depth > 0:
        tokens.append(("count",))  # the loop counter's add
    inner = None
    if depth < 2 and rng.random() < 0.5:
        inner = _draw_comp(rng, f"{name}_l", depth + 1, chip, counter)
        tokens.insert(int(rng.integers(len(tokens) + 1)), ("loop", inner))
    rng.shuffle(tokens)
    for _ in range(int(rng.integers(0, 5))):
        counter[0] += 1
        c = _draw_coll(rng, f"c{counter[0]}", set(), chip)
        if c.form == "sync":
            tokens.insert(int(rng.integers(len(tokens) + 1)), ("sync", c))
            continue
        i = int(rng.integers(len(tokens) + 1))
        tokens.insert(i, ("start", c))
        if c.form == "update":
            tokens.insert(int(rng.integers(i + 1, len(tokens) + 1)), ("update", c))
        if c.form != "open":
            after = max(k for k, t in enumerate(tokens) if t[0] in ("start", "update") and t[1] is c)
            tokens.insert(int(rng.integers(after + 1, len(tokens) + 1)), ("done", c))
    comp.tokens = tokens
    _keep_loops_off_inflight_links(comp, chip)
    return comp


def _keep_loops_off_inflight_links(comp: Comp, chip: Chip) -> None:
    """A collective in flight over a loop whose body uses its link becomes synchronous (module docstring)."""
    for k, t in enumerate(comp.tokens):
        if t[0] != "loop":
            continue
        used = _links_used(t[1], chip)
        for j, s in enumerate(comp.tokens[:k]):
            if s[0] != "start" or chip.transfer(s[1])[0] not in used:
                continue
            c = s[1]
            ends = [i for i, u in enumerate(comp.tokens) if u[0] == "done" and u[1] is c]
            if not ends or ends[0] > k:  # in flight over the loop
                c.form = "sync"
                comp.tokens[j] = ("sync", c)
                comp.tokens[:] = [u for u in comp.tokens if not (u[0] in ("update", "done") and u[1] is c)]
                return _keep_loops_off_inflight_links(comp, chip)


def predict(prog: Comp, chip: Chip) -> hlo.Prediction:
    """twinshard.hlo.predict on the program's HLO at the chip's rates and links (bf16 priced apart, so a float32
    matmul priced at the bf16 peak shows)."""
    links = {a: Link(rate, "test", a2a, hop) for a, (rate, a2a, hop) in chip.links.items()}
    r = hlo.Rates("test", {"float32": chip.peak, "bfloat16": 7 * chip.peak}, chip.hbm, chip.matmul_eff, chip.hbm_eff)
    return hlo.predict(hlo_text(prog), r, MESH, lambda op, axes, b: collective_seconds(op, axes, b, links))


def random_chip(rng: np.random.Generator) -> Chip:
    return Chip(peak=float(10 ** rng.uniform(8.5, 10)), hbm=float(10 ** rng.uniform(8, 9.5)),
                matmul_eff=float(rng.uniform(0.3, 1.0)), hbm_eff=float(rng.uniform(0.3, 1.0)),
                links={a: (float(10 ** rng.uniform(6, 8)), float(rng.uniform(1, 3)), float(10 ** rng.uniform(6, 8)))
                       for a in ("data", "tensor")})


def random_program(rng: np.random.Generator, chip: Chip) -> Comp:
    return _draw_comp(rng, "main", 0, chip, [0])


# ----------------------------------------------------------------------------- HLO text

_STATE = ", ".join(["s32[]"] + [f"f32[{n},{n}]{{1,0}}" for n in SQUARES] + [f"f32[{r},4]{{1,0}}" for r in COLUMNS])


def _palette(prefix: str) -> dict:
    return {**{("sq", n): f"%{prefix}sq{n}" for n in SQUARES}, **{("col", r): f"%{prefix}col{r}" for r in COLUMNS}}


def hlo_text(main: Comp) -> str:
    """The program as a scheduled HLO module (a computation per loop body and condition, one per
    async-start wrapper)."""
    comps: list[str] = []
    entry_lines = [f"%{main.name}sq{n} = f32[{n},{n}]{{1,0}} parameter({k})" for k, n in enumerate(SQUARES)]
    entry_lines += [f"%{main.name}col{r} = f32[{r},4]{{1,0}} parameter({len(SQUARES) + k})"
                    for k, r in enumerate(COLUMNS)]
    entry_lines += [f"%{main.name}i = s32[] constant(0)", f"%{main.name}one = s32[] constant(1)"]
    entry_lines += _lines(main, comps)
    params = ", ".join([f"p{k}: f32[{n},{n}]" for k, n in enumerate(SQUARES)]
                       + [f"q{k}: f32[{r},4]" for k, r in enumerate(COLUMNS)])
    body = "\n".join("  " + x for x in entry_lines)
    return (f"HloModule generated, is_scheduled=true, num_partitions=8\n\n"
            "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n  %y = f32[] parameter(1)\n"
            "  ROOT %sum = f32[] add(%x, %y)\n}\n\n" + "\n".join(comps) +
            f"\nENTRY %main ({params}) -> f32[] {{\n{body}\n  ROOT %main.out = f32[] constant(0)\n}}\n")


def _metadata(token: tuple) -> str:
    return f', metadata={{op_name="{_OP_NAMES[token[2]]}{token[0]}"}}' if len(token) > 2 else ""


def _lines(comp: Comp, comps: list[str]) -> list[str]:
    p, pal, out = comp.name, _palette(comp.name), []
    for k, t in enumerate(comp.tokens):
        kind = t[0]
        if kind == "dot":
            n = t[1]
            out.append(f"%{p}.{k} = f32[{n},{n}]{{1,0}} dot({pal['sq', n]}, {pal['sq', n]}), "
                       f"lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}{_metadata(t)}")
        elif kind == "tanh":
            n = t[1]
            out.append(f"%{p}.{k} = f32[{n},{n}]{{1,0}} tanh({pal['sq', n]}){_metadata(t)}")
        elif kind == "count":
            out.append(f"%{p}.{k} = s32[] add(%{p}i, %{p}one)")
        elif kind == "loop":
            out += _loop(comp, t[1], k, comps)
        else:
            out += _collective(kind, t[1], pal, comps)
    return out


def _collective(form: str, c: Coll, pal: dict, comps: list[str]) -> list[str]:
    groups, _ = GROUPS[c.axes]
    operand, rows_in = pal["col", _operand_rows(c)], _operand_rows(c)
    res, arg = f"f32[{c.rows},4]{{1,0}}", f"f32[{rows_in},4]{{1,0}}"
    where = (f"source_target_pairs={RINGS[c.axes]}" if c.kind == "collective-permute" else
             f"replica_groups={groups}, use_global_device_ids=true")
    extra = {"all-gather": ", dimensions={0}", "all-reduce": ", to_apply=%add",
             "reduce-scatter": ", dimensions={0}, to_apply=%add", "all-to-all": ", dimensions={0}",
             "collective-permute": ""}[c.kind]
    if form == "sync":
        return [f"%{c.name} = {res} {c.kind}({operand}), channel_id=1, {where}{extra}"]
    if c.kind == "reduce-scatter":  # the async-start wrapper around it
        state = f"(({arg}), {res})"
        if form == "start":
            comps.append(f"%{c.name}.rs (w0: f32[{rows_in},4]) -> f32[{c.rows},4] {{\n  %{c.name}.w0 = {arg} "
                         f"parameter(0)\n  ROOT %{c.name}.r = {res} reduce-scatter(%{c.name}.w0), channel_id=1, "
                         f"{where}{extra}\n}}\n")
            return [f"%{c.name} = {state} async-start({operand}), calls=%{c.name}.rs"]
        if form == "update":
            return [f"%{c.name}.u = {state} async-update(%{c.name})"]
        return [f"%{c.name}.d = {res} async-done(%{c.name}{'.u' if c.form == 'update' else ''})"]
    state = {"all-reduce": res, "all-to-all": f"(({arg}), {res})"}.get(c.kind, f"({arg}, {res})")
    if form == "start":
        return [f"%{c.name} = {state} {c.kind}-start({operand}), channel_id=1, {where}{extra}"]
    return [f"%{c.name}.d = {res} {c.kind}-done(%{c.name})"]


def _loop(outer: Comp, body: Comp, k: int, comps: list[str]) -> list[str]:
    """The while over `body`: its state is the loop counter and the palette, passed through."""
    b, pal = body.name, _palette(outer.name)
    gtes = [f"%{b}sq{n} = f32[{n},{n}]{{1,0}} get-tuple-element(%{b}pb), index={1 + j}" for j, n in enumerate(SQUARES)]
    gtes += [f"%{b}col{r} = f32[{r},4]{{1,0}} get-tuple-element(%{b}pb), index={1 + len(SQUARES) + j}"
             for j, r in enumerate(COLUMNS)]
    counter = next(f"%{b}.{j}" for j, t in enumerate(body.tokens) if t[0] == "count")
    names = ", ".join([counter] + [v for v in _palette(b).values()])
    lines = [f"%{b}pb = ({_STATE}) parameter(0)", f"%{b}i = s32[] get-tuple-element(%{b}pb), index=0",
             f"%{b}one = s32[] constant(1)", *gtes, *_lines(body, comps), f"ROOT %{b}.out = ({_STATE}) tuple({names})"]
    comps.append(f"%{b} (pb: ({_STATE})) -> ({_STATE}) {{\n" + "\n".join("  " + x for x in lines) + "\n}\n")
    comps.append(f"%{b}.cond (pc: ({_STATE})) -> pred[] {{\n  %{b}pc = ({_STATE}) parameter(0)\n"
                 f"  %{b}ic = s32[] get-tuple-element(%{b}pc), index=0\n  %{b}n = s32[] constant({body.trips})\n"
                 f"  ROOT %{b}lt = pred[] compare(%{b}ic, %{b}n), direction=LT\n}}\n")
    init = ", ".join([f"%{outer.name}.z{k}"] + list(pal.values()))
    return [f"%{outer.name}.z{k} = s32[] constant(0)", f"%{outer.name}.init{k} = ({_STATE}) tuple({init})",
            f"%{outer.name}.loop{k} = ({_STATE}) while(%{outer.name}.init{k}), condition=%{b}.cond, body=%{b}, "
            f'backend_config={{"known_trip_count":{{"n":"{body.trips}"}}}}']


# ----------------------------------------------------------------------------- the simulator


@dataclass
class Transfer:
    """One run of one collective, times from the start of the step."""

    name: str
    link: str
    comm: float
    run_start: float  # when this run of its computation began
    issue: float
    begin: float = float("nan")
    end: float = float("nan")
    exposed: float = 0.0
    hidden: float = 0.0  # its transfer time while the compute stream was not waiting for its link


@dataclass
class Step:
    seconds: float
    compute: float
    transfers: list[Transfer]


def _events(comp: Comp, chip: Chip):
    """The unrolled stream: ('run', comp) at each run's start, ('op', seconds), ('issue', Coll), ('wait', Coll),
    ('close', comp) at each run's end (where the starts left open wait)."""
    yield ("run", comp)
    for t in comp.tokens:
        if t[0] == "dot":
            yield ("op", chip.op_seconds(2.0 * t[1] ** 3, 3 * 4 * t[1] ** 2))  # 2 n^3 FLOPs; reads 2, writes 1
        elif t[0] == "tanh":
            yield ("op", chip.op_seconds(0.0, 2 * 4 * t[1] ** 2))
        elif t[0] == "count":
            yield ("op", chip.op_seconds(0.0, 3 * 4))  # s32 + s32 -> s32
        elif t[0] == "loop":
            for _ in range(t[1].trips):
                yield from _events(t[1], chip)
        elif t[0] in ("sync", "start"):
            yield ("issue", t[1])
            if t[0] == "sync":
                yield ("wait", t[1])
        elif t[0] == "done":
            yield ("wait", t[1])
    yield ("close", comp)


def simulate(main: Comp, chip: Chip) -> Step:
    """The step, event by event: the compute stream's clock, and on each link a FIFO queue whose head
    transfers while the clock moves."""
    queues: dict[str, list[list]] = {"data": [], "tensor": []}  # [Transfer, seconds left]
    clock, compute, runs, transfers = 0.0, 0.0, [], []
    open_now: list[dict[str, Transfer]] = []  # per computation run in progress: its transfers not waited for

    def move_to(t: float) -> None:
        nonlocal clock
        for q in queues.values():
            now = clock
            while q:
                head, left = q[0]
                if now + left <= t:
                    now += left
                    head.end = now
                    q.pop(0)
                    if q:
                        q[0][0].begin = now
                else:
                    q[0][1] = left - (t - now)
                    break
        clock = t

    waits: dict[str, list[tuple[float, float]]] = {"data": [], "tensor": []}

    def wait(x: Transfer) -> None:
        before = clock
        while np.isnan(x.end):
            move_to(clock + queues[x.link][0][1])  # to the next end of a transfer on its link
        x.exposed = clock - before
        waits[x.link].append((before, clock))

    for event in _events(main, chip):
        kind = event[0]
        if kind == "run":
            runs.append(clock)
            open_now.append({})
        elif kind == "op":
            compute += event[1]
            move_to(clock + event[1])
        elif kind == "issue":
            link, comm = chip.transfer(event[1])
            x = Transfer(event[1].name, link, comm, runs[-1], clock)
            if not queues[link]:
                x.begin = clock
            queues[link].append([x, comm])
            transfers.append(x)
            open_now[-1][x.name] = x
        elif kind == "wait":
            wait(open_now[-1].pop(event[1].name))
        elif kind == "close":
            for x in open_now.pop().values():  # issue order
                wait(x)
            runs.pop()
    for x in transfers:
        x.hidden = x.comm - sum(max(min(b, x.end) - max(a, x.begin), 0.0) for a, b in waits[x.link])
    return Step(clock, compute, transfers)
