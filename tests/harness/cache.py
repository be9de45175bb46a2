"""The persistent compilation cache of every test process: `.cache/jax/<source key>`.

JAX keys a cached executable by its program WITHOUT the source locations in its metadata (the
default, JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY unset), so the same step compiled from
two places (a test module's training loop, then its ledger's `.lower().compile()`, or another
module) is one compile. The executable then carries the source locations of its first compile;
the ledger tests read them ("ep.py:45"), so the directory is keyed by the library's sources:
any change to them starts a new cache, and no executable outlives the file layout it points into
(measured before this key: "twinshard/loss.py:53" read back after the move to
twinshard/model/loss.py). Measured, tests/test_experts.py alone on a cold cache: 124 s with
the locations in the key, 93 s without.

The key covers the packages whose code runs inside the traced programs, the ones a ledger's
source locations point into (the model, the training step, placement and the three twins): an
edit to the cost model, the planner, the HLO reader or a launcher keeps the cache.

TWINSHARD_TEST_CACHE names the directory instead (tools/mutate.py: a mutant's tree shares the
developer's cache, and keeps the locations in the key).
"""

import hashlib
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
SOURCES = ("twinshard/model", "twinshard/train", "twinshard/parallel", "auto_parallel", "manual_parallel",
           "explicit_parallel")


def source_key(root: pathlib.Path = ROOT) -> str:
    """16 hex digits of the sha256 of every .py file of SOURCES under `root` (names and bytes)."""
    h = hashlib.sha256()
    for path in sorted(p for package in SOURCES for p in (root / package).rglob("*.py") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def directory() -> pathlib.Path:
    """TWINSHARD_TEST_CACHE, or .cache/jax/<source_key()> of this checkout."""
    named = os.environ.get("TWINSHARD_TEST_CACHE")
    return pathlib.Path(named) if named else ROOT / ".cache" / "jax" / source_key()


STALE_DAYS = 3  # a cache of other sources untouched this long is deleted (another branch's, or an old edit's)


def prune(keep: pathlib.Path, stale_days: float = STALE_DAYS) -> None:
    """Delete the entries of .cache/jax other than `keep` that nothing has written for `stale_days`:
    the caches of earlier sources. A recent one stays: another checkout state may come back (a
    branch switch), and a run still going (tools/mutate.py's) may be writing it."""
    import shutil
    import time

    parent = ROOT / ".cache" / "jax"
    if keep.parent != parent or not parent.is_dir():
        return  # a directory named by TWINSHARD_TEST_CACHE: not ours to prune
    cutoff = time.time() - stale_days * 86400
    for entry in parent.iterdir():
        try:
            fresh = entry == keep or entry.lstat().st_mtime > cutoff
        except FileNotFoundError:
            continue
        if not fresh:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
