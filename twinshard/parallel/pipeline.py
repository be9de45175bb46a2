"""Pipeline parallelism: what both twins share (the schedules, the mesh, the checks).

The L stacked blocks are split into S contiguous stages of L/S layers (`layers -> stage`), the
batch into M micro-batches of B/M. GPipe runs M + S - 1 ticks; at tick i stage s runs micro-batch
i - s (a bubble otherwise) and hands [B/M, T, D] to the next stage; autodiff hands gradients back.

    tick  0    1    2    3    4    5    6          S = 4 stages, M = 4 micro-batches
    s=0   m0   m1   m2   m3   .    .    .          '.' = bubble: (S-1)/(M+S-1) of the
    s=1   .    m0   m1   m2   m3   .    .          stage-ticks do no useful work
    s=2   .    .    m0   m1   m2   m3   .
    s=3   .    .    .    m0   m1   m2   m3   -> loss of m_j at tick j + S - 1

Every schedule is data: `build(name, S, M, V)` is a table of ticks x stages, each cell idle or
one Action (F / B / W of micro-batch i on virtual stage j); `Schedule.text()` draws it, and its
bubble and activations in flight are read from it (docs/pipelines.md has the grids side by side).
With V > 1 chunks a stage the layers are placed round-robin and stored device-major
(twinshard/parallel/round_robin.py), so the contiguous split over `stage` still hands each device what it runs.

Embedding, ln_final and lm_head are replicated over `stage` (a shard_map program is the same on
every device); the manual twin sums their gradients over `stage`. pp_fsdp adds FSDP over `data`
inside each stage. More in docs/pipelines.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from twinshard.config import PIPELINE_SCHEDULES as SCHEDULES  # noqa: F401  ("gpipe", "1f1b", "interleaved", "zb_h1")

STAGE = "stage"
# What a stage does in one tick. BACKWARD is the whole backward of a stage (input and weight
# gradients at once); zb_h1 splits it into INPUT (the gradient of the stage's input, which the
# previous stage waits for: the zero-bubble paper's B) and WEIGHT (its weights' gradient: W).
IDLE, FORWARD, BACKWARD, INPUT, WEIGHT = 0, 1, 2, 3, 4
LETTER = {FORWARD: "F", BACKWARD: "B", INPUT: "B", WEIGHT: "W"}
# The zero-bubble paper's time of each op, in forwards of one chunk (T_F = T_B = T_W): a whole
# backward costs an input and a weight gradient.
UNITS = {FORWARD: 1, BACKWARD: 2, INPUT: 1, WEIGHT: 1}
SPLIT = ("zb_h1",)  # the schedules whose backward is split into INPUT and WEIGHT
INTERLEAVED = ("interleaved",)  # the schedules that run V > 1 chunks per stage


def ticks(microbatches: int, stages: int) -> int:
    """Iterations of the GPipe loop: the last micro-batch leaves the last stage at M + S - 2."""
    return microbatches + stages - 1


def bubble_fraction(microbatches: int, stages: int) -> float:
    """(S - 1) / (M + S - 1): the share of stage-ticks that are bubbles."""
    return (stages - 1) / ticks(microbatches, stages)


@dataclass(frozen=True)
class Action:
    """One op of one stage in one tick: `kind` of micro-batch `microbatch` on virtual stage `stage`
    (0 ... S V - 1; virtual stage j runs on device j % S as its chunk j // S, round-robin)."""

    kind: int
    microbatch: int
    stage: int

    def label(self, stages: int, virtual: int) -> str:
        """F3 (V = 1); F3.1 with V > 1: micro-batch 3 on the device's chunk 1."""
        chunk = f".{self.stage // stages}" if virtual > 1 else ""
        return f"{LETTER[self.kind]}{self.microbatch}{chunk}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline step as a table: grid[t][s] is what device s does in tick t (None: idle). An op
    may run only in a tick after the op it waits for (a hand-off between devices arrives one tick
    later, by ppermute at the end of the tick)."""

    name: str
    stages: int
    microbatches: int
    virtual: int
    grid: tuple[tuple[Action | None, ...], ...]

    @property
    def ticks(self) -> int:
        return len(self.grid)

    def ops(self, stage: int) -> list[Action]:
        """Device `stage`'s ops in order."""
        return [row[stage] for row in self.grid if row[stage] is not None]

    def bubble(self) -> Fraction:
        """The share of device-ticks that are idle (every op one tick)."""
        return Fraction(sum(a is None for row in self.grid for a in row), self.ticks * self.stages)

    def timed(self) -> list[list[tuple[Fraction, Action]]]:
        """Each device's ops with their start times when each op costs UNITS (T_F = T_B = T_W, a
        whole backward 2) and starts as soon as its device is free and what it waits for has ended."""
        start: dict[Action, Fraction] = {}
        free, end = [Fraction(0)] * self.stages, {}
        for row in self.grid:  # in tick order: every op's dependency is in an earlier tick
            for s, a in enumerate(row):
                if a is not None:
                    dep = depends_on(a, self.stages * self.virtual, self.name in SPLIT)
                    start[a] = max(free[s], end[dep] if dep is not None else Fraction(0))
                    free[s] = end[a] = start[a] + UNITS[a.kind]
        return [[(start[a], a) for a in self.ops(s)] for s in range(self.stages)]

    def idle_time(self) -> Fraction:
        """Each device's idle time in the timed step (the same on every device), in chunk forwards."""
        timed = self.timed()
        span = max(t + UNITS[a.kind] for ops in timed for t, a in ops)
        return span - sum(UNITS[a.kind] for _, a in timed[0])

    def timed_bubble(self) -> Fraction:
        """The share of the timed step each device idles: the published bubble."""
        busy = sum(UNITS[a.kind] for a in self.ops(0))
        return self.idle_time() / (self.idle_time() + busy)

    def in_flight(self) -> list[int]:
        """Per device, the most micro-batch chunks whose forward ran and whose weight gradient has
        not (their activations are held): 1F1B S - s, GPipe M, zb_h1 at most S."""
        peaks = []
        for s in range(self.stages):
            held = peak = 0
            for a in self.ops(s):
                held += {FORWARD: 1, BACKWARD: -1, INPUT: 0, WEIGHT: -1}[a.kind]
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def arrays(self) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """[ticks][stages] tables of the op's kind (IDLE where none), micro-batch and chunk (j // S)."""
        def table(f):
            return [[f(a) if a is not None else 0 for a in row] for row in self.grid]
        return table(lambda a: a.kind), table(lambda a: a.microbatch), table(lambda a: a.stage // self.stages)

    def text(self) -> str:
        """The grid: a row per device, a column per tick."""
        cells = [[a.label(self.stages, self.virtual) if a else "." for a in row] for row in self.grid]
        width = max(len(c) for row in cells for c in row)
        head = f"{self.name}: S={self.stages} M={self.microbatches}" + (f" V={self.virtual}" if self.virtual > 1 else "")
        lines = [head + f", {self.ticks} ticks, bubble {float(self.bubble()):.1%}"]
        lines += [f"s{s} " + " ".join(row[s].ljust(width) for row in cells).rstrip() for s in range(self.stages)]
        return "\n".join(lines)


def depends_on(a: Action, virtual_stages: int, split: bool) -> Action | None:
    """The op `a` waits for: F on virtual stage j, F of j - 1; a backward (B or the input gradient) on
    j, that of j + 1, or on the last virtual stage its own F; W, its input gradient."""
    if a.kind == FORWARD:
        return Action(FORWARD, a.microbatch, a.stage - 1) if a.stage > 0 else None
    if a.kind == WEIGHT:
        return Action(INPUT, a.microbatch, a.stage)
    if a.stage == virtual_stages - 1:
        return Action(FORWARD, a.microbatch, a.stage)
    return Action(INPUT if split else BACKWARD, a.microbatch, a.stage + 1)


def _order_1f1b(s: int, stages: int, microbatches: int, virtual: int) -> list[Action]:
    """1F1B (V = 1) and Megatron's interleaved 1F1B (V > 1) on device s: warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards. With V chunks, forwards go through
    the chunks S micro-batches at a time (chunk c = virtual stage c S + s), backwards in reverse."""
    n = microbatches * virtual

    def nth(k: int, backward: bool) -> Action:
        chunk = (k // stages) % virtual
        mb = k // (stages * virtual) * stages + k % stages
        return Action(BACKWARD if backward else FORWARD, mb,
                      (virtual - 1 - chunk if backward else chunk) * stages + s)

    warmup = min((stages - 1 - s) * (2 if virtual > 1 else 1) + (virtual - 1) * stages, n)
    ops, f, b = [nth(k, False) for k in range(warmup)], warmup, 0
    while f < n or b < n:
        if f < n:
            ops.append(nth(f, False))
            f += 1
        if b < n:
            ops.append(nth(b, True))
            b += 1
    return ops


def _order_zb_h1(s: int, stages: int, microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2024) on device s: 1F1B's order with each backward split into its input
    gradient B, at 1F1B's place, and its weight gradient W, put off until s + 1 are pending, so the
    W's fill the ticks where 1F1B waits; at most S micro-batches held, as 1F1B's stage 0."""
    warmup = min(stages - 1 - s, microbatches)
    ops, f, b, w = [Action(FORWARD, i, s) for i in range(warmup)], warmup, 0, 0
    while f < microbatches or b < microbatches:
        if f < microbatches:
            ops.append(Action(FORWARD, f, s))
            f += 1
        if b < microbatches:
            ops.append(Action(INPUT, b, s))
            b += 1
        if b - w > s:
            ops.append(Action(WEIGHT, w, s))
            w += 1
    return ops + [Action(WEIGHT, i, s) for i in range(w, microbatches)]


def _order_gpipe(s: int, stages: int, microbatches: int) -> list[Action]:
    """GPipe on device s: every forward, then every backward."""
    return [Action(FORWARD, i, s) for i in range(microbatches)] + [Action(BACKWARD, i, s) for i in range(microbatches)]


def build(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule `name` as a table: each device's ops in its order, each at the first tick after
    what it waits for ran (check_schedule says which (name, S, M, V) exist)."""
    check_schedule(name, stages, microbatches, virtual)
    if name == "gpipe":
        orders = [_order_gpipe(s, stages, microbatches) for s in range(stages)]
    elif name == "zb_h1":
        orders = [_order_zb_h1(s, stages, microbatches) for s in range(stages)]
    else:  # 1f1b, interleaved
        orders = [_order_1f1b(s, stages, microbatches, virtual) for s in range(stages)]
    return Schedule(name, stages, microbatches, virtual, _place(orders, stages * virtual, name in SPLIT))


def circular(stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The GSPMD twin's loop (auto_parallel/pp.py, MaxText's circular pipeline; V = 1 is GPipe's) as a
    table, no --schedule of its own: device s runs its forward op k, micro-batch k % M on its local chunk
    k // M, at tick k + s (V M + S - 1 ticks), then autodiff's transposed loop runs the same ops last
    first, each a whole backward. M >= S, as the loop needs (an output waits M - S ticks for stage 0)."""
    if microbatches < stages:
        raise ValueError(f"microbatches={microbatches} < stage={stages}: the circular loop needs M >= S.")

    def order(s: int) -> list[Action]:
        forwards = [Action(FORWARD, k % microbatches, k // microbatches * stages + s)
                    for k in range(virtual * microbatches)]
        return forwards + [Action(BACKWARD, a.microbatch, a.stage) for a in reversed(forwards)]

    grid = _place([order(s) for s in range(stages)], stages * virtual, split=False)
    return Schedule("circular", stages, microbatches, virtual, grid)


def _place(orders: list[list[Action]], virtual_stages: int, split: bool) -> tuple[tuple[Action | None, ...], ...]:
    """Tick by tick, each device runs its next op if what that op waits for ran in an earlier tick."""
    done: dict[Action, int] = {}
    nxt, grid = [0] * len(orders), []

    def ready(s: int, t: int) -> Action | None:
        if nxt[s] == len(orders[s]):
            return None
        a = orders[s][nxt[s]]
        dep = depends_on(a, virtual_stages, split)
        return a if dep is None or done.get(dep, t) < t else None

    while any(n < len(o) for n, o in zip(nxt, orders)):
        t = len(grid)
        row = tuple(ready(s, t) for s in range(len(orders)))
        if not any(row):
            raise AssertionError(f"schedule deadlocks at tick {t}: {[o[n] for n, o in zip(nxt, orders) if n < len(o)]}")
        for s, a in enumerate(row):
            if a is not None:
                done[a] = t
                nxt[s] += 1
        grid.append(row)
    return tuple(grid)


def check_schedule(name: str, stages: int, microbatches: int, virtual: int) -> None:
    """The schedule's own conditions on S, M and V, or ValueError naming the fix."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a pipeline schedule; choose one of {', '.join(SCHEDULES)}.")
    if virtual < 1:
        raise ValueError(f"virtual_stages={virtual} must be >= 1.")
    if name in INTERLEAVED and virtual < 2:
        raise ValueError(f"--schedule={name} runs V >= 2 chunks per stage, got --virtual_stages={virtual}: pass "
                         "--virtual_stages=2 or more (V = 1 is --schedule=1f1b).")
    if name not in INTERLEAVED and virtual != 1:
        raise ValueError(f"--virtual_stages={virtual} interleaves chunks, which --schedule={name} does not: use "
                         "--schedule=interleaved, or --virtual_stages=1.")
    if name in INTERLEAVED and microbatches % stages:
        ok = [m for m in range(stages, 4 * stages + 1, stages)]
        raise ValueError(f"--schedule={name} sends micro-batches through the chunks S at a time: microbatches="
                         f"{microbatches} is not a multiple of stage={stages}; choose --microbatches from {ok} "
                         "(or another multiple).")


# The ModelConfig fields whose non-default values apply a weight outside the ops twinshard/model/taps.py
# taps (an int8 product, the narrow norm's custom backward, the experts, the heads-layout einsums), where
# zb_h1's split backward (manual_parallel/pp_split.py) could not defer its gradient to W (pipelines refuse
# the chunked loss already).
UNTAPPED = {"quantization": "none", "norm_dtype": "float32", "num_experts": 0, "qkv_layout": "tokens"}


def check_split(model, schedule: str) -> None:
    """A schedule with a split backward (SPLIT) on a model whose weights all go through tapped ops, or
    ValueError naming the field and the fix."""
    for name, ok in UNTAPPED.items() if schedule in SPLIT else ():
        if getattr(model, name) != ok:
            raise ValueError(f"--schedule={schedule} splits each backward at the weighted ops twinshard/model/taps.py "
                             f"taps, and --{name}={getattr(model, name)} applies a weight outside them: pass "
                             f"--{name}={ok}, or --schedule=1f1b.")


def check(num_layers: int, batch: int, stages: int, microbatches: int, grad_accum: int = 1,
          data: int = 1, schedule: str = "gpipe", virtual: int = 1) -> None:
    """L splits into S stages (of V chunks), the batch (pp_fsdp: each data shard's) into M >= S
    micro-batches, the schedule's own conditions (check_schedule), or ValueError."""
    if grad_accum != 1:
        raise ValueError(f"grad_accum={grad_accum}: a pipeline already accumulates the gradients of its "
                         "micro-batches; use --microbatches instead and leave --grad_accum at 1.")
    if stages < 2:
        raise ValueError(f"pipeline parallelism needs stage >= 2, got stage={stages}; use --mesh=stage:2 "
                         "or more (stage:1 is single-device training).")
    if num_layers % stages:
        fits = [s for s in range(2, num_layers + 1) if num_layers % s == 0]
        raise ValueError(f"num_layers={num_layers} does not split into stage={stages} equal stages; "
                         f"choose stage from {fits} (e.g. --mesh=stage:{fits[0]} --devices={fits[0]}) or change "
                         "num_layers.")
    if num_layers % (stages * virtual):
        fits = [v for v in range(2, num_layers // stages + 1) if num_layers // stages % v == 0]
        fix = (f"choose --virtual_stages from {fits}" if fits else
               "a stage of one layer cannot interleave: more layers (num_layers) or fewer stages")
        raise ValueError(f"--virtual_stages={virtual} does not divide the {num_layers // stages} layers of a stage "
                         f"(num_layers={num_layers} / stage={stages}) into equal chunks; {fix}.")
    if microbatches < stages:
        raise ValueError(f"microbatches={microbatches} < stage={stages}: a pipeline of {stages} stages needs "
                         f"at least {stages} micro-batches to fill (pass --microbatches={stages} or more).")
    check_schedule(schedule, stages, microbatches, virtual)
    if batch % (data * microbatches):  # (data = 1: pp, the whole batch into M)
        fits = [m for m in range(stages, batch // data + 1) if batch % (data * m) == 0]
        split = f"data={data} x microbatches={microbatches}" if data > 1 else f"microbatches={microbatches}"
        rows = " (each data shard's B/data rows into M)" if data > 1 else ""
        fix = (f"choose microbatches from {fits} or a --batch_size that is a multiple of {data * microbatches}" if fits
               else f"no count of at least stage={stages} splits its {batch // data} rows: a --batch_size that is a "
                    f"multiple of {data * microbatches}")
        raise ValueError(f"batch={batch} does not split into {split} equal micro-batches{rows}; {fix}.")


@dataclass(frozen=True)
class Buffers:
    """Where a device keeps what crosses ticks when it runs a schedule by hand: [ticks][stages] tables
    of the slot each op reads (its input in `act`, its output's gradient in `grad`, zb_h1's stash from
    B to W in `res`; 0 where none) and of the slot an arrival is written to at the end of the tick
    (`recv_act`: the activation the previous virtual stage sent, `recv_grad`: the gradient the next
    one sent back; -1 where none). Each slot holds one value from its write to its last read."""

    act: list[list[int]]
    grad: list[list[int]]
    res: list[list[int]]
    recv_act: list[list[int]]
    recv_grad: list[list[int]]
    sizes: dict[str, int]  # slots per ring: act, grad, res


def buffers(schedule: Schedule) -> Buffers:
    """Assign each (micro-batch, virtual stage) a slot in each ring per device, reusing a slot once
    its last reader has run (interval colouring, lowest free slot first)."""
    s_, vs, split = schedule.stages, schedule.stages * schedule.virtual, schedule.name in SPLIT
    tick = {a: t for t, row in enumerate(schedule.grid) for a in row if a is not None}
    back = INPUT if split else BACKWARD

    def at(kind, i, j):
        return tick[Action(kind, i, j)]

    live: dict[str, dict[tuple[int, int], tuple[int, int]]] = {"act": {}, "grad": {}, "res": {}}
    for i in range(schedule.microbatches):
        for j in range(vs):
            # the input: from its arrival (stage 0 chunk 0: its own forward) to the backward that re-runs it
            live["act"][i, j] = (at(FORWARD, i, j - 1) + 1 if j else at(FORWARD, i, j), at(back, i, j))
            if j < vs - 1:  # the output's gradient: from its arrival to the backward (zb_h1: B) that reads it
                live["grad"][i, j] = (at(back, i, j + 1) + 1, at(back, i, j))
            if split:  # B's stash (manual_parallel/pp_split.py): from the input gradient to the weight gradient
                live["res"][i, j] = (at(INPUT, i, j), at(WEIGHT, i, j))
    slot, sizes = {}, {}
    for ring, spans in live.items():
        sizes[ring] = 1
        for dev in range(s_):
            used: list[int] = []  # per slot, the last tick it is read
            for key, (start, end) in sorted(((k, v) for k, v in spans.items() if k[1] % s_ == dev), key=lambda kv: kv[1]):
                n = next((n for n, last in enumerate(used) if last < start), len(used))
                used[n:n + 1] = [end]
                slot[ring, key] = n
            sizes[ring] = max(sizes[ring], len(used))

    def table(f):
        return [[f(a) if a is not None else 0 for a in row] for row in schedule.grid]

    recv_act = [[-1] * s_ for _ in schedule.grid]
    recv_grad = [[-1] * s_ for _ in schedule.grid]
    for a, t in tick.items():
        if a.kind == FORWARD and a.stage < vs - 1:
            recv_act[t][(a.stage + 1) % s_] = slot["act", (a.microbatch, a.stage + 1)]
        if a.kind == back and a.stage > 0:
            recv_grad[t][(a.stage - 1) % s_] = slot["grad", (a.microbatch, a.stage - 1)]
    return Buffers(
        act=table(lambda a: slot["act", (a.microbatch, a.stage)] if a.kind != WEIGHT else 0),
        grad=table(lambda a: slot.get(("grad", (a.microbatch, a.stage)), 0) if a.kind in (BACKWARD, INPUT) else 0),
        res=table(lambda a: slot.get(("res", (a.microbatch, a.stage)), 0)),
        recv_act=recv_act, recv_grad=recv_grad, sizes=sizes)
