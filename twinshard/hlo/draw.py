"""One step of a compiled program drawn as an SVG timeline: what runs when, and which communication is exposed.

`timeline_svg([("manual", pred), ("auto", pred2)])` draws each `Prediction` (twinshard/hlo/timing.py) as
a band of lanes on one shared time axis: a lane for the compute stream (ops merged into runs of one kind
and phase), one per mesh axis (each collective a box from its issue to its completion, the part the
compute stream waited for in red, labelled with its tensor, bytes and source line), and a strip
marking each loop body, drawn once with its trip count. Forward boxes are blue, backward orange, the
rest (optimizer, loss) grey. The file is self-contained (no script, no external reference): every
box carries its numbers as `data-*` attributes and a `<title>` shown on hover.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from twinshard.hlo.schedule import Sequence
from twinshard.hlo.timing import CollectiveTime, OpTime, Prediction, seconds

PHASE_COLOURS = {"forward": "#4a7fc1", "backward": "#e08a2c", "other": "#9a9a9a"}
KIND_COLOURS = {"matmul": "#3b8f5a", "attention": "#7b4fb0", "memory": "#b7c9b9"}
EXPOSED = "#d62728"
WIDTH, LEFT, LANE, GAP = 1400, 150, 34, 14


@dataclass(frozen=True)
class Box:
    """Something drawn at [start_s, end_s] of the drawing's time axis (loops collapsed to one iteration)."""

    lane: str  # 'compute', 'loops' or a mesh axis
    start_s: float
    end_s: float
    kind: str  # an op kind, 'collective' or 'loop'
    phase: str
    label: str
    data: tuple[tuple[str, str], ...] = ()


def boxes(pred: Prediction) -> tuple[list[Box], float]:
    """The boxes of one prediction on its drawing time axis, and that axis's length (seconds)."""
    out: list[Box] = []
    length = _place(pred, pred.schedule.entry, 0.0, 1, out)
    return out, length


def _place(pred: Prediction, seq: Sequence, offset: float, trips_outside: int, out: list[Box]) -> float:
    """Draw one run of `seq` from `offset`, each loop in it as one iteration of its body; its drawn length."""
    ops = [o for o in pred.ops if o.computation == seq.name]
    shrink: list[tuple[float, float]] = []  # (end of a loop in seq's own time, seconds it was collapsed by)
    run: list[OpTime] = []

    def at(t: float) -> float:  # seq's own time -> drawing time
        return offset + t - sum(cut for end, cut in shrink if end <= t)

    def flush() -> None:
        if run:
            first, last = run[0], run[-1]
            flops, moved = sum(o.flops for o in run), sum(o.bytes for o in run)
            out.append(Box("compute", at(first.start_s), at(first.start_s) + sum(o.seconds for o in run),
                           first.kind, first.phase, f"{len(run)} {first.kind} op{'s' * (len(run) > 1)}",
                           (("ops", str(len(run))), ("flops", f"{flops:g}"), ("bytes", f"{moved:g}"),
                            ("first", first.name), ("last", last.name))))
            run.clear()

    for op in ops:
        if op.kind == "collective":  # a run of ops ends where a collective is issued or completed
            flush()
            continue
        if op.kind == "loop":
            flush()
            instr = next(i for i in seq.order if i.name == op.name)
            inner = pred.schedule.branches(instr)
            if not inner:
                continue
            body, start = inner[0], at(op.start_s)
            trips = body.trips if instr.opcode == "while" and body.trips is not None else 1
            drawn = _place(pred, body, start, trips_outside * trips, out)
            phases = [o.phase for o in pred.ops if o.computation == body.name and o.kind not in ("loop", "collective")]
            major = max(set(phases), key=phases.count) if phases else "other"
            out.append(Box("loops", start, start + drawn, "loop", major,
                           f"x{trips} {body.kind} %{body.name} (one iteration drawn, {major})",
                           (("trips", str(trips)), ("body", body.name), ("iteration_s", f"{drawn:g}"))))
            shrink.append((op.start_s + op.seconds, op.seconds - drawn))
            continue
        if run and (run[-1].kind, run[-1].phase) != (op.kind, op.phase):
            flush()
        run.append(op)
    flush()
    for c in (c for c in pred.collectives if c.window.computation == seq.name):
        out.append(_collective_box(c, at))
    return at(pred.sequence_s[seq.name]) - offset


def _collective_box(c: CollectiveTime, at) -> Box:
    w = c.window
    source = os.path.basename(w.source.split(" ")[0]) if w.source else "-"
    path = w.source
    if path.startswith(os.getcwd() + os.sep):  # the file names no machine's directories: from where it was drawn
        path = os.path.relpath(path)
    label = f"{w.op} {w.tensor} {_human(w.bytes)} {source}"
    return Box(c.axis or "-", at(c.issue_s), at(c.done_s), "collective", w.phase, label, (
        ("op", w.op), ("tensor", w.tensor), ("bytes", str(w.bytes)), ("source", path), ("start", w.start),
        ("synchronous", str(w.synchronous).lower()), ("comm-us", f"{c.comm_s * 1e6:.4g}"),
        ("exposed-us", f"{c.exposed_s * 1e6:.4g}"), ("hidden-us", f"{c.hidden_s * 1e6:.4g}"),
        ("exposed-from", f"{at(c.done_s) - c.exposed_s:.9g}"), ("runs", str(c.runs)),
        ("inside", str(len(w.inside)))))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def timeline_svg(twins: list[tuple[str, Prediction]], title: str = "") -> str:
    """An SVG of each (name, prediction), one band per twin, on one time axis (module docstring)."""
    placed = [(name, pred, *boxes(pred)) for name, pred in twins]
    span = max((length for *_, length in placed), default=0.0) or 1e-9
    scale = (WIDTH - LEFT - 20) / span
    rows: list[str] = []
    y = 40
    for name, pred, items, length in placed:
        lanes = ["loops", "compute"] + sorted({b.lane for b in items if b.kind == "collective"})
        head = (f"{name}: predicted step {seconds(pred.step_s)} (compute and memory {seconds(pred.compute_s)}, "
                f"exposed communication {seconds(pred.exposed_s)}) on one {pred.chip}")
        rows.append(f'<g class="twin" data-twin={quoteattr(name)} data-step-s="{pred.step_s:.9g}" '
                    f'data-exposed-s="{pred.exposed_s:.9g}">')
        rows.append(f'<text x="8" y="{y}" class="head">{escape(head)}</text>')
        y += 10
        for lane in lanes:
            rows.append(f'<g class="lane" data-lane={quoteattr(lane)}>')
            rows.append(f'<text x="8" y="{y + LANE / 2 + 4}">{escape(_lane_name(lane, pred))}</text>')
            rows.append(f'<line x1="{LEFT}" x2="{WIDTH - 20}" y1="{y + LANE}" y2="{y + LANE}" class="rule"/>')
            for b in (b for b in items if b.lane == lane):
                rows.append(_rect(b, y, scale))
            rows.append("</g>")
            y += LANE
        rows.append("</g>")
        y += GAP + 16
    rows.append(_axis(y, span, scale))
    height = y + 40
    style = ("text{font:11px sans-serif}.head{font-weight:bold}.rule{stroke:#ddd}.label{font-size:9px;fill:#fff}"
             ".axis{stroke:#444}")
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">',
        f"<style>{style}</style>",
        f'<text x="8" y="20" class="head">{escape(title)}</text>' if title else "",
        *rows,
        _legend(height - 14),
        "</svg>", ""])


def _lane_name(lane: str, pred: Prediction) -> str:
    if lane in ("loops", "compute"):
        return {"loops": "loop bodies", "compute": "compute"}[lane]
    t = pred.axes.get(lane)
    return f"{pred.lane_name(lane)} ({seconds(t.exposed_s)} exposed)" if t else pred.lane_name(lane)


def _rect(b: Box, y: float, scale: float) -> str:
    x, w = LEFT + b.start_s * scale, max((b.end_s - b.start_s) * scale, 1.0)
    fill = (PHASE_COLOURS[b.phase] if b.kind in ("collective", "loop") else KIND_COLOURS.get(b.kind, "#ccc"))
    data = " ".join(f"data-{k}={quoteattr(v)}" for k, v in b.data)
    top, h = (y + 4, LANE - 8) if b.kind != "loop" else (y + 10, LANE - 20)
    parts = [f'<g class="{b.kind}" data-phase="{b.phase}" data-kind="{b.kind}" data-start-s="{b.start_s:.9g}" '
             f'data-end-s="{b.end_s:.9g}" {data}>',
             f"<title>{escape(b.label)}</title>",
             f'<rect x="{x:.2f}" y="{top}" width="{w:.2f}" height="{h}" fill="{fill}" fill-opacity="0.85"/>']
    if b.kind == "collective":
        exposed = float(dict(b.data)["exposed-us"]) * 1e-6 * scale
        if exposed >= 0.5:
            parts.append(f'<rect class="exposed" x="{x + w - exposed:.2f}" y="{top + h - 6}" width="{exposed:.2f}" '
                         f'height="6" fill="{EXPOSED}"/>')
    if w > 7 * len(b.label) * 0.6:
        parts.append(f'<text class="label" x="{x + 3:.2f}" y="{top + h / 2 + 3}">{escape(b.label)}</text>')
    parts.append("</g>")
    return "".join(parts)


def _axis(y: float, span: float, scale: float) -> str:
    unit, div = (("ms", 1e-3) if span >= 1e-3 else ("us", 1e-6))
    step = _nice(span / div / 10) * div
    ticks = [f'<line class="axis" x1="{LEFT}" x2="{WIDTH - 20}" y1="{y}" y2="{y}"/>']
    t = 0.0
    while t <= span * 1.0001:
        x = LEFT + t * scale
        ticks.append(f'<line class="axis" x1="{x:.2f}" x2="{x:.2f}" y1="{y}" y2="{y + 5}"/>'
                     f'<text x="{x - 8:.2f}" y="{y + 17}">{t / div:g} {unit}</text>')
        t += step
    return f'<g class="time-axis">{"".join(ticks)}</g>'


def _nice(x: float) -> float:
    import math

    e = 10 ** math.floor(math.log10(x)) if x > 0 else 1
    return next(m * e for m in (1, 2, 5, 10) if m * e >= x)


def _legend(y: float) -> str:
    items = [("forward", PHASE_COLOURS["forward"]), ("backward", PHASE_COLOURS["backward"]),
             ("other", PHASE_COLOURS["other"]), ("exposed (compute waits)", EXPOSED),
             ("matmul", KIND_COLOURS["matmul"]), ("attention", KIND_COLOURS["attention"]),
             ("memory-bound", KIND_COLOURS["memory"])]
    out, x = ['<g class="legend">'], LEFT
    for name, colour in items:
        out.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{x + 14}" y="{y}">{escape(name)}</text>')
        x += 24 + 7 * len(name)
    out.append("</g>")
    return "".join(out)
