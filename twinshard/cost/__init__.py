"""The analytic cost model: collectives, FLOPs and memory of one train step.

`cost(model_cfg, strategy, mesh, batch_size)` says which collectives the *manual* twin runs per
step, how many FLOPs the step does and how much memory each device holds: plain arithmetic in
the scaling book's notation, compared with the compiled HLO's collective ledger (`compare`).

    >>> from twinshard.config import preset
    >>> c = cost(preset("tiny").model, "fsdp", {"data": 8, "tensor": 1}, batch_size=8)
    >>> c.summary()[("reduce-scatter", ("data",))]["count"]   # one per matrix: 7L + 2
    16
    >>> text = c.table()                                       # rows, totals, FLOPs, memory

Notation
--------
    B  global batch (sequences)        d  size of mesh axis `data`
    T  sequence length                 t  size of mesh axis `tensor`
    D  d_model (= H*dh)                b  per-device batch: B/d (dp, fsdp, fsdp_tp), B (tp)
    H  heads, dh head dim              L  num_layers
    Hkv  key/value heads (= H without grouped-query attention)
    F  d_ff                            V  padded vocab (multiple of 128)
    s  bytes per element of the COMPUTE dtype (dtype_bytes: 4 = float32, 2 = bfloat16)
    w  bytes per element of the WEIGHT dtype (cfg.weight_dtype): the gradients' reductions (the twins
       run it; `param_bytes`, the memory model's what-if for the planner, leaves them)

weights.py (the parameter tree and how each strategy splits it), communication.py (collective
rows), flops.py, memory.py; this module: `cost()`, `Cost`, `compare` against a ledger, the tables.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from twinshard.config import ModelConfig
from twinshard.cost.communication import STRATEGY_ROWS, gspmd_hop_rows
from twinshard.cost.rows import AXES, NOT_REGATHERED, OPS, PHASES, Ctx, Row, int8_dw_rows, row
from twinshard.cost.flops import Flops, flops
from twinshard.cost.memory import (Memory, attention_backward, attention_kernel, memory, ring_attention_memory,
                                   saved_by_stacks, saved_per_layer)
from twinshard.cost.weights import DTYPE_BYTES, F32, RULES, Weight, weights
from twinshard.parallel import mesh as mesh_lib, pipeline, resolve, strategies, support
from twinshard.parallel.resolve import Run

__all__ = [
    "AXES", "DTYPE_BYTES", "F32", "NOT_REGATHERED", "OPS", "PHASES", "PIPELINES", "RULES", "STRATEGY_ROWS",
    "Cost", "Flops", "Memory", "Row", "Weight", "attention_backward", "attention_kernel", "compare", "compare_table",
    "cost", "flops", "gspmd_pipeline_hops", "human", "memory", "of_run", "ring_attention_memory", "row", "saved_by_stacks", "saved_per_layer",
    "summarize", "weights",
]

PIPELINES = strategies.of_family("pipeline")  # on a `stage` axis (twinshard/parallel/pipeline.py); their mesh names it


# ----------------------------------------------------------------------------- result


@dataclass(frozen=True)
class Cost:
    strategy: str
    mesh: dict[str, int]
    batch_size: int
    seq_len: int
    dtype_bytes: int
    collectives: list[Row]
    flops: Flops
    memory: Memory
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[tuple[str, tuple[str, ...]], dict[str, float]]:
        """(op, axes) -> {count, bytes, ring_bytes} (the shape of `Ledger.summary()`)."""
        return summarize(self.collectives)

    def by_axes(self) -> dict[tuple[str, ...], dict[str, float]]:
        """axes -> {count, bytes, ring_bytes}, all ops together."""
        out: dict[tuple[str, ...], dict[str, float]] = {}
        for (_, axes), s in self.summary().items():
            acc = out.setdefault(axes, {"count": 0, "bytes": 0, "ring_bytes": 0.0})
            for k in acc:
                acc[k] += s[k]
        return out

    def table(self) -> str:
        """Fixed-width text: one line per row, then per-axis totals, FLOPs and memory."""
        head = ("phase", "op", "axes", "count", "bytes", "ring bytes", "what")
        lines = [(r.phase, r.op, r.pattern or ",".join(r.axes), str(r.count), human(r.bytes), human(r.ring_bytes),
                  r.what)
                 for r in self.collectives]
        out = format_table(head, lines) if lines else ["(no collectives)"]
        for axes, s in self.by_axes().items():
            out.append(f"total over {','.join(axes)}: {s['count']} collectives, {human(s['bytes'])}, "
                       f"ring {human(s['ring_bytes'])} per device")
        f, m = self.flops, self.memory
        out.append(f"flops/step: {f.total:.4g} total (forward {f.forward:.4g} = matmul {f.forward_matmul:.4g} "
                   f"+ attention {f.forward_attention:.4g}; backward 2x), {f.per_device:.4g} per device")
        out.append(f"memory/device: params {human(m.params)}, grads {human(m.grads)}, optimizer "
                   f"{human(m.optimizer)}, activations ~{human(m.activations)}"
                   + (f", gathered weights ~{human(m.gathered_weights)}" if m.gathered_weights else "")
                   + (f", gradient accumulator {human(m.accumulator)}" if m.accumulator else "")
                   + f"; total ~{human(m.total)}")
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "mesh": dict(self.mesh), "batch_size": self.batch_size,
            "seq_len": self.seq_len, "dtype_bytes": self.dtype_bytes,
            "collectives": [{**dataclasses.asdict(r), "axes": list(r.axes)} for r in self.collectives],
            "summary": [{"op": op, "axes": list(axes), **v} for (op, axes), v in self.summary().items()],
            "flops": dataclasses.asdict(self.flops),
            "memory": {**dataclasses.asdict(self.memory), "total": self.memory.total},
            "notes": list(self.notes),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.as_dict(), **kwargs)

    def __str__(self) -> str:
        return self.table()


# ----------------------------------------------------------------------------- entry point


def _normalize_mesh(strategy: str, mesh: Mapping[str, int]) -> dict[str, int]:
    """The strategy's mesh axes (twinshard/parallel/mesh.py NEEDS), a missing one as 1, checked."""
    axes = tuple(a for a in AXES if a in mesh_lib.NEEDS[strategy])
    unknown = [a for a in mesh if a not in axes]
    if unknown:
        example = ", ".join(f"'{a}': {a[0]}" for a in axes)
        raise ValueError(f"mesh axis {unknown[0]!r} is not one of {axes}; write the mesh as {{{example}}}.")
    shape = {a: int(mesh.get(a, 1)) for a in axes}
    for a, n in shape.items():
        if n < 1:
            raise ValueError(f"mesh axis {a}={n} must be >= 1.")
    mesh_lib.check_mesh(strategy, shape, math.prod(shape.values()))
    return shape


def cost(cfg: ModelConfig, strategy: str, mesh: Mapping[str, int], batch_size: int,
         seq_len: int | None = None, dtype_bytes: int | None = None, grad_accum: int = 1,
         microbatches: int = 1, optimizer: str = "adamw", remat: str | None = None,
         schedule: str = "gpipe", gpu: bool = False, param_bytes: int | None = None, state_bytes: int | None = None,
         master: bool = False, flat_weights: bool = False, virtual_stages: int = 1) -> Cost:
    """Collectives, FLOPs and per-device memory of one train step of `strategy` on `mesh`.

    `remat` (default cfg.remat) changes the memory only, except under tp_sp, which re-gathers its
    sequence shards under any policy but none. virtual_stages: interleaved's chunks per stage. param_bytes,
    state_bytes (default: cfg.weight_dtype's): the memory of a param and its gradient, of a moment. flat_weights:
    FSDP's weights split flat (padded,
    twinshard/hardware/plan.py), so d_model need not divide by data. Invalid input (and the runs
    launch.train refuses) raises a one-line ValueError."""
    resolve.check_experts(strategies.get(strategy), cfg)  # as launch.train: no numbers for a program that does not exist
    if cfg.collective_matmul and strategy not in support.with_option("collective_matmul"):
        raise ValueError(f"collective_matmul decomposes the sequence all-gathers of tp_sp alone, not of strategy "
                         f"{strategy}: use strategy tp_sp or collective_matmul=False.")
    if cfg.tp_overlap_chunks > 1 and strategy not in support.with_option("tp_overlap"):
        raise ValueError(f"tp_overlap_chunks={cfg.tp_overlap_chunks} chunks Megatron's all-reduces, which strategy "
                         f"{strategy} does not run: use strategy {' or '.join(support.with_option('tp_overlap'))}, "
                         "or tp_overlap_chunks=1.")
    if strategy not in STRATEGY_ROWS:
        raise ValueError(f"strategy {strategy!r} has no cost model; choose one of {', '.join(STRATEGY_ROWS)}.")
    shape = _normalize_mesh(strategy, mesh)
    seq = cfg.context_length if seq_len is None else int(seq_len)
    if not 1 <= seq <= cfg.context_length:
        raise ValueError(f"seq_len={seq} must be in [1, context_length={cfg.context_length}]; "
                         "pass a smaller seq_len or a model with a longer context.")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be positive.")
    if dtype_bytes is None:  # the config's compute dtype
        dtype_bytes = DTYPE_BYTES[cfg.dtype]
    if dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes={dtype_bytes} must be 1, 2, 4 or 8 (4 for float32).")
    param_bytes = DTYPE_BYTES[cfg.weight_dtype] if param_bytes is None else param_bytes
    state_bytes = DTYPE_BYTES[cfg.weight_dtype] if state_bytes is None else state_bytes
    for name, n in (("param_bytes", param_bytes), ("state_bytes", state_bytes)):
        if n not in (2, 4):
            raise ValueError(f"{name}={n!r} must be 2 (bfloat16) or 4 (float32); None: cfg.weight_dtype's.")
    dims = {"batch": batch_size, "embed": cfg.d_model, "heads": cfg.num_heads, "kv_heads": cfg.kv_heads,
            "mlp": cfg.d_ff, "vocab": cfg.padded_vocab_size, "seq": seq, "experts": cfg.num_experts}
    if strategy in PIPELINES:
        pipeline.check(cfg.num_layers, batch_size, shape["stage"], microbatches, grad_accum, shape["data"], schedule,
                       virtual_stages)
    skip = {"layers", "embed"} if flat_weights else {"layers"}
    mesh_lib.check_divisible(dims, {k: v for k, v in RULES[strategy].items() if k not in skip}, shape)
    local = batch_size // mesh_lib.axis_size(shape, RULES[strategy]["batch"]) if "batch" in RULES[strategy] else batch_size
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1 or local % grad_accum:
        raise ValueError(f"grad_accum={grad_accum!r} must be an int >= 1 that divides the per-device batch "
                         f"of {local} sequences; choose one of {[k for k in range(1, local + 1) if local % k == 0]}.")
    if (local // grad_accum) % cfg.tp_overlap_chunks:
        raise ValueError(f"tp_overlap_chunks={cfg.tp_overlap_chunks} does not divide the {local // grad_accum} "
                         "sequences of a device's micro-batch; choose a divisor of them (1: off).")
    return _priced(cfg, strategy, shape, batch_size, seq, dtype_bytes, grad_accum, microbatches, optimizer, remat,
                   schedule, gpu, param_bytes, state_bytes, master, virtual_stages)


def gspmd_pipeline_hops(cfg: ModelConfig, mesh: Mapping[str, int], batch_size: int, microbatches: int,
                        virtual_stages: int = 1, schedule: str = "gpipe") -> list[Row]:
    """The collective-permutes over `stage` of the GSPMD twin's pipeline step (pp or pp_fsdp, whose
    mesh has `data`), in the compute dtype: `cost` models the manual twin's, whose hops differ."""
    shape = {"stage": 1, "data": 1, "tensor": 1, **mesh}
    pipeline.check(cfg.num_layers, batch_size, shape["stage"], microbatches, 1, shape["data"], schedule, virtual_stages)
    ctx = Ctx(cfg, shape, batch_size, cfg.context_length, DTYPE_BYTES[cfg.dtype], microbatches=microbatches,
              schedule=schedule, virtual=virtual_stages)
    return gspmd_hop_rows(ctx)


def of_run(run: Run, gpu: bool = False, tpu: bool = False) -> Cost:
    """`cost` of one train step of a resolved run (twinshard/parallel/resolve.py), which made every
    check `cost` makes: none runs again. Its config gives the batch, the whole context, the compute
    dtype, and the weight dtype of params, gradients and moments (ModelConfig.weight_dtype). `gpu`,
    `tpu`: the backend that picks attention="auto"'s kernel (cuDNN, splash; else recompute)."""
    t, m = run.cfg.train, run.cfg.model
    w = DTYPE_BYTES[m.weight_dtype]
    return _priced(m, run.strategy, dict(run.mesh), t.batch_size, m.context_length, DTYPE_BYTES[m.dtype],
                   t.grad_accum, t.microbatches, t.optimizer, None, t.schedule, gpu, w, w, False, t.virtual_stages, tpu,
                   accum_bytes=w if t.grad_accum_dtype == "weight" else 4)


def _priced(cfg: ModelConfig, strategy: str, shape: dict[str, int], batch_size: int, seq: int, dtype_bytes: int,
            grad_accum: int, microbatches: int, optimizer: str, remat: str | None, schedule: str, gpu: bool,
            param_bytes: int, state_bytes: int, master: bool, virtual: int = 1, tpu: bool = False,
            accum_bytes: int = 4) -> Cost:
    """The rows, FLOPs and memory of checked input (`cost`'s arguments, or a resolved run's)."""
    if remat is not None:  # tp_sp's collectives depend on it (its re-gathers), the others' do not
        cfg = dataclasses.replace(cfg, remat=remat)
    ctx = Ctx(cfg, shape, batch_size, seq, dtype_bytes, grad_accum, microbatches, schedule, virtual,
              DTYPE_BYTES[cfg.weight_dtype])
    rows = sorted(STRATEGY_ROWS[strategy](ctx) + int8_dw_rows(ctx), key=lambda r: PHASES.index(r.phase))  # stable
    notes = [n for n in _NOTES.get(strategy, ())]
    return Cost(strategy, shape, batch_size, seq, dtype_bytes, rows,
                flops(cfg, batch_size, seq, math.prod(shape.values())),
                memory(cfg, strategy, shape, batch_size, seq, dtype_bytes, grad_accum, microbatches, optimizer,
                       remat, schedule, gpu, param_bytes, state_bytes, master, virtual, tpu=tpu,
                       accum_bytes=accum_bytes), notes)


_PMAX = ("the cross-entropy max is an all-reduce with max (pmax), a row `all-reduce max` of the ledger; "
         "the model counts it among the all-reduces over tensor")
_NOTES = {"tp": [_PMAX], "fsdp_tp": [_PMAX], "tp_sp": [_PMAX], "fsdp_tp_sp": [_PMAX]}


# ----------------------------------------------------------------------------- comparing with a ledger


def summarize(rows: list[Row]) -> dict[tuple[str, tuple[str, ...]], dict[str, Any]]:
    """(op, axes) -> {count, bytes, ring_bytes} (+ a collective-permute's `patterns`), as `Ledger.summary()`."""
    out: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
    for r in rows:
        s = out.setdefault((r.op, r.axes), {"count": 0, "bytes": 0, "ring_bytes": 0.0})
        s["count"] += r.count
        s["bytes"] += r.bytes
        s["ring_bytes"] += r.ring_bytes
        if r.pattern:
            patterns = s.setdefault("patterns", {})
            patterns[r.pattern] = patterns.get(r.pattern, 0) + r.count
    return out


def compare(measured: Mapping[tuple[str, tuple[str, ...]], Mapping[str, float]],
            model: Mapping[tuple[str, tuple[str, ...]], Mapping[str, float]]) -> list[dict[str, Any]]:
    """One row per (op, axes) of `measured` (Ledger.summary()) or `model` (Cost.summary()); `match`
    when count, bytes and any collective-permute patterns agree exactly."""
    zero = {"count": 0, "bytes": 0, "ring_bytes": 0.0}
    keys = list(model) + [k for k in measured if k not in model]
    out = []
    for op, axes in keys:
        got, want = measured.get((op, axes), zero), model.get((op, axes), zero)
        out.append({
            "op": op, "axes": list(axes),
            "measured_count": got["count"], "model_count": want["count"],
            "measured_bytes": got["bytes"], "model_bytes": want["bytes"],
            "measured_ring_bytes": got["ring_bytes"], "model_ring_bytes": want["ring_bytes"],
            "match": got["count"] == want["count"] and got["bytes"] == want["bytes"]
            and ("patterns" not in want or got.get("patterns") == want["patterns"]),
            **({"measured_patterns": got.get("patterns", {}), "model_patterns": want["patterns"]}
               if "patterns" in want else {}),
        })
    return out


def compare_table(rows: list[dict[str, Any]]) -> str:
    """`compare` rows as text, with measured/model ratios and per-axis totals."""
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.3f}" if b else ("-" if not a else "model: none")

    head = ("op", "axes", "count meas/model", "bytes meas", "bytes model", "meas/model",
            "ring meas", "ring model", "")
    lines = [(r["op"], ",".join(r["axes"]) or "-", f"{r['measured_count']}/{r['model_count']}",
              human(r["measured_bytes"]), human(r["model_bytes"]), ratio(r["measured_bytes"], r["model_bytes"]),
              human(r["measured_ring_bytes"]), human(r["model_ring_bytes"]), "ok" if r["match"] else "DIFFERS"
              + (f" who sends to whom: measured {r['measured_patterns']}, model {r['model_patterns']}"
                 if r.get("measured_patterns", {}) != r.get("model_patterns", {}) else ""))
             for r in rows]
    totals: dict[tuple[str, ...], list[float]] = {}
    for r in rows:
        acc = totals.setdefault(tuple(r["axes"]), [0, 0, 0, 0, 0.0, 0.0])
        for i, k in enumerate(("measured_count", "model_count", "measured_bytes", "model_bytes",
                               "measured_ring_bytes", "model_ring_bytes")):
            acc[i] += r[k]
    for axes, (mc, wc, mb, wb, mr, wr) in totals.items():
        lines.append(("TOTAL", ",".join(axes) or "-", f"{mc}/{wc}", human(mb), human(wb), ratio(mb, wb),
                      human(mr), human(wr), "ok" if (mc, mb) == (wc, wb) else "DIFFERS"))
    return "\n".join(format_table(head, lines) if lines else ["(no collectives)"])


# ----------------------------------------------------------------------------- text


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def format_table(head: tuple[str, ...], lines: list[tuple]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]

    def fmt(r) -> str:
        return "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()

    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines]
