"""JAX's persistent compilation cache, switched off for a block of code.

Measured (JAX 0.12): `jax.config.update("jax_enable_compilation_cache", False)` is read only
by a process's FIRST compile; JAX then memoizes whether the cache is used. After any compile
with the cache on, setting the flag to False changes nothing (a later compile still writes its
entry; tests/test_compile_cache.py shows both). `reset_cache()` drops that memo, so the flag
is read again at the next compile.

Two users: TPU topology compiles (a compile-only TPU executable is written to the cache but
cannot be read back: the next compile of the same program warns "Error reading persistent
compilation cache entry ... PjRtCompiler must be constructed with a Client to call
DeserializeLoadedExecutable" and compiles again), and launch.bench, which times real
compiles, not cache reads.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def disabled():
    """Within the block, compiles neither read nor write the persistent cache."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()
