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

AXES = ("data", "tensor")
STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")

# Which axes must be > 1 (True), == 1 (False) per strategy (the seed's rules).
_NEEDS = {"dp": (True, False), "fsdp": (True, False), "tp": (False, True), "fsdp_tp": (True, True)}


def check_strategy(strategy: str) -> None:
    if strategy not in _NEEDS:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")


def parse_mesh(spec: str) -> dict[str, int]:
    """'data:4,tensor:2' -> {'data': 4, 'tensor': 2} (either order, spaces allowed)."""
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


def default_mesh(strategy: str, n_devices: int) -> dict[str, int]:
    """All devices on the strategy's axis; fsdp_tp puts 2 (or the smallest factor) on tensor."""
    check_strategy(strategy)
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


def check_mesh(strategy: str, shape: Mapping[str, int], n_devices: int) -> None:
    """Both axes present with sizes >= 1, each sized as the strategy needs, using every device."""
    check_strategy(strategy)
    unknown, missing = [a for a in shape if a not in AXES], [a for a in AXES if a not in shape]
    if unknown or missing:
        what = f"has axis {unknown[0]!r}, not one of {', '.join(AXES)}" if unknown else f"lacks axis {missing[0]!r}"
        raise ValueError(f"mesh {dict(shape)} {what}; name both axes (size 1 allowed): "
                         f"{_fix(strategy, n_devices)}.")
    for axis in AXES:
        if not isinstance(shape[axis], (int, np.integer)) or shape[axis] < 1:
            raise ValueError(f"mesh axis {axis}={shape[axis]!r} must be an integer >= 1; "
                             f"{_fix(strategy, n_devices)}.")
    for axis, needs_many in zip(AXES, _NEEDS[strategy]):
        if needs_many and shape[axis] < 2 or not needs_many and shape[axis] != 1:
            want = "> 1" if needs_many else "= 1"
            raise ValueError(f"strategy {strategy} needs {axis} {want}, got mesh {_mesh_str(shape)}; "
                             f"{_fix(strategy, n_devices)}.")
    if math.prod(shape.values()) != n_devices:
        raise ValueError(f"mesh {_mesh_str(shape)} has {math.prod(shape.values())} devices but "
                         f"{n_devices} are available; {_fix(strategy, n_devices)}.")


# What to change in the config for each splittable logical dimension.
_FIELDS = {"batch": "batch_size", "embed": "d_model", "heads": "num_heads", "mlp": "d_ff"}


def check_divisible(dims: Mapping[str, int], rules: Mapping[str, str], shape: Mapping[str, int]) -> None:
    """Every logical dimension split by `rules` must divide by its mesh axis size.

    dims: logical name -> size (e.g. {'heads': 4, 'mlp': 192, 'batch': 8, ...}).
    """
    for name, size in dims.items():
        axis = rules.get(name)
        if axis is None or size % shape[axis] == 0:
            continue
        n, devices = shape[axis], math.prod(shape.values())
        ok = [k for k in range(2, size + 1) if size % k == 0 and devices % k == 0][:6]  # fit the devices too
        change = (f"pick a vocab_size whose padded size (a multiple of 128) is a multiple of {n}"
                  if name == "vocab" else f"make {name} ({_FIELDS.get(name, name)}) a multiple of {n}")
        raise ValueError(f"{name}={size} is not divisible by mesh axis {axis}={n}; "
                         + (f"use a {axis} size in {ok} or " if ok else "") + f"{change}.")


def make_mesh(shape: Mapping[str, int], axis_type: AxisType = AxisType.Auto,
              devices: list | None = None) -> Mesh:
    """A ('data', 'tensor') mesh. jax.make_mesh orders devices for the physical topology
    (on TPU, tensor neighbours share the fast links); on CPU the order is row-major, so
    partition id = data_index * tensor_size + tensor_index."""
    sizes = tuple(shape[a] for a in AXES)
    if devices is None:
        return jax.make_mesh(sizes, AXES, axis_types=(axis_type,) * len(AXES))
    return Mesh(np.asarray(devices).reshape(sizes), AXES, axis_types=(axis_type,) * len(AXES))
