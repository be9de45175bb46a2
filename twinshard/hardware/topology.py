"""TPU pods without TPUs: compile for a TPU topology on this CPU machine (AOT only).

With the `tpu` extra installed (`jax[tpu]==0.12.0.1`, libtpu 0.0.50.1),
`devices("v5e:4x4")` returns the 16 devices of a 4-host v5e pod that is not
here. A runner built on them (`make_runner(strategy, mesh, cfg,
devices=mesh_devices(shape, devs))`) lowers and compiles its train step for
that pod: `train_step.lower(runner.abstract_state(), x, x).compile()` is real
TPU HLO (`twinshard.hlo.ledger`) and `memory_analysis()` is per chip. Nothing
runs and nothing touches the network; CPU jax keeps working beside it
(JAX_PLATFORMS=cpu is fine: the topology does not need a TPU backend).

    >>> devs = devices("v5e:4x4")                        # doctest: +SKIP
    >>> runner = make_runner("fsdp", "data:16,tensor:1", cfg, devices=mesh_devices(
    ...     {"data": 16, "tensor": 1}, devs))            # doctest: +SKIP

How the TPU compiler prints the manual twin differs from the cost model in two
ways (measured, libtpu 0.0.50.1; `tpu_expected` turns the model into what TPU prints,
tests/test_tpu_topology.py holds the two equal):

1. FSDP all-gathers of weights that a matmul reads are done in bf16: TPU's
   default matmul precision reads f32 operands as bf16, so XLA converts before
   the gather and moves half the bytes. The embedding table is read by a
   lookup, not a matmul, and is gathered in f32. Counts are unchanged.
2. Some reduce-scatters are compiled as an all-reduce of the full gradient
   followed by a local slice: all of the FSDP gradient reduce-scatters when the
   group spans the whole grid (data=16 on v5e:4x4), and on data=4 x tensor=4
   those of output_proj and of the embedding, whose scattered dimension (d_model)
   is the minor one of the TPU layout. Such an all-reduce
   carries |data| x the bytes of the reduce-scatter it replaces and no source
   line (it is combined into one tuple all-reduce with the norm-gain pmeans).

Per-chip memory: `argument_bytes` splits `memory_analysis().argument_size_in_bytes`
into params / optimizer moments / the rest (step counters, the local batch),
each as the unpadded shard bytes (what `twinshard.cost.memory` models) and as
TPU stores it: every array padded to its layout tile (f32 [16,16] with tile
(8,128) takes [16,128]), which is exactly how XLA counts argument bytes.
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
    """Default chips per host for a topology: 2x2x1, each bound lowered to 1 where it does not
    divide the grid (so v5e:1x1 is one host and v5e:4x4 is 4 hosts of 2x2)."""
    grid = _grid(name) + (1,) * (3 - len(_grid(name)))
    x, y, z = (b if g % b == 0 else 1 for b, g in zip(DEFAULT_CHIPS_PER_HOST, grid))
    return x, y, z


def devices(name: str, chips_per_host_bounds: Sequence[int] | None = None,
            num_slices: int = 1) -> list:
    """The devices of TPU topology `name` (e.g. 'v5e:4x4': 16 chips on 4 hosts), for AOT.

    Needs libtpu (the `tpu` extra); raises ValueError naming the fix when it is
    missing or when the name / host bounds do not describe a topology.
    """
    grid = _grid(name)
    if not libtpu_installed():
        raise ValueError(f"--topology={name}: {LIBTPU_MISSING}")
    from jax.experimental import topologies

    bounds = tuple(chips_per_host_bounds) if chips_per_host_bounds else chips_per_host(name)
    chip_config = "megacore" if name.startswith(_MEGACORE) else "default"
    if not tpu_chips_here():
        # libtpu takes /tmp/libtpu_lockfile when it loads, so a second process (the CLI beside a
        # test run) fails with "ABORTED: Internal error when accessing libtpu multi-process
        # lockfile" (measured). The lock guards TPU chips; with none here, do not take it.
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
    """Drop what libtpu writes to stderr (fd 2) while it loads on a machine without TPU chips:
    'Failed to find host bounds...' and 'E0000 ... unexpected worker hostname ...
    TPU_WORKER_HOSTNAMES' (it looks for the TPU VM metadata of this host, which compiling for
    a topology does not use; measured, libtpu 0.0.50.1). Errors still raise. On a machine with
    TPU chips nothing is dropped."""
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


def compile_for_pod(lowered):
    """`lowered.compile()` for a topology's devices, with JAX's persistent compilation cache off:
    JAX 0.12 writes a compile-only TPU executable to the cache and cannot read it back (no TPU
    client to load it into; twinshard/train/compile_cache.py), so the entry is dead weight on disk
    and a warning plus a recompile in every later run."""
    from twinshard.train import compile_cache

    with compile_cache.disabled():
        return lowered.compile()


def mesh_devices(shape: Mapping[str, int], devs: Sequence[Any]) -> list:
    """`devs` ordered for a ('data', 'tensor') mesh of `shape` by `mesh_utils` (neighbours on
    the fast ICI links), flattened row-major: pass it as `make_runner(..., devices=...)`.
    An axis that is no product of physical axes (tensor:8 on a 4x4 grid) splits one."""
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
    """Bytes of one array as the device stores it: the minor dims (in `layout.major_to_minor`
    order) rounded up to the first tile of `layout.tiling` (TPU: f32 (8,128), scalars (128,)).
    A layout without tiling (CPU) gives the plain size."""
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
    """Per-chip argument bytes of a compiled train step `step(state, *batch)`, by part.

    {'params' | 'optimizer' | 'counters' | 'batch' | 'total': {'bytes': unpadded shard
    bytes, 'padded': as stored (tile-padded)}}: 'optimizer' = the AdamW moments (mu, nu),
    'counters' = the rest of the state (step, Adam count, skipped), 'batch' = the local
    tokens. Inputs XLA pruned (unused, e.g. the previous grad norm) take no memory and
    are left out. total/padded equals `compiled.memory_analysis().argument_size_in_bytes`
    (measured on TPU and CPU).
    """
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
    """`model.summary()` (twinshard.cost) as the TPU compiler prints the manual twin.

    1. all-gather over data: the model's elements, each gather in bf16 or f32 as TPU chose
       (the default matmul precision reads f32 as bf16, so XLA may convert before the gather;
       the embedding table is always f32). Which weights TPU gathers in bf16 depends on
       the layer loop (measured, libtpu 0.0.50.1), so the bytes are the ledger's own
       when, and only when, its gathers carry exactly the model's elements.
    2. where the model has reduce-scatters over data, each all-reduce over data of a matrix
       gradient in `ledger` is one of them compiled as all-reduce + slice: the reduce-scatter
       row loses it (bytes / |data|), the all-reduce row gains it (full bytes). The manual
       twin's only other data all-reduces are of norm gains (their leaves: [D] for ln_final,
       [n, D] for each stack's ln1/ln2, ModelConfig.stacks) and scalars.
    Measured on v5e (libtpu 0.0.50.1); other generations may differ.
    """
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
    """Is a TPU chip attached to this machine? JAX's own test (PCI ids, `jax._src.hardware_utils`),
    falling back to the device files TPU VMs have (/dev/accel*, /dev/vfio/N)."""
    try:
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except (ImportError, AttributeError, OSError):  # private API moved: look for the device files
        return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def gpu_here() -> bool:
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd"))


def default_to_cpu() -> bool:
    """With libtpu installed (the tpu extra) on a machine without TPU chips, JAX's platform probe
    (JAX_PLATFORMS unset) loads libtpu, which prints errors ('Failed to find host bounds',
    'E0000 ... TPU_WORKER_HOSTNAMES') and holds /tmp/libtpu_lockfile for the life of the
    process, before JAX falls back to CPU (measured: ~0.1 s, same results). Skip the probe: set
    jax_platforms=cpu unless JAX_PLATFORMS is set, a TPU chip or a GPU is here, or libtpu is
    absent. Call before JAX's backend starts (before the first jax.devices() or computation;
    importing jax is fine). Returns whether it set it."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_FORCE_TPU_INIT") or not libtpu_installed():
        return False
    if tpu_chips_here() or gpu_here():
        return False
    import jax

    jax.config.update("jax_platforms", "cpu")
    return True
