"""Where the suite's time goes: `TWINSHARD_SUITE_PROFILE=FILE pytest ...`.

Each process (controller, xdist workers) records, per test, its wall time, its CPU time (every
thread of the process: what a test costs on a loaded machine, where wall time is mostly waiting)
and the seconds jax reports through jax.monitoring (public listeners) for tracing, lowering to
MLIR and the XLA backend compile (wall seconds; a persistent-cache hit reports no backend compile); the controller prints one
row per module and writes FILE (JSON lines, one per test). Each row also lists the programs
compiled cold ("compiled": [jitted function, seconds, persistent-cache key or null]); the launchers forked by
tests/harness/zygote.py append theirs, one line per command, to FILE-launchers.jsonl. The summary ends with
the programs compiled cold more than once and the seconds their repeats cost: one cache key compiled twice is
a program two tests did not share, or one under the cache's floor of compile seconds (conftest: 0.5 s).
Only the first pytest (the controller, which sets _OWNER to its pid) and its xdist workers (its
children) record: not a pytest that a test starts (tools/mutate.py's runs inherit the variables;
measured: such a run's summary merged and deleted the workers' files).

tests/conftest.py imports this module's hooks only when the variable is set.
"""

import json
import os
import pathlib
import time


def record_programs() -> list[list]:
    """Record every cold backend compile of this process from now on, as [jitted function, seconds],
    in the list returned (the suite profile below; a program that two tests compile shows
    twice). Through jax.monitoring's public listeners: a backend compile (its start is a scalar
    event, its end a duration event, both named BACKEND_COMPILE) during which the persistent
    compilation cache reported no hit."""
    import jax

    programs: list[list] = []
    hit = [False]
    _record_cache_keys()

    def on_event(event: str, **_) -> None:
        if event == CACHE_HIT:
            hit[0] = True

    def on_start(event: str, value: float, **_) -> None:
        if event == BACKEND_COMPILE:
            hit[0] = False

    def on_end(event: str, duration: float, fun_name: str = "?", **_) -> None:
        if event == BACKEND_COMPILE and not hit[0]:
            programs.append([fun_name, round(duration, 3), _KEY[0]])

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_scalar_listener(on_start)
    jax.monitoring.register_event_duration_secs_listener(on_end)
    return programs


# the persistent-cache key of the compile in progress, one per process (every listener of record_programs reads
# it): jax resolves one, or None, before each backend compile
_KEY: list = [None]


def _record_cache_keys() -> None:
    """Set _KEY[0] to the persistent-cache key of each compile as jax resolves it (None where the cache is
    not used: libtpu's ahead-of-time compiles). jax has no public hook for it: this wraps a private
    function of jax 0.12 (jax._src.compiler._resolve_compilation_strategy, which returns (key, options)),
    once per process, and records no key where it is missing."""
    from jax._src import compiler

    resolve = getattr(compiler, "_resolve_compilation_strategy", None)
    if resolve is None or getattr(resolve, "keyed", False):
        return

    def keyed(*args, **kwargs):
        out = resolve(*args, **kwargs)
        _KEY[0] = out[0]
        return out

    keyed.keyed = True
    compiler._resolve_compilation_strategy = keyed


def compiled_twice(rows: list[dict]) -> dict[str, list[tuple[str, float]]]:
    """Cache key -> [(test or launcher command, compile seconds)] of every key compiled cold more than once in
    `rows` (the profile's test rows and launcher rows)."""
    where: dict[str, list[tuple[str, float]]] = {}
    for r in rows:
        for entry in r.get("compiled", []):
            if len(entry) > 2 and entry[2]:
                where.setdefault(entry[2], []).append((r.get("test") or " ".join(r.get("argv", []))[:80], entry[1]))
    return {k: v for k, v in where.items() if len(v) > 1}


def repeated_seconds(compiles: list[tuple[str, float]]) -> float:
    """The compile seconds one key's repeats cost: all but its longest compile."""
    seconds = [s for _, s in compiles]
    return sum(seconds) - max(seconds)


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


def record_launcher(argv: list[str]):
    """The suite profile for a launcher: its compiles, appended at its end as one JSON line to
    FILE-launchers.jsonl (FILE: TWINSHARD_SUITE_PROFILE)."""
    start, cpu, programs = time.perf_counter(), time.process_time(), record_programs()

    def write():
        row = {"argv": argv, "cwd": os.getcwd(), "wall": time.perf_counter() - start,
               "cpu": time.process_time() - cpu, "compiled": programs}
        with open(os.environ["TWINSHARD_SUITE_PROFILE"] + "-launchers.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    return write


_PROFILE = os.environ.get("TWINSHARD_SUITE_PROFILE")
if _PROFILE:
    _OWNER = os.environ.setdefault("TWINSHARD_SUITE_PROFILE_OWNER", str(os.getpid()))
    _IS_CONTROLLER = _OWNER == str(os.getpid())
    if not (_IS_CONTROLLER or (os.environ.get("PYTEST_XDIST_WORKER") and _OWNER == str(os.getppid()))):
        _PROFILE = None
ACTIVE = bool(_PROFILE)
if ACTIVE:
    import jax
    import pytest

    _COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                       "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                       "/jax/core/compile/backend_compile_duration": "compile"}
    _COLUMNS = ("wall", "cpu", "compile", "trace", "lower", "programs")  # "other" = wall minus the seconds
    _seconds: dict[str, float] = {}  # this test's seconds per _COMPILE_EVENTS kind

    def _on_duration(event: str, duration: float, **_):
        if kind := _COMPILE_EVENTS.get(event):
            _seconds[kind] = _seconds.get(kind, 0.0) + duration
            if kind == "compile":  # one backend compile per program
                _seconds["programs"] = _seconds.get("programs", 0) + 1

    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    _programs = record_programs()

    def _parts() -> list[pathlib.Path]:
        """The per-process files FILE.gw0, FILE.gw1 (xdist) or FILE.main (-n0)."""
        return sorted(pathlib.Path(_PROFILE).parent.glob(pathlib.Path(_PROFILE).name + ".*"))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _seconds.clear()
        _programs.clear()
        start, cpu = time.perf_counter(), time.process_time()
        yield
        row = {"test": item.nodeid, "wall": time.perf_counter() - start, "cpu": time.process_time() - cpu,
               **_seconds, "compiled": list(_programs)}
        with pathlib.Path(f"{_PROFILE}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}").open("a") as f:
            f.write(json.dumps(row) + "\n")

    def pytest_configure(config):
        if _IS_CONTROLLER:  # before it starts the workers
            for part in _parts():
                part.unlink()
            pathlib.Path(_PROFILE + "-launchers.jsonl").unlink(missing_ok=True)

    def pytest_terminal_summary(terminalreporter):
        if not _IS_CONTROLLER:
            return
        rows = [json.loads(line) for part in _parts() for line in part.read_text().splitlines()]
        pathlib.Path(_PROFILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
        for part in _parts():
            part.unlink()
        modules: dict[str, dict[str, float]] = {}
        for r in rows:
            m = modules.setdefault(pathlib.PurePath(r["test"].split("::")[0]).stem, dict.fromkeys(_COLUMNS, 0.0))
            for k in _COLUMNS:
                m[k] += r.get(k, 0.0)
        total = {k: sum(m[k] for m in modules.values()) for k in _COLUMNS}
        write = terminalreporter.write_line
        write(f"{'module':<28} {'wall s':>8} {'cpu s':>8} {'compile':>8} {'trace':>7} {'lower':>7} {'other':>8} {'programs':>8}")
        for name, m in sorted(modules.items(), key=lambda kv: -kv[1]["wall"]) + [("TOTAL", total)]:
            other = m["wall"] - m["compile"] - m["trace"] - m["lower"]
            write(f"{name:<28} {m['wall']:8.1f} {m['cpu']:8.1f} {m['compile']:8.1f} {m['trace']:7.1f} {m['lower']:7.1f} {other:8.1f}"
                  f" {m['programs']:8.0f}")
        launchers = pathlib.Path(_PROFILE + "-launchers.jsonl")
        every = rows + [json.loads(line) for line in (launchers.read_text().splitlines() if launchers.exists() else [])]
        cold = [e for r in every for e in r.get("compiled", [])]
        twice = sorted(compiled_twice(every).items(), key=lambda kv: -repeated_seconds(kv[1]))
        write(f"programs compiled cold: {len(cold)} ({sum(1 for e in cold if len(e) > 2 and not e[2])} without a "
              f"cache key: libtpu's); compiled more than once: {len(twice)} programs, "
              f"{sum(repeated_seconds(w) for _, w in twice):.1f} s of compile on their repeats; the costliest:")
        for k, where in twice[:5]:
            write(f"  {repeated_seconds(where):6.2f} s {k[:48]}: {len(where)} x, in {', '.join(t for t, _ in where[:3])}")
