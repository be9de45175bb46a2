"""absl launchers (`python -m launch.train`, `launch.bench`, ...).

glibc malloc tunables. XLA:CPU allocates each step's temporaries afresh; with glibc's
defaults every buffer over 128 KiB is a new mmap that is zero-filled page by page on first
touch and unmapped again at free: millions of minor page faults a run, and a
quarter of the small preset's CPU step time (measured, JAX 0.12). So a launcher started as `python -m launch.<name>` on Linux re-executes itself
once, before anything else is imported, with GLIBC_TUNABLES set: buffers up to 32 MiB come
from malloc's heap and are reused, the heap is never trimmed, and what is mapped is
madvise'd for transparent huge pages. Setting GLIBC_TUNABLES yourself (even to the empty
string) turns this off; the tests export the same value (tests/conftest.py).
"""

import os
import sys

MALLOC_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:"
                   "glibc.malloc.trim_threshold=17179869184")


def reexec_with_malloc_tunables() -> None:
    """Re-exec this process's command line with MALLOC_TUNABLES (glibc reads them only at
    start), unless GLIBC_TUNABLES is already set or this is not Linux."""
    if "GLIBC_TUNABLES" in os.environ or not sys.platform.startswith("linux"):
        return
    os.environ["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


# While `python -m launch.X` imports this package to find the module, sys.argv[0] is still
# '-m'; an import from anywhere else (tests, a notebook, tools/) is left alone.
if sys.argv[:1] == ["-m"]:
    reexec_with_malloc_tunables()
