"""Test configuration: 8 simulated CPU devices, set before jax starts.

XLA reads XLA_FLAGS once, when the backend first initialises, so this module
must run before any test module imports jax (pytest imports conftest first).
`--xla_backend_optimization_level=0` halves compile time and leaves the
collectives in the HLO unchanged (measured, JAX 0.12; docs/design.md, JAX facts).

Suite time is compile time (a cold CI clone compiles everything: ~1-5 s per tiny
program). A module's tests share its compiled runners (`functools.cache` or a
module-scoped fixture: compile each runner ONCE, read losses, gradients, params and
the ledger from it); programs identical across modules (same config, mesh and
function) are shared through the persistent compilation cache below, also by the
launcher subprocesses (tests/cli.py `env()`): reuse tests/runners.py's CFG and MESHES
when a new test does not need its own. What else makes the suite fast lives in
tests/harness/ (why, and its measured gain, in its __init__).
"""

import importlib.util
import os
import sys

from harness import cache, markers, schedule, speed  # stdlib imports only

speed.use_bytecode_cache()  # before the heavy imports below

# TWINSHARD_TEST_PLATFORM=tpu: the kernel tests on a real chip (tools/tpu_bench.sh); CPU otherwise
os.environ["JAX_PLATFORMS"] = os.environ.get("TWINSHARD_TEST_PLATFORM", "cpu")
# The persistent compilation cache, keyed by the traced code's sources (why: tests/harness/cache.py);
# the xdist workers and every launcher subprocess inherit the directory.
if "TWINSHARD_TEST_CACHE" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    cache.prune(keep=cache.directory())  # the first pytest process only: earlier sources' caches
os.environ["TWINSHARD_TEST_CACHE"] = str(cache.directory())
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["TWINSHARD_TEST_CACHE"]
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

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

speed.tune_gc()  # after the imports: they are frozen

from harness import suite_profile  # noqa: E402  (imports jax when active: after XLA_FLAGS)

# The hooks of tests/harness/: xdist scheduling, and the suite profile when asked for.
if importlib.util.find_spec("xdist"):  # pytest refuses a hook of a plugin it lacks (a TPU machine's pytest)
    pytest_xdist_make_scheduler = schedule.pytest_xdist_make_scheduler
if suite_profile.ACTIVE:
    from harness.suite_profile import pytest_runtest_protocol, pytest_terminal_summary  # noqa: F401


def pytest_configure(config):
    markers.pytest_configure(config)  # `pytest -m fsdp`: every proof of a strategy (harness/markers.py)
    if suite_profile.ACTIVE:
        suite_profile.pytest_configure(config)


def pytest_collection_modifyitems(config, items):
    markers.mark_strategies(items)
    schedule.pytest_collection_modifyitems(config, items)


def pytest_sessionstart(session):
    n = jax.device_count()
    if n != 8 and os.environ["JAX_PLATFORMS"] == "cpu":  # on a chip (TWINSHARD_TEST_PLATFORM): its own devices
        raise RuntimeError(
            f"tests need 8 simulated CPU devices, found {n}: jax was imported before "
            "tests/conftest.py set XLA_FLAGS (run tests with `uv run pytest`)."
        )


def pytest_runtest_teardown(item, nextitem):
    """absl's flags are process-global and a parse only sets the flags in its argv: a launcher test's
    `--batch_size=2` stays `present` for the next test of the same xdist worker (CI failed on exactly that
    in tests/test_fast_path.py), so every test ends with them unparsed.
    Release compiled programs after a module's last test, or sooner where one module's programs
    near Linux's limit on a process's memory mappings (tests/harness/speed.py says why)."""
    absl_flags = sys.modules.get("absl.flags")
    if absl_flags is not None:
        absl_flags.FLAGS.unparse_flags()
    if nextitem is None or nextitem.module is not item.module:
        speed.release_executables(item.module)
    elif speed.memory_mappings() > speed.MAX_MAPPINGS:
        speed.release_executables(None)
