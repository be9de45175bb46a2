"""Test configuration: 8 simulated CPU devices, set before jax starts.

XLA reads XLA_FLAGS once, when the backend first initialises, so this module
must run before any test module imports jax (pytest imports conftest first).
`--xla_backend_optimization_level=0` halves compile time and leaves the
collectives in the HLO unchanged (measured; see ../shared/DESIGN.md).
"""

import os
import pathlib

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402  (must come after XLA_FLAGS)

_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "jax"
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionstart(session):
    n = jax.device_count()
    if n != 8:
        raise RuntimeError(
            f"tests need 8 simulated CPU devices, found {n}: jax was imported before "
            "tests/conftest.py set XLA_FLAGS (run tests with `uv run pytest`)."
        )
