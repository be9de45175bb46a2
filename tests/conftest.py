"""Test configuration: 8 simulated CPU devices, set before jax starts.

XLA reads XLA_FLAGS once, when the backend first initialises, so this module
must run before any test module imports jax (pytest imports conftest first).
`--xla_backend_optimization_level=0` halves compile time and leaves the
collectives in the HLO unchanged (measured, JAX 0.12; docs/design.md, JAX facts).

Suite time is compile time (a cold CI clone compiles everything: ~1-5 s per tiny
program). Two rules keep it down:

- Sharing. A module's tests share its compiled runners (`functools.cache` or a
  module-scoped fixture: compile each runner ONCE, read losses, gradients, params and
  the ledger from it). Programs that are identical across modules (same config, mesh
  and function) are shared through the persistent compilation cache below, also by
  the launcher subprocesses (tests/cli.py `env()`): reuse an existing module's config
  (tests/runners.py's CFG and MESHES) when a new test does not need its own.
- Scheduling (pytest-xdist `--dist loadgroup`, pyproject.toml; the groups come from
  group_of() below, not from xdist_group marks: see pytest_xdist_make_scheduler).
  Each module is one group (SHARED_GROUPS joins modules that compile the same
  programs), so its cached runners and module fixtures are built on ONE worker (with
  `--dist load` a module's tests were spread over both workers and each built them:
  test_readme ran every README command twice). The groups start costliest first
  (COLD_SECONDS, single-worker seconds on a cold cache); the modules in UNGROUPED hold
  independent tests and are dealt out one test at a time to even out the finish. A new
  module is a group by default: add its measured cold time to COLD_SECONDS.
"""

import os
import pathlib
import sys

# Python bytecode: every test process (this one, the xdist workers it starts, every subprocess
# a test runs) reads and writes .pyc files under .cache/pycache. With PYTHONDONTWRITEBYTECODE=1
# in the environment (this project's shells set it) and uv's install writing none, each process
# compiled the sources of jax, flax, optax and orbax again: `import jax, flax.nnx, optax,
# orbax.checkpoint, numpy, pytest` took 8.7-9.1 s of CPU, 2.8-3.5 s with the cache (measured).
# TWINSHARD_READ_ONLY_BYTECODE=1 (tools/mutate.py's runs) keeps PYTHONDONTWRITEBYTECODE: a .pyc
# of a mutated file must never be written (tests/cli.py does the same for the subprocesses).
if os.environ.get("TWINSHARD_READ_ONLY_BYTECODE") != "1":
    os.environ["PYTHONPYCACHEPREFIX"] = str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "pycache")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.pycache_prefix, sys.dont_write_bytecode = os.environ["PYTHONPYCACHEPREFIX"], False

os.environ["JAX_PLATFORMS"] = "cpu"
# Source locations are part of the persistent cache key (JAX strips them by default): the ledger
# tests assert which line of the code asked for each collective, and an executable cached before
# a module moved carried the old file name (measured: "twinshard/loss.py:53" after the move to
# twinshard/model/loss.py). Launcher subprocesses inherit it.
os.environ["JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY"] = "true"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
# The launchers' malloc tunables (launch/__init__.py): inherited by the xdist workers and every
# launcher subprocess (glibc reads them at process start, so this process keeps its own).
from launch import MALLOC_TUNABLES  # noqa: E402

os.environ.setdefault("GLIBC_TUNABLES", MALLOC_TUNABLES)

import jax  # noqa: E402  (must come after XLA_FLAGS)

_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "jax"
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Python's cyclic GC, tuned for tracing: JAX allocates millions of short-lived objects per
# traced program, and with the default thresholds (700, 10, 10) a test worker ran ~2000
# collections, the full ones scanning every cached runner, jaxpr and array. Measured
# (test_manual + test_sequence, -n0, warm compilation cache, 2-core VM): 1981 collections,
# 4.5 s of 52 s; with the imports frozen (gc.freeze: never scanned again) and gen-0 at 100k
# objects, 1.6 s. tests/zygote.py does the same before it forks the launchers.
import zygote  # noqa: E402  (tests/zygote.py: imports nothing at module level beyond the stdlib)

zygote.tune_gc()


# Wall seconds of each group on a cold compilation cache (measured: a fresh clone's profiled
# `bash .ci/run`, 2 workers on 2 cores, 2026-12-02); only the order matters: the scheduler hands
# out the costliest group first.
COLD_SECONDS = {
    "test_twins": 230, "test_readme": 170, "test_pipeline": 100, "test_train": 95, "test_accum": 85,
    "test_context": 80, "test_multiprocess": 70, "test_optimizers": 60, "test_scan": 45, "test_tpu_topology": 45,
    "test_precision": 40, "test_wheel": 40, "test_bf16_parallel": 180, "test_collectives_cli": 30, "test_bench": 25,
    "test_moe": 25, "test_experts": 80, "test_ragged": 95, "test_shards": 22,
    # ungrouped: their tests are dealt out after the groups, the slowest module's first
    "test_attention": 20, "test_model": 20, "test_readme_snippet": 17, "test_loss_optim": 11, "test_layers": 10,
    "test_cli_errors": 2,
}
DEFAULT_SECONDS = 30  # a group not measured yet (an ungrouped module not listed: 0, cheap)
# Modules of independent tests (no shared runner or costly module fixture): not grouped.
UNGROUPED = {
    "test_layers", "test_loss_optim", "test_attention", "test_model", "test_cli_errors",
    "test_validation", "test_mesh", "test_plan", "test_cost", "test_data", "test_bpe", "test_tokenizer",
    "test_readme_snippet", "test_hlo", "test_hlo_input", "test_compile_cache", "test_cli_fork", "test_mutate",
    "test_strategies", "test_same_programs",
}
# Modules that compile the same programs (same config and mesh) share one group, so they run one
# after the other and the second loads the first's programs from the persistent cache.
# Measured: test_memory's tiny train steps and test_remat's remat-none gradients are test_auto's
# or test_manual's programs (tests/runners.py's CFG).
SHARED_GROUPS = {m: "test_twins" for m in ("test_auto", "test_manual", "test_memory", "test_remat",
                                           "test_sequence")}  # test_sequence: test_manual's single and tp


def group_of(module: str) -> str | None:
    """The xdist group of a test module (None: its tests are dealt out one by one)."""
    return None if module in UNGROUPED else SHARED_GROUPS.get(module, module)


def _module(nodeid: str) -> str:
    return pathlib.PurePath(nodeid.split("::")[0]).stem


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, with the groups taken from group_of() instead of xdist_group marks.

    Measured (pytest 9.2, pytest-xdist 3.8): xdist's own loadgroup puts the group into the
    node id by setting `item._nodeid`, which pytest 9 no longer reads (`item.nodeid` comes
    from `item._id`), so every group's tests were spread over both workers as under --dist
    load. This scheduler reads the module from the node id itself."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(_module(nodeid)) or nodeid

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    # xdist workers only (the scheduler deals out their collection order): the costliest groups
    # first, the ungrouped tests last, to fill the tail. A stable sort; a plain pytest run (and
    # tools/mutate.py's, which lists the cheapest tests first) keeps the command line's order.
    def cost(item):
        group = group_of(_module(item.nodeid))
        return group is None, -COLD_SECONDS.get(group or _module(item.nodeid), DEFAULT_SECONDS if group else 0)

    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=cost)


def pytest_sessionstart(session):
    n = jax.device_count()
    if n != 8:
        raise RuntimeError(
            f"tests need 8 simulated CPU devices, found {n}: jax was imported before "
            "tests/conftest.py set XLA_FLAGS (run tests with `uv run pytest`)."
        )


# --- Where the suite's time goes: TWINSHARD_SUITE_PROFILE=FILE pytest ... -----------------------
# Each process (controller, xdist workers) records, per test, its wall time and the seconds jax
# reports through jax.monitoring for tracing, lowering to MLIR and the XLA backend compile (a
# persistent-cache hit reports no backend compile); the controller prints one row per module and
# writes FILE (JSON lines, one per test). Launcher subprocesses are not traced: their time is in
# "other". Measured with it (2-core EPYC VM, cold cache, 1831 worker-s in all, 2026-12-01):
# backend compile 805 s, trace 209 s, lower 121 s; the subprocess modules (test_readme 328 s,
# test_multiprocess 106 s, ...) ~600 s. Each row also lists the programs compiled cold
# ("compiled": [jitted function, seconds]); the launchers forked by
# tests/zygote.py append theirs, one line per command, to FILE-launchers.jsonl.
# Only the first pytest (the controller, which sets _OWNER to its pid) and its xdist workers (its
# children) record: not a pytest that a test starts (tools/mutate.py's runs inherit the variables;
# measured: such a run's summary merged and deleted the workers' files).
_PROFILE = os.environ.get("TWINSHARD_SUITE_PROFILE")
if _PROFILE:
    _OWNER = os.environ.setdefault("TWINSHARD_SUITE_PROFILE_OWNER", str(os.getpid()))
    _IS_CONTROLLER = _OWNER == str(os.getpid())
    if not (_IS_CONTROLLER or (os.environ.get("PYTEST_XDIST_WORKER") and _OWNER == str(os.getppid()))):
        _PROFILE = None
if _PROFILE:
    import json
    import time

    import pytest

    _COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                       "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                       "/jax/core/compile/backend_compile_duration": "compile"}
    _COLUMNS = ("wall", "compile", "trace", "lower", "programs")  # "other" = wall minus the seconds
    _seconds: dict[str, float] = {}  # this test's seconds per _COMPILE_EVENTS kind

    def _on_duration(event: str, duration: float, **_):
        if kind := _COMPILE_EVENTS.get(event):
            _seconds[kind] = _seconds.get(kind, 0.0) + duration
            if kind == "compile":  # one backend compile per program
                _seconds["programs"] = _seconds.get("programs", 0) + 1

    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    from zygote import record_programs  # each cold compile: [jitted function, seconds]

    _programs = record_programs()

    def _parts() -> list[pathlib.Path]:
        """The per-process files FILE.gw0, FILE.gw1 (xdist) or FILE.main (-n0)."""
        return sorted(pathlib.Path(_PROFILE).parent.glob(pathlib.Path(_PROFILE).name + ".*"))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _seconds.clear()
        _programs.clear()
        start = time.perf_counter()
        yield
        row = {"test": item.nodeid, "wall": time.perf_counter() - start, **_seconds, "compiled": list(_programs)}
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
            m = modules.setdefault(_module(r["test"]), dict.fromkeys(_COLUMNS, 0.0))
            for k in _COLUMNS:
                m[k] += r.get(k, 0.0)
        total = {k: sum(m[k] for m in modules.values()) for k in _COLUMNS}
        write = terminalreporter.write_line
        write(f"{'module':<28} {'wall s':>8} {'compile':>8} {'trace':>7} {'lower':>7} {'other':>8} {'programs':>8}")
        for name, m in sorted(modules.items(), key=lambda kv: -kv[1]["wall"]) + [("TOTAL", total)]:
            other = m["wall"] - m["compile"] - m["trace"] - m["lower"]
            write(f"{name:<28} {m['wall']:8.1f} {m['compile']:8.1f} {m['trace']:7.1f} {m['lower']:7.1f} {other:8.1f}"
                  f" {m['programs']:8.0f}")
