"""Timing on the device at hand: the median and 25th-percentile time of a call, the measured
FLOP/s of a square matmul (the peak that "% of peak" and MFU on a CPU are measured against),
and what JAX reports of a compile: its phases' seconds (CompileEvents) and the compiled
program's bytes per device (memory_analysis)."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any


def median_time(fn, reps: int, inner: int = 1) -> tuple[float, list[float]]:
    """Median seconds per call of fn(i) over `reps` samples, each `inner` calls blocked once at the end."""
    import jax

    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        out = [fn(r * inner + k) for k in range(inner)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times), times


def p25(times: list[float]) -> float:
    """The 25th percentile of `times`, between its min and max. statistics.quantiles' default
    ("exclusive") extrapolates below the smallest sample when there are few: of 2 times
    [a, b] it is (5a - b) / 4, negative once b > 5a (a CI run on a loaded machine: a matmul
    peak of -24 GFLOP/s)."""
    return statistics.quantiles(times, n=4, method="inclusive")[0] if len(times) > 1 else times[0]


def matmul_peak(dtype: str, n: int, reps: int, device) -> dict[str, Any]:
    """FLOP/s of a jitted [n,n]x[n,n] matmul at JAX's default precision on `device`
    (random inputs, three pairs in rotation; median of `reps`)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 6)
    mats = [jax.device_put(jax.random.normal(k, (n, n), dtype), device) for k in keys]
    pairs = [(mats[2 * i], mats[2 * i + 1]) for i in range(3)]
    f = jax.jit(jnp.matmul)
    jax.block_until_ready([f(a, b) for a, b in pairs])  # compile, warm
    inner = 1 if device.platform == "cpu" else 5  # amortize dispatch where a matmul takes ~1 ms
    med, times = median_time(lambda i: f(*pairs[i % 3]), reps, inner)
    # The peak is the rate of an undisturbed matmul: the 25th percentile of the times. Measured on
    # this project's 2-core VM: one process's medians of 10 moved 65-105 GFLOP/s within a minute
    # (neighbours' bursts), which made "% of peak" read up to 100% for a step that had not changed.
    fast = p25(times)
    return {"dtype": dtype, "n": n, "reps": reps, "inner": inner, "median_s": med, "p25_s": fast,
            "flops_per_s": 2 * n ** 3 / fast, "flops_per_s_median": 2 * n ** 3 / med, "times_s": times}


class CompileEvents:
    """Sums JAX's compile-phase durations (jax.monitoring events) recorded while active:
    trace (jaxpr), lower (jaxpr -> StableHLO) and backend compile (XLA)."""

    EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "compile_s"}

    def __enter__(self) -> dict[str, float]:
        import jax

        self.times, self.active = dict.fromkeys(self.EVENTS.values(), 0.0), True
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self.times

    def _listen(self, event: str, duration: float, **_) -> None:
        if self.active and event in self.EVENTS:
            self.times[self.EVENTS[event]] += duration

    def __exit__(self, *exc) -> None:
        import jax

        self.active = False  # an older jax without unregister keeps calling it: count nothing more
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:
            unregister(self._listen)


MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                 "temp_size_in_bytes", "generated_code_size_in_bytes")


def memory_analysis(compiled) -> dict[str, int] | None:
    """`compiled.memory_analysis()`'s bytes per device, field by field (MEMORY_FIELDS); None where
    the backend reports none."""
    ma = compiled.memory_analysis()
    return None if ma is None else {k: int(getattr(ma, k)) for k in MEMORY_FIELDS}


def trace_steps(compiled, state, batch, steps: int, where: str):
    """`steps` more steps of `compiled` (a train step: (state, x, y) -> (state, metrics)) under
    jax.profiler.trace(where), the compiled step's HLO text (step.hlo.txt: the trace's op names are its
    instructions') and the steps' wall time and device (profile.json) beside the trace; returns the new
    state (the step donates it). launch.bench --profile and tools/step_profile.py trace with it."""
    import jax

    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "step.hlo.txt"), "w") as f:
        f.write(compiled.as_text())
    with jax.profiler.trace(where):
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, *batch)
        jax.block_until_ready((state, metrics))
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    dev = jax.devices()[0]
    with open(os.path.join(where, "profile.json"), "w") as f:
        json.dump({"steps": steps, "wall_ms": wall_ms, "platform": dev.platform, "device_kind": dev.device_kind}, f)
    return state
