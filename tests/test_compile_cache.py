"""twinshard.train.compile_cache.disabled(): compiles inside it neither read nor write the persistent
compilation cache, even after the process compiled with the cache on, where JAX 0.12 ignores
the plain `jax_enable_compilation_cache` flag (it memoizes its first reading: shown here)."""

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from twinshard.train import compile_cache


@pytest.fixture
def private_cache(tmp_path):
    """A cache dir of this test's own (every entry written, however fast its compile)."""
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    yield lambda: len(list(tmp_path.iterdir()))
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    compilation_cache.reset_cache()


def compile_new_program(c: float) -> None:
    jax.jit(lambda x: x * c + 0.25).lower(1.0).compile()  # c: a constant of its own, so a key of its own


def test_disabled_writes_nothing_where_the_flag_alone_still_writes(private_cache):
    compile_new_program(1.5)
    assert private_cache() == 1  # the cache is in use
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        compile_new_program(2.5)
        assert private_cache() == 2  # the flag, set after a compile, is ignored (JAX 0.12, measured)
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    with compile_cache.disabled():
        compile_new_program(3.5)
        assert not jax.config.jax_enable_compilation_cache
    assert private_cache() == 2 and jax.config.jax_enable_compilation_cache
    compile_new_program(4.5)
    assert private_cache() == 3  # on again after the block
