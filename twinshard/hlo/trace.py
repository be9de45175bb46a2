"""One predicted step as a Chrome trace-event file: the prediction opened in Perfetto UI or chrome://tracing.

`trace_events([("manual", pred), ("auto", pred2)])` writes each `Prediction` (twinshard/hlo/timing.py) as
one process (pid) of the JSON object format (`{"traceEvents": [...]}`), on the time axis of one whole
step (every loop unrolled: its body's events repeated trip by trip), times in microseconds:

- track "compute": each op of the compute stream an 'X' event from its start for its predicted seconds
  (name: the HLO instruction; args: kind, phase, opcode, FLOPs, HBM bytes, compute and memory time,
  the JAX source line), and each wait for a collective (its exposed time) an event named "wait: ...";
- track "loops": each while loop (call, conditional: the longest branch, as the step's time takes it)
  an 'X' event over all its trips, and inside it one event per iteration;
- one track per mesh axis (as `Prediction.axes`: "-" for a group of one device): each collective's
  transfer an 'X' event while it holds the axis's link (from `begin_s` to `end_s`), with its bytes,
  ring bytes, tensor and source line, and the times it was issued and completed in its args.

Track names come from 'M' (metadata) events. Each time is rounded to the nanosecond from the step's
start; the compute stream's events, one after another in the prediction, are then made to touch where
rounding overlapped them by a nanosecond (the viewers nest 'X' events of a track by containment).
"""

from __future__ import annotations

from typing import Any

from twinshard.hlo.schedule import Sequence
from twinshard.hlo.timing import Prediction, seconds

COMPUTE, LOOPS = "compute", "loops"


def _ns(s: float) -> int:
    return round(s * 1e9)


def _event(name: str, pid: int, tid: int, start_s: float, end_s: float, cat: str, args: dict) -> dict:
    """An 'X' (complete) event from start_s to end_s (seconds from the step's start), in microseconds."""
    start = _ns(start_s)
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start / 1e3, "dur": (_ns(end_s) - start) / 1e3,
            "cat": cat, "args": args}


def _meta(what: str, pid: int, name: str, sort: int, tid: int | None = None) -> list[dict]:
    """A process's or a track's name and its place in the viewer's order."""
    ids = {"pid": pid} if tid is None else {"pid": pid, "tid": tid}
    return [{"ph": "M", "name": f"{what}_name", **ids, "args": {"name": name}},
            {"ph": "M", "name": f"{what}_sort_index", **ids, "args": {"sort_index": sort}}]


def tracks(pred: Prediction) -> dict[str, int]:
    """Track name -> tid: compute, loops, then each mesh axis of the prediction's collectives, by name."""
    return {name: tid for tid, name in enumerate([COMPUTE, LOOPS, *sorted(pred.axes)], start=1)}


def trace_events(twins: list[tuple[str, Prediction]], title: str = "") -> dict[str, Any]:
    """The trace of each (name, prediction), one process each, in the order given (module docstring)."""
    events: list[dict] = []
    for pid, (name, pred) in enumerate(twins, start=1):
        tids = tracks(pred)
        head = (f"predicted {name}: step {seconds(pred.step_s)} on one {pred.chip} (compute and memory "
                f"{seconds(pred.compute_s)}, exposed communication {seconds(pred.exposed_s)})")
        events += _meta("process", pid, head, pid)
        for track, tid in tids.items():
            events += _meta("thread", pid, track, tid, tid)
        placed: list[dict] = []
        _place(pred, pred.schedule.entry, 0.0, pid, tids, placed)
        _one_after_another([e for e in placed if e["tid"] == tids[COMPUTE]])
        events += placed
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"title": title, "source": "twinshard.hlo.trace: launch.collectives --trace"}}


def _one_after_another(stream: list[dict]) -> None:
    """Start each event of one stream no earlier than the previous one ends (they overlap only by rounding)."""
    end = 0.0
    for e in sorted(stream, key=lambda e: e["ts"]):
        if e["ts"] < end:
            e["dur"], e["ts"] = max(round(e["ts"] + e["dur"] - end, 3), 0.0), end
        end = e["ts"] + e["dur"]


def _place(pred: Prediction, seq: Sequence, offset: float, pid: int, tids: dict[str, int], out: list[dict]) -> None:
    """The events of one run of `seq` starting at `offset` seconds, its loops unrolled."""
    for op in (o for o in pred.ops if o.computation == seq.name):
        begin = offset + op.start_s
        if op.kind == "collective":  # its issue and done ops take no time: the transfer is on its axis's track
            continue
        if op.kind != "loop":
            end = offset + (op.start_s + op.seconds)  # the expression of the next op's begin: they touch
            out.append(_event(op.name, pid, tids[COMPUTE], begin, end, f"{op.kind},{op.phase}", {
                "kind": op.kind, "phase": op.phase, "opcode": op.opcode, "computation": op.computation,
                "flops": op.flops, "bytes": op.bytes, "compute_us": op.compute_s * 1e6,
                "memory_us": op.memory_s * 1e6, "source": op.source}))
            continue
        instr = next(i for i in seq.order if i.name == op.name)
        inner = pred.schedule.branches(instr)
        if not inner:
            continue
        body = max(inner, key=lambda s: pred.sequence_s[s.name])  # the branch the step's time takes
        trips = body.trips if instr.opcode == "while" and body.trips is not None else 1
        each = pred.sequence_s[body.name]  # op.seconds == trips * each; the end as the last iteration's
        out.append(_event(f"x{trips} %{body.name}", pid, tids[LOOPS], begin, begin + trips * each, f"loop,{op.phase}", {
            "body": body.name, "trips": trips, "iteration_us": each * 1e6, "instruction": op.name, "opcode": op.opcode,
            "computation": op.computation, "source": op.source}))
        for k in range(trips):
            start = begin + k * each
            out.append(_event(f"{body.name} iteration {k + 1}/{trips}", pid, tids[LOOPS], start,
                              begin + (k + 1) * each, "iteration", {"body": body.name, "iteration": k}))
            _place(pred, body, start, pid, tids, out)
    for c in (c for c in pred.collectives if c.window.computation == seq.name):
        w, tid = c.window, tids[c.axis or "-"]
        out.append(_event(f"{w.op} {w.tensor}", pid, tid, offset + c.begin_s, offset + c.end_s,
                          f"collective,{w.phase}", {
            "op": w.op, "axes": list(w.axes), "tensor": w.tensor, "bytes": w.bytes, "ring_bytes": w.ring_bytes,
            "source": w.source, "phase": w.phase, "computation": w.computation, "start": w.start, "finish": w.finish,
            "synchronous": w.synchronous, "issue_us": (offset + c.issue_s) * 1e6, "done_us": (offset + c.done_s) * 1e6,
            "comm_us": c.comm_s * 1e6, "exposed_us": c.exposed_s * 1e6, "hidden_us": c.hidden_s * 1e6}))
        if c.exposed_s > 0:  # the compute stream's wait at the done (its axis's link queue included)
            out.append(_event(f"wait: {w.op} {w.tensor}", pid, tids[COMPUTE], offset + (c.done_s - c.exposed_s),
                              offset + c.done_s, "exposed", {"exposed_us": c.exposed_s * 1e6, "axis": c.axis,
                                                             "computation": w.computation, "collective": w.start}))


def beside(predicted: dict[str, Any], measured: dict[str, Any], step: str = "train_step",
           at_us: float | None = None) -> tuple[dict[str, Any], float]:
    """One trace holding a measured profile (jax.profiler's perfetto_trace.json, the same trace-event
    format) and the prediction of the same program, its processes numbered after the measured ones and
    its step starting where the measured step starts: at `at_us`, or at the first complete event whose
    name contains `step` (the compiled step's module, `jit_train_step`, on a TPU's device track).
    Returns (the trace, where the prediction starts in µs)."""
    events = measured["traceEvents"]
    if at_us is None:
        first = min((e["ts"] for e in events if e.get("ph") == "X" and step in e.get("name", "")), default=None)
        if first is None:
            raise ValueError(f"no complete event of the measured trace names {step!r}: pass the step's name as it "
                             "appears there (e.g. jit_train_step), or the time to put the prediction at")
        at_us = float(first)
    after = 1 + max((int(e["pid"]) for e in events if isinstance(e.get("pid"), int)), default=0)
    moved = [{**e, "pid": e["pid"] + after, **({"ts": e["ts"] + at_us} if "ts" in e else {})}
             for e in predicted["traceEvents"]]
    return {**measured, "traceEvents": [*events, *moved]}, at_us
