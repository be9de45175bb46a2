"""Replica groups, mesh axes and collective-permute patterns: who talks to whom.

`decode_replica_groups` turns any printed `replica_groups` into groups of partition ids,
`classify` names the mesh axes a group spans (and those it covers only partly), and
`shift_pairs` / `describe_permute` go between a collective-permute's `source_target_pairs`
and its pattern.

Group ids are *partition ids* (row-major positions in the mesh), NOT `device.id`. Formats
(JAX 0.12.0.1 / XLA:CPU): mesh-named `replica_groups=mesh['data'=2,'tensor'=4] {'tensor'}`
(shard_map, also GSPMD with renamed axes; sub-axes `'name':(pre)size`, measured equal to
`{'tensor':(1)2}` == `[4,2]<=[4,2]T(1,0)`), iota `[4,2]<=[2,4]T(1,0)` (GSPMD, mixed in one module),
and explicit `{{0,4},{1,5}}` (accepted by XLA's parser, not printed by JAX 0.12 on CPU).
A permute's pattern: 'stage +1' (a line), 'context ring -1' (a ring), or marked irregular.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinshard.hlo.parse import split_top


@dataclass(frozen=True)
class Shift:
    """How a collective-permute moves data along one mesh axis: its sorted signed `steps`, and `wrap`
    when some pair goes around the end (a ring)."""

    axis: str
    steps: tuple[int, ...]
    wrap: bool


@dataclass(frozen=True)
class MeshSpec:
    """Axis names and sizes; partition id = row-major position."""

    names: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def mesh_spec(mesh: Any) -> MeshSpec:
    """Normalise a `jax.sharding.Mesh`, `AbstractMesh` or `{'data': 2, ...}` dict."""
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, Mapping):
        names, sizes = tuple(mesh), tuple(int(v) for v in mesh.values())
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "axis_sizes"):
        names, sizes = tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes)
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "devices"):
        names, sizes = tuple(mesh.axis_names), tuple(np.shape(mesh.devices))
    else:
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh or a dict like {{'data': 2, 'tensor': 4}}, "
            f"got {type(mesh).__name__}"
        )
    if len(names) != len(sizes) or any(s < 1 for s in sizes):
        raise ValueError(f"mesh axes {names} and sizes {sizes} do not match")
    return MeshSpec(tuple(str(n) for n in names), sizes)


# ----------------------------------------------------------------------------- replica groups


def _iota_groups(text: str) -> list[list[int]]:
    """`[4,2]<=[2,4]T(1,0)` -> reshape(transpose(iota.reshape(2,4), (1,0)), (4,2))."""
    m = re.fullmatch(r"\[([\d,\s]+)\]\s*<=\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?", text.strip())
    if not m:
        raise ValueError(f"bad iota replica groups {text!r}")
    out_shape = [int(x) for x in m.group(1).split(",")]
    src_shape = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(src_shape)).reshape(src_shape)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(out_shape[0], -1).tolist()


def explicit_groups(text: str) -> list[list[int]]:
    """`{{0,4},{1,5}}` -> [[0,4],[1,5]]; `{}` -> []."""
    inner = text.strip()
    if not (inner.startswith("{") and inner.endswith("}")):
        raise ValueError(f"bad replica groups {text!r}")
    return [[int(x) for x in g.split(",") if x.strip()]
            for g in re.findall(r"\{([^{}]*)\}", inner[1:-1])]


def _mesh_groups(text: str) -> tuple[list[list[int]], list[list[int]]]:
    """`mesh['data'=2,'tensor'=4] {'tensor':(1)2}` -> (id groups, position groups)."""
    m = re.fullmatch(
        r"mesh\[([^\]]*)\]\s*(?:,\s*device_ids=\((.*?)\))?\s*\{([^{}]*)\}", text.strip()
    )
    if not m:
        raise ValueError(f"bad mesh replica groups {text!r}")
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    refs = []  # (axis index, stride, size): sub-coordinate = coord // stride % size
    for ref in split_top(m.group(3)):
        r = re.fullmatch(r"'([^']+)'(?::\((\d+)\)(\d+))?", ref)
        if not r or r.group(1) not in names:
            raise ValueError(f"bad mesh axis {ref!r} in {text!r}")
        i = names.index(r.group(1))
        pre, size = (int(r.group(2)), int(r.group(3))) if r.group(2) else (1, sizes[i])
        if sizes[i] % (pre * size):
            raise ValueError(f"sub-axis {ref!r} does not divide {names[i]}={sizes[i]}")
        refs.append((i, sizes[i] // (pre * size), size))
    coords = np.indices(sizes).reshape(len(sizes), -1)  # [axis, position]
    key = coords.copy()
    rank = np.zeros(coords.shape[1], dtype=np.int64)
    for i, stride, size in refs:
        sub = coords[i] // stride % size
        key[i] -= sub * stride
        rank = rank * size + sub
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for pos in range(coords.shape[1]):
        groups.setdefault(tuple(key[:, pos]), []).append((int(rank[pos]), pos))
    pos_groups = sorted([p for _, p in sorted(g)] for g in groups.values())
    device_ids = None
    if m.group(2):
        device_ids = (_iota_groups(m.group(2))[0] if "<=" in m.group(2)
                      else [int(x) for x in m.group(2).split(",")])
    id_groups = pos_groups if device_ids is None else [[device_ids[p] for p in g] for g in pos_groups]
    return id_groups, pos_groups


def decode_replica_groups(text: str, num_partitions: int) -> tuple[list[list[int]], list[list[int]]]:
    """Any printed replica_groups -> (groups of ids, groups of mesh positions)."""
    text = text.strip()
    if text.startswith("mesh"):
        return _mesh_groups(text)
    groups = _iota_groups(text) if text.startswith("[") else explicit_groups(text)
    if not groups:
        groups = [list(range(num_partitions))]
    return groups, groups


# ----------------------------------------------------------------------------- axes


def classify(groups: Iterable[Iterable[int]], mesh: MeshSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Mesh axes whose coordinate varies within a group, and those not fully covered."""
    varying, partial = set(), set()
    for g in groups:
        g = sorted(set(g))
        if not g:
            continue
        if max(g) >= mesh.size or min(g) < 0:
            raise ValueError(f"partition id {max(g)} is outside mesh {dict(zip(mesh.names, mesh.shape))}")
        coords = np.array(np.unravel_index(g, mesh.shape))  # [axis, member]
        vary = [i for i in range(len(mesh.shape)) if len(set(coords[i])) > 1]
        varying.update(vary)
        full = math.prod(mesh.shape[i] for i in vary)
        for i in vary:
            if len(set(coords[i])) < mesh.shape[i] or len(g) < full:
                partial.add(i)
    def in_mesh_order(axes: set[int]) -> tuple[str, ...]:
        return tuple(mesh.names[i] for i in sorted(axes))

    return in_mesh_order(varying), in_mesh_order(partial)


def pair_components(pairs: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Connected components of a permutation's pair graph."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s, t in pairs:
        parent[find(s)] = find(t)
    comps: dict[int, list[int]] = {}
    for x in list(parent):
        comps.setdefault(find(x), []).append(x)
    return sorted(sorted(c) for c in comps.values())


# ----------------------------------------------------------------------------- permutes


def shift_pairs(mesh: Any, shift: Mapping[str, int], wrap: bool) -> frozenset[tuple[int, int]]:
    """Source-target pairs of every device sending `shift[axis]` steps along each axis; wrap=True a
    ring, wrap=False a line (the device falling off the end sends nothing)."""
    spec = mesh_spec(mesh)
    coords = np.indices(spec.shape).reshape(len(spec.shape), -1)  # [axis, position]
    target = coords.copy()
    for axis, k in shift.items():
        if axis not in spec.names:
            raise ValueError(f"axis {axis!r} is not a mesh axis {spec.names}")
        target[spec.names.index(axis)] += int(k)
    size = np.array(spec.shape)[:, None]
    keep = np.ones(coords.shape[1], bool) if wrap else ((target >= 0) & (target < size)).all(0)
    src = np.ravel_multi_index(coords[:, keep], spec.shape)
    dst = np.ravel_multi_index(target[:, keep] % size, spec.shape)
    return frozenset(zip(src.tolist(), dst.tolist()))


def ring_step(k: int, n: int) -> int:
    """The step of a ring of n printed for `k`: k mod n in (-n/2, n/2]."""
    r = k % n
    return r - n if r > n / 2 else r


def shift_pattern(axis: str, k: int, n: int, wrap: bool) -> str:
    """`pattern` of a permute sending every device k steps along `axis`: 'stage +1', 'context ring -1'."""
    return f"{axis} ring {ring_step(k, n):+d}" if wrap else f"{axis} {k:+d}"


def _pair_step(d: int, n: int) -> tuple[int, bool]:
    """(step, wraps) of one pair moving d along an axis of n: the shorter way round, a tie not wrapping."""
    w = d - n if d > 0 else d + n
    return (w, True) if abs(w) < abs(d) else (d, False)


def describe_permute(pairs: Iterable[tuple[int, int]], mesh: Any) -> tuple[
        tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], tuple[Shift, ...], str]:
    """(pairs as mesh coordinates, shifts, pattern) of a collective-permute's pairs; any set but
    exactly `shift_pairs` along one axis is marked irregular: 'stage -1/+1 (irregular, 4 pairs)'."""
    spec = mesh_spec(mesh)
    pairs = tuple(pairs)
    if not pairs:
        return (), (), "no pairs"
    ids = np.array(pairs)
    if ids.min() < 0 or ids.max() >= spec.size:
        raise ValueError(f"partition id {ids.max()} is outside mesh {dict(zip(spec.names, spec.shape))}")
    src = np.array(np.unravel_index(ids[:, 0], spec.shape)).T  # [pair, axis]
    dst = np.array(np.unravel_index(ids[:, 1], spec.shape)).T
    coords = tuple((tuple(map(int, s)), tuple(map(int, t))) for s, t in zip(src, dst))
    delta = dst - src
    moved = [i for i in range(len(spec.shape)) if delta[:, i].any()]
    got = frozenset(pairs)
    if len(moved) == 1 and len(got) == len(pairs):
        i = moved[0]
        axis, n, raw = spec.names[i], spec.shape[i], sorted(set(delta[:, i].tolist()))
        if len(raw) == 1 and shift_pairs(spec, {axis: raw[0]}, False) == got:
            return coords, (Shift(axis, (raw[0],), False),), shift_pattern(axis, raw[0], n, False)
        k = ring_step(raw[0], n)
        if shift_pairs(spec, {axis: k}, True) == got:
            return coords, (Shift(axis, (k,), True),), shift_pattern(axis, k, n, True)
    shifts = []
    for i in moved:
        steps = [_pair_step(int(d), spec.shape[i]) for d in delta[:, i] if d]
        shifts.append(Shift(spec.names[i], tuple(sorted({s for s, _ in steps})), any(w for _, w in steps)))
    words = ", ".join(f"{s.axis} {'ring ' if s.wrap else ''}{'/'.join(f'{k:+d}' for k in s.steps)}"
                      for s in shifts) or "none"
    cross = ", crosses axes" if ((delta != 0).sum(1) > 1).any() else ""
    return coords, tuple(shifts), f"{words} (irregular{cross}, {len(pairs)} pairs)"
