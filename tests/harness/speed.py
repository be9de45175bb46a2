"""Process start-up of every test process: a shared bytecode cache and a GC tuned for tracing.

`use_bytecode_cache()` runs before the heavy imports (tests/conftest.py calls it first);
`tune_gc()` after them (conftest, and tests/harness/zygote.py before it forks launchers).
"""

import gc
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def use_bytecode_cache() -> None:
    """Every test process (pytest, its xdist workers, every subprocess a test runs) reads and
    writes .pyc files under .cache/pycache.

    With PYTHONDONTWRITEBYTECODE=1 in the environment and uv's install writing no .pyc, each
    process compiled the sources of jax, flax, optax and orbax again: `import jax, flax.nnx,
    optax, orbax.checkpoint, numpy, pytest` took 8.7-9.1 s of CPU, 2.8-3.5 s with the cache
    (measured, 2-core VM). TWINSHARD_READ_ONLY_BYTECODE=1 (tools/mutate.py's runs) keeps
    PYTHONDONTWRITEBYTECODE: a .pyc of a mutated file must never be written."""
    if os.environ.get("TWINSHARD_READ_ONLY_BYTECODE") != "1":
        os.environ["PYTHONPYCACHEPREFIX"] = str(ROOT / ".cache" / "pycache")
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        sys.pycache_prefix, sys.dont_write_bytecode = os.environ["PYTHONPYCACHEPREFIX"], False


def tune_gc() -> None:
    """Freeze what is alive now (the imports: never scanned again, and a fork's children share
    those pages untouched) and collect generation 0 every 100k allocations instead of 700.

    JAX allocates millions of short-lived objects per traced program; with the default
    thresholds (700, 10, 10) a test worker ran ~2000 collections, the full ones scanning every
    cached runner, jaxpr and array. Measured (two test modules, -n0, warm compilation cache,
    2-core VM): 1981 collections, 4.5 s of 52 s; tuned, 1.6 s."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)


MAX_MAPPINGS = 40_000  # of vm.max_map_count's default 65,530


def memory_mappings() -> int:
    """This process's memory mappings (lines of /proc/self/maps; 0 where there is none)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def release_executables(module) -> None:
    """Drop every compiled program JAX caches (jax.clear_caches) and collect: XLA:CPU maps each
    compiled kernel's code, rodata and data as 3 anonymous mappings that live as long as its
    executable (measured: 17,774 mappings after 45 s of test_context + test_gqa in one process,
    5,720 of each kind), and a test worker that kept every program passed Linux's default
    vm.max_map_count of 65,530 and segfaulted inside XLA (compile, or serialize() for the
    compilation cache) 40% into the suite. Called after a test module's last test with that
    module (tests/conftest.py): its functools caches (compiled runners, records) are emptied too
    (module None: JAX's caches alone, mid-module past MAX_MAPPINGS);
    a program needed again comes back from the persistent compilation cache."""
    import jax

    for value in list(vars(module).values()) if module is not None else ():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    jax.clear_caches()
    gc.collect()
