"""A pipeline step drawn as the familiar picture: a lane per stage, a box per micro-batch op, F / B / W in colours.

`pipeline_svg([("manual", ticks), ...])` draws each `Ticks` (twinshard/hlo/pipeline_ticks.py: read from the
compiled program, not from the schedule's table) as a band of lanes, one per stage, a column per tick;
every op is a box labelled with its micro-batch (F0, B3, W1; interleaved, with the stage's local chunk:
F0.1) and carries `data-stage`, `data-tick`, `data-op`, `data-microbatch` and `data-chunk`; an idle tick
is left blank. The file is self-contained, as the
timeline's (twinshard/hlo/draw.py); `stack` puts several drawings in one file, one above the other.
"""

from __future__ import annotations

import re
from xml.sax.saxutils import escape, quoteattr

from twinshard.hlo.pipeline_ticks import Ticks

OP_COLOURS = {"F": "#4a7fc1", "B": "#e08a2c", "W": "#3b8f5a"}
OP_NAMES = {"F": "forward", "B": "backward (input gradient; with its weights' unless a W follows)",
            "W": "weight gradient"}
LEFT, CELL, LANE, GAP = 60, 34, 26, 18


def pipeline_svg(twins: list[tuple[str, Ticks]], title: str = "") -> str:
    """An SVG of each (name, ticks), one band per twin (module docstring)."""
    rows, y = [], 40
    for name, ticks in twins:
        band, y = _band(name, ticks, y)
        rows += band
    legend = "".join(f'<rect x="{LEFT + 150 * k}" y="{y - 9}" width="10" height="10" fill="{c}"/>'
                     f'<text x="{LEFT + 150 * k + 14}" y="{y}">{escape(op)}: {escape(OP_NAMES[op].split(" (")[0])}</text>'
                     for k, (op, c) in enumerate(OP_COLOURS.items()))
    width, height = LEFT + CELL * max(t.ticks for _, t in twins) + 20, y + 16
    style = "text{font:11px sans-serif}.head{font-weight:bold}.label{font-size:10px;fill:#fff}"
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                      f'viewBox="0 0 {width} {height}">', f"<style>{style}</style>",
                      f'<text x="8" y="20" class="head">{escape(title)}</text>' if title else "",
                      *rows, f'<g class="legend">{legend}</g>', "</svg>", ""])


def _band(name: str, ticks: Ticks, y: float) -> tuple[list[str], float]:
    """One twin's lanes from height y: its rows of SVG and the height below them."""
    loops = ", ".join(f"{n} ticks of %{body}" for body, n in ticks.loops)
    bubble = float(ticks.bubble())
    out = [f'<g class="pipeline" data-twin={quoteattr(name)} data-ticks="{ticks.ticks}" data-stages="{ticks.stages}" '
           f'data-bubble="{bubble:.6f}" data-form="{ticks.form}">',
           f'<text x="8" y="{y}" class="head">{escape(name)}: {ticks.ticks} ticks x {ticks.stages} stages, bubble '
           f'{bubble:.1%} (read from the compiled program\'s {ticks.form}: {escape(loops)})</text>']
    y += 8
    for s in range(ticks.stages):
        out.append(f'<g class="stage" data-stage="{s}"><text x="8" y="{y + LANE / 2 + 4}">stage {s}</text>')
        out += [_box(t, s, row[s], y, ticks.virtual > 1) for t, row in enumerate(ticks.grid) if row[s] is not None]
        out.append("</g>")
        y += LANE
    out += [_ticks_axis(ticks.ticks, y), "</g>"]
    return out, y + GAP + 24


def _box(t: int, s: int, cell, y: float, chunked: bool) -> str:
    x = LEFT + t * CELL
    what = f"tick {t}, stage {s}: {OP_NAMES[cell.op]} of micro-batch {cell.microbatch}" + \
        (f" on the stage's chunk {cell.chunk}" if chunked else "")
    return (f'<g class="op" data-stage="{s}" data-tick="{t}" data-op="{cell.op}" data-microbatch="{cell.microbatch}" '
            f'data-chunk="{cell.chunk}"><title>{escape(what)}</title><rect x="{x + 1}" y="{y + 2}" width="{CELL - 2}" '
            f'height="{LANE - 4}" fill="{OP_COLOURS[cell.op]}"/><text class="label" x="{x + 4}" y="{y + LANE / 2 + 4}">'
            f'{cell.label(chunked)}</text></g>')


def _ticks_axis(n: int, y: float) -> str:
    marks = "".join(f'<text x="{LEFT + t * CELL + 8}" y="{y + 12}">{t}</text>' for t in range(n))
    return f'<g class="tick-axis">{marks}</g>'


def stack(svgs: list[str]) -> str:
    """Several SVG drawings in one file, one above the other (each nested as it is)."""
    sizes = [tuple(int(v) for v in re.search(r'width="(\d+)" height="(\d+)"', s).groups()) for s in svgs]
    width, height = max(w for w, _ in sizes), sum(h for _, h in sizes)
    out, y = [], 0
    for svg, (_, h) in zip(svgs, sizes):
        out.append(svg.replace("<svg ", f'<svg y="{y}" ', 1).rstrip())
        y += h
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                      f'viewBox="0 0 {width} {height}">', *out, "</svg>", ""])
