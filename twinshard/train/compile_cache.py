"""JAX's persistent compilation cache, switched off for a block of code.

Measured (JAX 0.12): `jax_enable_compilation_cache` is read only by a process's FIRST compile and
then memoized; `reset_cache()` drops that memo (tests/test_compile_cache.py). Users: TPU topology
compiles (whose cache entries cannot be read back) and launch.bench, which times real compiles.
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
