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
    """'data:4,tensor:2' -> {'data': 4, 'tensor': 2}."""
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, size = part.partition(":")
        if name not in AXES or not size.isdigit() or int(size) < 1 or name in shape:
            raise ValueError(f"bad mesh {spec!r} at {part!r}: write it as data:N,tensor:M with "
                             "each axis once and N, M >= 1 (e.g. data:4,tensor:2).")
        shape[name] = int(size)
    missing = [a for a in AXES if a not in shape]
    if missing:
        raise ValueError(f"mesh {spec!r} lacks axis {missing[0]!r}; name both axes, e.g. "
                         f"{','.join(f'{a}:{shape.get(a, 1)}' for a in AXES)}.")
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


def check_mesh(strategy: str, shape: Mapping[str, int], n_devices: int) -> None:
    check_strategy(strategy)
    for axis, needs_many in zip(AXES, _NEEDS[strategy]):
        if needs_many and shape[axis] < 2 or not needs_many and shape[axis] != 1:
            want = "> 1" if needs_many else "= 1"
            raise ValueError(f"strategy {strategy} needs {axis} {want}, got mesh {_mesh_str(shape)}; "
                             f"try --mesh={_mesh_str(default_mesh(strategy, n_devices))}.")
    if math.prod(shape.values()) != n_devices:
        raise ValueError(f"mesh {_mesh_str(shape)} has {math.prod(shape.values())} devices but "
                         f"{n_devices} are available; try --mesh={_mesh_str(default_mesh(strategy, n_devices))}.")


def check_divisible(dims: Mapping[str, int], rules: Mapping[str, str], shape: Mapping[str, int]) -> None:
    """Every logical dimension split by `rules` must divide by its mesh axis size.

    dims: logical name -> size (e.g. {'heads': 4, 'mlp': 192, 'batch': 8, ...}).
    """
    for name, size in dims.items():
        axis = rules.get(name)
        if axis is None or size % shape[axis] == 0:
            continue
        ok = [k for k in range(1, size + 1) if size % k == 0 and k > 1][:6]
        raise ValueError(f"{name}={size} is not divisible by mesh axis {axis}={shape[axis]}; "
                         f"use a {axis} size in {ok} or change {name}.")


def make_mesh(shape: Mapping[str, int], axis_type: AxisType = AxisType.Auto,
              devices: list | None = None) -> Mesh:
    """A ('data', 'tensor') mesh. jax.make_mesh orders devices for the physical topology
    (on TPU, tensor neighbours share the fast links); on CPU the order is row-major, so
    partition id = data_index * tensor_size + tensor_index."""
    sizes = tuple(shape[a] for a in AXES)
    if devices is None:
        return jax.make_mesh(sizes, AXES, axis_types=(axis_type,) * len(AXES))
    return Mesh(np.asarray(devices).reshape(sizes), AXES, axis_types=(axis_type,) * len(AXES))
