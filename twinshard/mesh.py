"""Meshes for the four base strategies: parsing, defaults and validation.

Both twins build their mesh here, so an invalid (strategy, mesh, model, batch)
combination fails the same way, with a `ValueError` that names the value and a
valid alternative, before anything is compiled.

Mesh syntax: `data:4,tensor:2` (both axes always present; size 1 allowed).
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "tensor")  # the base strategies' axes (both always present in their meshes)
# Mesh order of every axis any strategy uses; a mesh holds the axes its strategy names
# (pipeline parallelism adds `stage` in front: twinshard/pipeline.py).
ORDER = ("stage", "data", "tensor")
STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")

# Which axes must be > 1 (True), == 1 (False) per strategy (the seed's rules).
_NEEDS = {"dp": (True, False), "fsdp": (True, False), "tp": (False, True), "fsdp_tp": (True, True)}


def check_strategy(strategy: str) -> None:
    if strategy not in _NEEDS:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")


def parse_mesh(spec: str) -> dict[str, int]:
    """'data:4,tensor:2' -> {'data': 4, 'tensor': 2} (either order, spaces allowed)."""
    if not isinstance(spec, str):
        raise ValueError(f"mesh spec must be a string such as 'data:4,tensor:2', got {spec!r}.")
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, colon, size = (x.strip() for x in part.partition(":"))
        if name not in AXES:
            why = f"unknown axis {name!r} (the axes are {', '.join(AXES)})"
        elif name in shape:
            why = f"axis {name!r} appears twice"
        elif not colon or not size.isdigit() or int(size) < 1:
            why = f"size {size!r} of axis {name!r} is not an integer >= 1"
        else:
            shape[name] = int(size)
            continue
        raise ValueError(f"bad mesh {spec!r} at {part!r}: {why}; write it as data:N,tensor:M with "
                         "each axis once and N, M >= 1 (e.g. data:4,tensor:2).")
    missing = [a for a in AXES if a not in shape]
    if missing:
        example = ",".join(f"{a}:{shape.get(a, 1)}" for a in AXES) if shape else "data:4,tensor:2"
        raise ValueError(f"mesh {spec!r} lacks axis {missing[0]!r}; name both axes (size 1 allowed), "
                         f"e.g. {example}.")
    return shape


def _check_device_count(n_devices: int) -> None:
    if isinstance(n_devices, bool) or not isinstance(n_devices, (int, np.integer)) or n_devices < 1:
        raise ValueError(f"device count {n_devices!r} must be an integer >= 1.")


def default_mesh(strategy: str, n_devices: int) -> dict[str, int]:
    """All devices on the strategy's axis; fsdp_tp puts 2 (or the smallest factor) on tensor."""
    check_strategy(strategy)
    _check_device_count(n_devices)
    if strategy in ("dp", "fsdp"):
        return {"data": n_devices, "tensor": 1}
    if strategy == "tp":
        return {"data": 1, "tensor": n_devices}
    tensor = next((k for k in range(2, n_devices) if n_devices % k == 0), n_devices)
    return {"data": n_devices // tensor, "tensor": tensor}


def _mesh_str(shape: Mapping[str, int]) -> str:
    return ",".join(f"{a}:{shape[a]}" for a in AXES)


def _fits(strategy: str, shape: Mapping[str, int]) -> bool:
    """Does `shape` give each axis of the strategy the size it needs (> 1 or == 1)?"""
    return all((shape[a] > 1) if many else (shape[a] == 1) for a, many in zip(AXES, _NEEDS[strategy]))


def _fix(strategy: str, n_devices: int) -> str:
    """A valid alternative: the default mesh, or (if there is none on n devices) what is needed."""
    default = default_mesh(strategy, n_devices)
    if _fits(strategy, default):
        return f"try --mesh={_mesh_str(default)}"
    fits = [s for s in STRATEGIES if _fits(s, default_mesh(s, n_devices))]
    need = "a device count with a factor pair data, tensor > 1 (4, 6, 8, ...)" if strategy == "fsdp_tp" \
        else "at least 2 devices"
    return (f"strategy {strategy} needs {need}, have {n_devices}; run on more devices or use "
            + (f"strategy {' or '.join(fits)}" if fits else "the single-device runner"))


def _mesh_problem(strategy: str, shape: Mapping[str, int], n_devices: int) -> str | None:
    """What is wrong with `shape` for `strategy` on `n_devices` (None: nothing), without a fix."""
    if not isinstance(shape, Mapping):
        return f"mesh {shape!r} is not a mapping of axis name to size such as {{'data': 4, 'tensor': 2}}"
    unknown, missing = [a for a in shape if a not in AXES], [a for a in AXES if a not in shape]
    if unknown or missing:
        what = f"has axis {unknown[0]!r}, not one of {', '.join(AXES)}" if unknown else f"lacks axis {missing[0]!r}"
        return f"mesh {dict(shape)} {what}; name both axes (size 1 allowed)"
    for axis in AXES:
        size = shape[axis]
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            return f"mesh axis {axis}={size!r} must be an integer >= 1"
    for axis, needs_many in zip(AXES, _NEEDS[strategy]):
        if needs_many and shape[axis] < 2 or not needs_many and shape[axis] != 1:
            want = "> 1" if needs_many else "= 1"
            return f"strategy {strategy} needs {axis} {want}, got mesh {_mesh_str(shape)}"
    if math.prod(shape.values()) != n_devices:
        return f"mesh {_mesh_str(shape)} has {math.prod(shape.values())} devices but {n_devices} are available"
    return None


def check_mesh(strategy: str, shape: Mapping[str, int], n_devices: int) -> None:
    """Both axes present with sizes >= 1, each sized as the strategy needs, using every device.

    Knows nothing of the model: `resolve` also checks divisibility and advises a mesh that fits both."""
    check_strategy(strategy)
    _check_device_count(n_devices)
    problem = _mesh_problem(strategy, shape, n_devices)
    if problem is None:
        return
    fix = _fix(strategy, n_devices)
    if problem.endswith("are available"):
        k = math.prod(shape.values())
        fix += f" to use all {n_devices}, or run this mesh on {k} devices (--devices={k})"
    raise ValueError(f"{problem}; {fix}.")


# What to change in the config for each splittable logical dimension.
_FIELDS = {"batch": "--batch_size", "embed": "d_model", "heads": "num_heads", "mlp": "d_ff"}


def _divisibility_problem(dims: Mapping[str, int], rules: Mapping[str, str],
                          shape: Mapping[str, int]) -> tuple[str, str] | None:
    """(what does not divide, the config change that fixes it), or None."""
    for name, size in dims.items():
        axis = rules.get(name)
        if axis is None or size % shape[axis] == 0:
            continue
        n = shape[axis]
        change = (f"pick a vocab_size whose padded size (a multiple of 128) is a multiple of {n}"
                  if name == "vocab" else f"make {name} ({_FIELDS.get(name, name)}) a multiple of {n}")
        return f"{name}={size} is not divisible by mesh axis {axis}={n}", change
    return None


def fitting_mesh(needs: tuple[bool, ...], dims: Mapping[str, int], rules: Mapping[str, str],
                 n_devices: int, prefer: Mapping[str, int] | None = None) -> dict[str, int] | None:
    """A mesh on exactly n_devices whose axes are sized as `needs` says (> 1 / == 1, per AXES)
    and that splits every dimension evenly; `prefer` first if it fits, then most data."""
    candidates = [{"data": n_devices // t, "tensor": t} for t in range(1, n_devices + 1) if n_devices % t == 0]
    if prefer is not None:
        candidates.insert(0, dict(prefer))
    for shape in candidates:
        sized = all((shape[a] > 1) if many else (shape[a] == 1) for a, many in zip(AXES, needs))
        if sized and _divisibility_problem(dims, rules, shape) is None:
            return shape
    return None


def advice(needs: tuple[bool, ...], dims: Mapping[str, int], rules: Mapping[str, str], n_devices: int,
           prefer: Mapping[str, int] | None = None) -> str:
    """One step that works: a mesh on these devices, else the most devices that have one."""
    shape = fitting_mesh(needs, dims, rules, n_devices, prefer)
    if shape is not None:
        return f"try --mesh={_mesh_str(shape)}"
    for k in range(n_devices - 1, 1, -1):
        shape = fitting_mesh(needs, dims, rules, k)
        if shape is not None:
            return (f"no mesh on {n_devices} devices splits this model for this strategy; run on {k}: "
                    f"--devices={k} --mesh={_mesh_str(shape)}")
    return f"no mesh on {n_devices} or fewer devices splits this model for this strategy"


def check_divisible(dims: Mapping[str, int], rules: Mapping[str, str], shape: Mapping[str, int]) -> None:
    """Every logical dimension split by `rules` must divide by its mesh axis size.

    dims: logical name -> size (e.g. {'heads': 4, 'mlp': 192, 'batch': 8, ...}).
    The advice keeps the device count (prod(shape)) and the axes the rules use (> 1; the
    others = 1, as each strategy's mesh needs), or names a device count that works.
    """
    problem = _divisibility_problem(dims, rules, shape)
    if problem is None:
        return
    needs = tuple(a in rules.values() for a in AXES)
    fix = advice(needs, dims, rules, math.prod(shape.values()))
    raise ValueError(f"{problem[0]}; {fix}, or {problem[1]}.")


def resolve(strategy: str, spec: str | None, dims: Mapping[str, int], rules: Mapping[str, str],
            n_devices: int) -> dict[str, int]:
    """Parse (or default) the mesh and check it against the strategy, the devices and the model;
    an error advises one mesh (or device count) that passes all three checks."""
    check_strategy(strategy)
    _check_device_count(n_devices)
    shape = parse_mesh(spec) if spec is not None else default_mesh(strategy, n_devices)
    problem = _mesh_problem(strategy, shape, n_devices)
    if problem is None and (split := _divisibility_problem(dims, rules, shape)) is not None:
        problem = f"{split[0]} (or {split[1]})"
    if problem is not None:
        raise ValueError(f"{problem}; {advice(_NEEDS[strategy], dims, rules, n_devices, default_mesh(strategy, n_devices))}.")
    return shape


def make_mesh(shape: Mapping[str, int], axis_type: AxisType = AxisType.Auto,
              devices: list | None = None) -> Mesh:
    """A mesh of the axes in `shape`, in ORDER (('data', 'tensor'); ('stage', 'data', 'tensor')
    for pipelines). jax.make_mesh orders devices for the physical topology
    (on TPU, tensor neighbours share the fast links); on CPU the order is row-major, so
    partition id = data_index * tensor_size + tensor_index."""
    names = tuple(a for a in ORDER if a in shape)
    sizes = tuple(shape[a] for a in names)
    if devices is None:
        return jax.make_mesh(sizes, names, axis_types=(axis_type,) * len(names))
    return Mesh(np.asarray(devices).reshape(sizes), names, axis_types=(axis_type,) * len(names))
