"""TPU pods without TPUs: compile for a TPU topology on this CPU machine (AOT only).

With the `tpu` extra (libtpu 0.0.50.1), `devices("v5e:4x4")` returns the 16 devices of a pod
that is not here; a runner built on them compiles real TPU HLO and per-chip `memory_analysis()`
for it. Nothing runs, nothing touches the network, and CPU jax keeps working beside it.

    >>> devs = devices("v5e:4x4")                        # doctest: +SKIP
    >>> runner = make_runner("fsdp", "data:16,tensor:1", cfg, devices=mesh_devices(
    ...     {"data": 16, "tensor": 1}, devs))            # doctest: +SKIP

The TPU compiler prints the manual twin differently from the cost model (measured, libtpu
0.0.50.1; `tpu_expected` converts, tests/test_tpu_topology.py holds them equal): FSDP gathers of
matmul weights run in bf16 (TPU's default precision reads f32 as bf16), and some reduce-scatters
become an all-reduce of the full gradient + a slice (all of them when the group spans the whole
grid; on data=4 x tensor=4 those whose scattered dim, d_model, is the TPU layout's minor one).
`argument_bytes` splits argument memory into params / moments / the rest, unpadded and tile-padded.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Chips per host in TPU VM pods: 2x2 for v4/v5p/v5e/v6e multi-host slices.
DEFAULT_CHIPS_PER_HOST = (2, 2, 1)
# Chip configs per generation: v4 and v5p pair two TensorCores into one device (megacore).
_MEGACORE = ("v4", "v5p")

LIBTPU_MISSING = ("compiling for a TPU topology needs libtpu, which is not installed: install the "
                  "tpu extra (uv sync --extra tpu, or uv run --extra tpu ...), or compile for CPU "
                  "without a topology.")


def libtpu_installed() -> bool:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def _grid(name: str) -> tuple[int, ...]:
    """'v5e:4x4' -> (4, 4); 'v5p:2x2x2' -> (2, 2, 2)."""
    m = re.fullmatch(r"([a-z0-9]+)[:=](\d+(?:x\d+){1,2})", name.strip())
    if not m:
        raise ValueError(f"TPU topology {name!r} is not of the form GENERATION:AxB[xC] "
                         "(e.g. v5e:4x4, v5e:2x4, v5p:2x2x2, v6e:4x4).")
    return tuple(int(x) for x in m.group(2).split("x"))


def chips_per_host(name: str) -> tuple[int, int, int]:
    """Default chips per host: 2x2x1, each bound lowered to 1 where it does not divide the grid."""
    grid = _grid(name) + (1,) * (3 - len(_grid(name)))
    x, y, z = (b if g % b == 0 else 1 for b, g in zip(DEFAULT_CHIPS_PER_HOST, grid))
    return x, y, z


def devices(name: str, chips_per_host_bounds: Sequence[int] | None = None,
            num_slices: int = 1) -> list:
    """The devices of TPU topology `name` (e.g. 'v5e:4x4'), for AOT; needs libtpu (the `tpu` extra)."""
    grid = _grid(name)
    if not libtpu_installed():
        raise ValueError(f"--topology={name}: {LIBTPU_MISSING}")
    from jax.experimental import topologies

    bounds = tuple(chips_per_host_bounds) if chips_per_host_bounds else chips_per_host(name)
    chip_config = "megacore" if name.startswith(_MEGACORE) else "default"
    if not tpu_chips_here():
        # libtpu's /tmp/libtpu_lockfile makes a second process fail ("ABORTED: ... multi-process
        # lockfile", measured); it guards TPU chips, and there are none here
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        with _quiet_libtpu_load():
            topo = topologies.get_topology_desc(
                topology_name=name, platform="tpu", chip_config_name=chip_config,
                chips_per_host_bounds=bounds, num_slices=num_slices, wrap=(False,) * 3)
    except Exception as e:  # JaxRuntimeError: INVALID_ARGUMENT / NOT_FOUND / ABORTED from libtpu
        fix = ("another process holds libtpu's /tmp/libtpu_lockfile: set ALLOW_MULTIPLE_LIBTPU_LOAD=1 "
               "(no TPU chips here need the lock) or wait for it" if "lockfile" in str(e) else
               "Use a known generation (v4, v5e, v5p, v6e) and chips per host x,y,z that divide the "
               "grid (2,2,1 for multi-host pods; 1,1,1 always divides)")
        raise ValueError(f"TPU topology {name!r} (grid {'x'.join(map(str, grid))}, chips per host "
                         f"{'x'.join(map(str, bounds))}) was rejected by libtpu: {e}. {fix}.") from e
    return list(topo.devices)


@contextlib.contextmanager
def _quiet_libtpu_load():
    """Drop what libtpu writes to fd 2 while it loads without TPU chips ('Failed to find host bounds',
    'TPU_WORKER_HOSTNAMES'; measured, libtpu 0.0.50.1); errors still raise."""
    if tpu_chips_here():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def compile_for_pod(lowered, compiler_options: Mapping[str, Any] | None = None):
    """`lowered.compile(compiler_options)` with the persistent cache off: JAX 0.12 writes a compile-only
    TPU executable to the cache and cannot read it back (twinshard/train/compile_cache.py).
    compiler_options: XLA:TPU flags without their dashes ({'xla_tpu_enable_async_collective_fusion':
    'true'}); libtpu checks each name (an unknown one is an INVALID_ARGUMENT), where an unknown flag
    in LIBTPU_INIT_ARGS raised nothing in a compile ahead of time (measured, libtpu 0.0.50.1)."""
    from twinshard.train import compile_cache

    with compile_cache.disabled():
        return lowered.compile(dict(compiler_options) if compiler_options else None)


def mesh_devices(shape: Mapping[str, int], devs: Sequence[Any]) -> list:
    """`devs` ordered for a ('data', 'tensor') mesh of `shape` by `mesh_utils`, flattened row-major."""
    from jax.experimental import mesh_utils

    from twinshard.parallel import mesh as mesh_lib

    sizes = tuple(shape[a] for a in mesh_lib.ORDER if a in shape)
    if math.prod(sizes) != len(devs):
        raise ValueError(f"mesh {dict(shape)} has {math.prod(sizes)} devices but the topology has "
                         f"{len(devs)}; pick data x tensor = {len(devs)}.")
    try:
        grid = mesh_utils.create_device_mesh(sizes, list(devs))
    except NotImplementedError:  # "Failed to find assignment for logical_axis_index ..."
        grid = mesh_utils.create_device_mesh(sizes, list(devs), allow_split_physical_axes=True)
    return list(grid.ravel())


# ----------------------------------------------------------------------------- memory


def padded_bytes(shape: Sequence[int], dtype: Any, layout: Any) -> int:
    """Bytes of one array as the device stores it: minor dims rounded up to the layout's tile (TPU f32 (8,128))."""
    itemsize = np.dtype(dtype).itemsize
    if layout is None or not getattr(layout, "tiling", None):
        return math.prod(shape) * itemsize
    phys = [shape[i] for i in layout.major_to_minor] if len(shape) else []
    tile = tuple(layout.tiling[0])
    phys = [1] * max(0, len(tile) - len(phys)) + phys
    k = len(tile)
    phys = phys[:len(phys) - k] + [-(-a // b) * b for a, b in zip(phys[len(phys) - k:], tile)]
    return math.prod(phys) * itemsize


def argument_bytes(compiled: Any, state: Any, *batch: Any) -> dict[str, dict[str, int]]:
    """Per-chip argument bytes of a compiled `step(state, *batch)`: {'params' | 'optimizer' |
    'counters' | 'batch' | 'total': {'bytes', 'padded'}}; inputs XLA pruned are left out, and
    total/padded equals memory_analysis().argument_size_in_bytes (measured on TPU and CPU)."""
    import jax

    formats = jax.tree.leaves(compiled.input_formats)
    args = jax.tree.leaves((state, *batch))
    if len(formats) != len(args):
        raise ValueError(f"compiled step takes {len(formats)} arrays, got {len(args)}")
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
            if hasattr(s, "mu")]
    moments = {id(x) for s in adam for x in jax.tree.leaves((s.mu, s.nu))}
    params = {id(x) for x in jax.tree.leaves(state.params)}
    n_state = len(jax.tree.leaves(state))
    out = {k: {"bytes": 0, "padded": 0} for k in ("params", "optimizer", "counters", "batch", "total")}
    for i, (a, f) in enumerate(zip(args, formats)):
        if f.layout is None:  # pruned by XLA
            continue
        shard = a.sharding.shard_shape(a.shape)
        part = ("batch" if i >= n_state else "params" if id(a) in params
                else "optimizer" if id(a) in moments else "counters")
        for key in (part, "total"):
            out[key]["bytes"] += math.prod(shard) * np.dtype(a.dtype).itemsize
            out[key]["padded"] += padded_bytes(shard, a.dtype, f.layout)
    return out


# ----------------------------------------------------------------------------- TPU view of the model

TPU_NOTES = (
    ("TPU gathers the weights a matmul reads in bf16 where XLA converts them before the all-gather "
     "(the default matmul precision reads f32 as bf16): half the model's bytes for those gathers; "
     "the embedding table, which a lookup reads, moves in f32. With the scanned layer stack it kept "
     "most [D, D] attention weights in f32 and gathered the MLP weights and lm_head in bf16."),
    ("TPU compiles some reduce-scatters as an all-reduce of the full gradient + a local slice "
     "(measured on v5e:4x4: all of them on data:16; on data:4,tensor:4 those of output_proj and "
     "the embedding): each all-reduce over data of a matrix in the ledger is one of them and "
     "moves |data| x the bytes of the reduce-scatter it replaces."),
)


def tpu_expected(cfg: Any, model: Any, ledger: Any) -> dict[tuple[str, tuple[str, ...]], dict[str, float]]:
    """`model.summary()` (twinshard.cost) as the TPU compiler prints the manual twin (module
    docstring): gathers over data in the ledger's bf16/f32 bytes when they carry exactly the model's
    elements; each data all-reduce of a matrix gradient moved from the reduce-scatter row to the
    all-reduce row. Measured on v5e (libtpu 0.0.50.1)."""
    from twinshard import cost
    from twinshard.hlo import ring_bytes

    d, s = model.mesh["data"], model.dtype_bytes
    exp = {k: dict(v) for k, v in model.summary().items()}
    ag = exp.get(("all-gather", ("data",)))
    if ag:
        gathers = list(ledger.filter(op="all-gather", axes=("data",)))
        elements = sum(r.bytes // _DTYPE_BYTES[r.dtype] * r.multiplicity for r in gathers)
        if elements * s == ag["bytes"]:
            ag["bytes"] = sum(r.bytes * r.multiplicity for r in gathers)
    rs = exp.get(("reduce-scatter", ("data",)))
    if rs:
        norms = {w.leaf_shape for w in cost.weights(cfg) if not w.is_matrix}
        dec = [r for r in ledger.filter(op="all-reduce", axes=("data",))
               if len(r.shape) >= 2 and tuple(r.shape) not in norms]
        k, b = sum(r.multiplicity for r in dec), sum(r.bytes * r.multiplicity for r in dec)
        rs["count"] -= k
        rs["bytes"] -= b // d
        ar = exp.setdefault(("all-reduce", ("data",)), {"count": 0, "bytes": 0, "ring_bytes": 0.0})
        ar["count"] += k
        ar["bytes"] += b
        if rs["count"] == 0 and rs["bytes"] == 0:
            del exp[("reduce-scatter", ("data",))]
    for (op, axes), v in exp.items():
        v["ring_bytes"] = ring_bytes(op, v["bytes"], math.prod(model.mesh[a] for a in axes))
    return exp


_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1}


# ----------------------------------------------------------------------------- CPU default


def tpu_chips_here() -> bool:
    """Is a TPU chip attached? JAX's own PCI test, falling back to /dev/accel* and /dev/vfio/N."""
    try:
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except (ImportError, AttributeError, OSError):  # private API moved: look for the device files
        return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def gpu_here() -> bool:
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd"))


def default_to_cpu() -> bool:
    """Set jax_platforms=cpu unless JAX_PLATFORMS is set, a TPU chip or GPU is here, or libtpu is
    absent: libtpu's probe on a chipless machine prints errors and holds /tmp/libtpu_lockfile (measured).
    Call before JAX's backend starts; returns whether it set it."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_FORCE_TPU_INIT") or not libtpu_installed():
        return False
    if tpu_chips_here() or gpu_here():
        return False
    import jax

    jax.config.update("jax_platforms", "cpu")
    return True
