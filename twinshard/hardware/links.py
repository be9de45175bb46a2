"""The hardware a plan runs on: a topology (a TPU slice's chip grid, or GPU nodes x GPUs per node;
TPU slices side by side on the data-center network) and the link each mesh axis's collectives
cross (ICI, NVLink, the inter-node network, DCN), with its bandwidth. twinshard/hardware/plan.py
prices every strategy's collectives over these links."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass

from twinshard.hardware import chips
from twinshard.hardware.chips import Chip
from twinshard.parallel.axes import ORDER

GB = 1e9  # link rates in GB/s, as datasheets print them


@dataclass(frozen=True)
class Topology:
    name: str  # 'v5p:4x4x4', 'h100:8x8'
    chip: Chip
    grid: tuple[int, ...]  # TPU: chips along each physical axis; GPU: (nodes, GPUs per node)
    slices: int = 1  # TPU slices of this grid, joined by the data-center network (`with_slices`)

    @property
    def chips(self) -> int:
        """Chips of one slice (a plan's mesh covers one slice; `slices` of them run side by side)."""
        return math.prod(self.grid)

    @property
    def wraps(self) -> tuple[bool, ...]:
        """Per physical axis of a TPU slice: do wraparound links close it into a ring? () for a GPU (docs/planning.md)."""
        if not self.chip.is_tpu:
            return ()
        whole = tuple(g % self.chip.torus_multiple == 0 for g in self.grid)
        return whole if self.chip.wraps_per_side else (all(whole),) * len(whole)

    @property
    def torus(self) -> bool:
        """Wraparound links on every axis."""
        return bool(self.wraps) and all(self.wraps)

    def describe(self) -> str:
        if self.chip.is_tpu:
            kind = ("torus" if self.torus else "mesh without wraparound" if not any(self.wraps) else
                    "wraparound on " + " and ".join("xyz"[i] for i, w in enumerate(self.wraps) if w) + " only")
            one = f"{self.name} = {self.chips} TPU {self.chip.name} chips ({kind})"
            return one if self.slices == 1 else f"{self.slices} slices over DCN, each {one}"
        nodes, per_node = self.grid
        return f"{self.name} = {nodes} node{'s' * (nodes > 1)} x {per_node} {self.chip.name} GPUs"


def parse_topology(text: str) -> Topology:
    """'v5p:4x4x4' -> 64 v5p chips on a 4x4x4 grid; 'h100:8x8' -> 8 nodes x 8 GPUs."""
    name, colon, shape = (text or "").strip().partition(":")
    example = "e.g. v5p:4x4x4, v5e:16x16, v4:2x2x4 (TPU slices) or h100:8x8, h200:1x8 (nodes x GPUs per node)"
    try:
        chip = chips.chip(name)
    except ValueError as e:
        raise ValueError(f"--topology={text}: {e} Write CHIP:SHAPE, {example}.") from None
    if not colon or not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)*", shape.strip()):
        raise ValueError(f"--topology={text}: shape {shape.strip()!r} is not sizes >= 1 joined by 'x'; "
                         f"write CHIP:SHAPE, {example}.")
    grid = tuple(int(x) for x in shape.strip().split("x"))
    topo = Topology(f"{chip.name.lower()}:{'x'.join(map(str, grid))}", chip, grid)
    problem = _shape_problem(topo)
    if problem:
        raise ValueError(f"--topology={text}: {problem}.")
    return topo


def _shape_problem(topo: Topology) -> str | None:
    chip, grid = topo.chip, topo.grid
    if chip.is_tpu and len(grid) != chip.torus_dims:
        want = "AxBxC, e.g. 4x4x4" if chip.torus_dims == 3 else "AxB, e.g. 4x4"
        return f"{chip.name} slices are {chip.torus_dims}-D ({want})"
    if chip.is_tpu and any(g > p for g, p in zip(sorted(grid), sorted(chip.pod))):
        pod = "x".join(map(str, chip.pod))
        return f"{'x'.join(map(str, grid))} does not fit in a {chip.name} pod ({pod} = {math.prod(chip.pod)} chips)"
    if not chip.is_tpu and len(grid) != 2:
        return "a GPU cluster is NODESxGPUS (e.g. h100:8x8: 8 nodes of 8 GPUs)"
    if not chip.is_tpu and grid[1] > chip.gpus_per_node:
        return f"{grid[1]} GPUs per node; an HGX {chip.name} node has {chip.gpus_per_node}"
    if topo.chips < 2:
        return "one chip needs no parallelism plan; train with --strategy=single"
    return None


# ----------------------------------------------------------------------------- links per mesh axis


@dataclass(frozen=True)
class Link:
    bytes_per_s: float  # what one chip can send over the axis (one way)
    what: str
    all_to_all: float = 1.0  # an all-to-all's time / (its ring bytes / bytes_per_s): ICI `_ici`, GPU `_gpu_axis`
    hop_bytes_per_s: float | None = None  # a shift to a neighbour (collective-permute): one link; None: bytes_per_s


def with_slices(topo: Topology, slices: int) -> Topology:
    """`slices` copies of the TPU slice `topo`, data parallel over the data-center network (DCN)."""
    if slices < 1:
        raise ValueError(f"--slices={slices} must be >= 1 (1: one slice, no DCN).")
    if slices > 1 and not topo.chip.is_tpu:
        raise ValueError(f"--slices={slices}: {topo.name} is a GPU cluster, whose nodes already share one network; "
                         "plan more nodes instead (e.g. --topology=h100:16x8).")
    if slices > 1 and topo.chip.dcn_bytes_per_s is None:
        raise ValueError(f"--slices={slices}: no data-center network bandwidth is known for {topo.chip.name} "
                         "(twinshard/hardware/chips.py); plan v5p or v5e slices, or one slice.")
    return dataclasses.replace(topo, slices=slices)


def dcn_link(topo: Topology) -> Link:
    """What each chip sends to the other slices: its share of its host's NICs; a cross-slice
    all-reduce runs one ring per chip position, all at once (the scaling book, "Scaling Across Pods")."""
    rate = topo.chip.dcn_bytes_per_s
    return Link(rate, f"DCN {rate * 8 / 1e9:g} Gb/s per chip")


def _split(mesh: dict[str, int]) -> list[str]:
    """The mesh axes of size > 1, in mesh order: at most two (every strategy splits one or two)."""
    split = [a for a in ORDER if mesh.get(a, 1) > 1]
    assert len(split) <= 2, mesh
    return split


def inner_axis(mesh: dict[str, int]) -> str:
    """The mesh axis jax.make_mesh puts on the closest chips: the last of size > 1 in mesh order
    (`tensor` when none is split; tests/test_plan.py checks it against jax's own assignment)."""
    return (_split(mesh) or ["tensor"])[-1]


def outer_axis(mesh: dict[str, int]) -> str:
    """The other split axis (`data` of fsdp_tp, `stage` of pp_fsdp); `data` when there is none."""
    split = _split(mesh)
    return split[0] if len(split) == 2 else "data"


def tensor_sides(grid: tuple[int, ...], tensor: int) -> tuple[int, ...]:
    """Chips of the tensor (or expert) axis along each physical axis, as jax's mesh_utils lays it out:
    whole physical axes multiplying to `tensor` if possible (v5p 4x4x4, tensor 16: x and y), else
    the most chips on whole axes first (v5p 4x4x4, tensor 8: x and 2 of y)."""
    for k in range(len(grid), 0, -1):
        for axes in itertools.combinations(range(len(grid)), k):
            if math.prod(grid[i] for i in axes) == tensor:
                return tuple(g if i in axes else 1 for i, g in enumerate(grid))
    options = [a for a in itertools.product(*([k for k in range(1, g + 1) if g % k == 0] for g in grid))
               if math.prod(a) == tensor]

    def preference(a: tuple[int, ...]) -> tuple:
        whole = [n for n, g in zip(a, grid) if n == g and n > 1]
        return math.prod(whole), len(whole), a

    return max(options, key=preference)


def _ici(topo: Topology, spans: list[tuple[int, int, bool]]) -> Link:
    """An axis over (physical axis, its chips along it, spans the whole side?): a ring on each.

    Its all-to-all factor: dimension-ordered routing sends B/n to each of n chips min(j, n-j) hops
    away along each physical axis at once, over k one-way links (2 on a torus ring, 1 on a line), so

        factor = max_i [floor(n_i/2) ceil(n_i/2) / (n_i k_i)] x K N / (N - 1)

    (one axis: n^2 / (4 (n-1)) for even n; a 4x4 torus face: 32/15)."""
    one_way, parts = topo.chip.ici_link_bytes_per_s, []
    for i, n, whole in spans:
        k = 2 if whole and topo.wraps[i] else 1  # a bidirectional ring, or one folded back on its links
        how = "torus ring" if k == 2 else "no wraparound" if whole else f"part of a side of {topo.grid[i]}"
        parts.append((k, n, f"{'xyz'[i]} ({n} chips, {how}): {k} x {one_way / GB:g} GB/s"))
    total_k, group = sum(k for k, _, _ in parts), math.prod(n for _, n, _ in parts)
    busiest = max((n // 2) * ((n + 1) // 2) / (n * k) for k, n, _ in parts)  # x B / one-way = seconds
    return Link(total_k * one_way, "ICI " + ", ".join(what for _, _, what in parts),
                busiest * total_k * group / (group - 1), one_way)  # a shift: one link, one way


def tpu_links(topo: Topology, mesh: dict[str, int]) -> dict[str, Link]:
    """The inner split axis (`inner_axis`) on `tensor_sides` of the grid, the outer one on the rest."""
    inner, outer = inner_axis(mesh), outer_axis(mesh)
    sides = tensor_sides(topo.grid, mesh.get(inner, 1))
    near = [(i, n, n == g) for i, (n, g) in enumerate(zip(sides, topo.grid)) if n > 1]
    rest = [(i, g // n, True) for i, (n, g) in enumerate(zip(sides, topo.grid)) if g // n > 1]
    return {axis: _ici(topo, spans) for axis, spans in ((outer, rest), (inner, near)) if spans}


def gpu_links(topo: Topology, mesh: dict[str, int]) -> dict[str, Link]:
    """Each mesh axis (of size > 1) as `_gpu_axis` prices it: jax.make_mesh lays GPUs out by id, node
    after node, and the mesh axes row-major in mesh order, so consecutive members of an axis's group
    are `stride` devices apart, stride = the product of the axes inside it."""
    order = [a for a in ORDER if a in mesh]
    strides = {a: math.prod(mesh[b] for b in order[i + 1:]) for i, a in enumerate(order)}
    return {a: _gpu_axis(topo, mesh[a], strides[a]) for a in order if mesh[a] > 1}


def _gpu_axis(topo: Topology, n: int, stride: int) -> Link:
    """A group of n GPUs, `stride` devices apart, as g GPUs in each of k nodes (n = g k): a ring runs
    hierarchically, levels overlapped (the scaling book's "Cross-node collectives"):

        seconds = max((g-1)/(g W_nvlink), (k-1)/(k g W_nic)),  bytes_per_s = ((n-1)/n) / seconds

    An all-to-all is not hierarchical (NVLink and NIC shares at once); a shift crosses one link; a
    group unevenly spread over nodes is a flat ring at the NIC share (docs/planning.md)."""
    chip, (nodes, per_node) = topo.chip, topo.grid
    nvlink, nic = chip.nvlink_bytes_per_s, chip.node_network_bytes_per_s / chip.gpus_per_node
    span = n * stride
    if nodes == 1 or (span <= per_node and per_node % span == 0):
        g = n  # inside one node
    elif stride % per_node == 0:
        g = 1  # one GPU per node
    elif per_node % stride == 0 and span % per_node == 0:
        g = per_node // stride
    else:  # uneven: a flat ring at the NIC share
        return Link(nic, f"network {nic / GB:g} GB/s per GPU (a ring unevenly spread over nodes)", 1.0, nic)
    k = n // g
    seconds = max((g - 1) / (g * nvlink), (k - 1) / (k * g * nic))
    rate = (n - 1) / n / seconds
    a2a = max((g - 1) / (n * nvlink), (n - g) / (n * nic)) * rate * n / (n - 1)
    if k == 1:
        return Link(rate, f"NVLink {nvlink / GB:g} GB/s", a2a, nvlink)
    inside = f"NVLink ring of {g} GPUs per node, " if g > 1 else ""
    return Link(rate, f"{inside}network ring of {k} nodes at {g} x {nic / GB:g} GB/s (each GPU's NIC), "
                      f"overlapped", a2a, nic)


def collective_seconds(op: str, axes: tuple[str, ...], ring_bytes: float, links: dict[str, Link]) -> tuple[str, float]:
    """(the axis it is charged to, seconds) of a collective sending `ring_bytes` per chip over `axes`:
    the slowest axis's link, an all-to-all x its `Link.all_to_all`, a shift (collective-permute) at one
    link's rate. The planner and twinshard.hlo.timing price every collective so."""
    missing = [a for a in axes if a not in links]
    if missing:
        raise ValueError(f"no link bandwidth for mesh axes {missing} (links known: {sorted(links)}); pass the "
                         "topology the program runs on, or links for every axis a collective crosses")
    slowest = min(axes, key=lambda a: links[a].bytes_per_s)
    link = links[slowest]
    if op == "collective-permute":
        return slowest, ring_bytes / (link.hop_bytes_per_s or link.bytes_per_s)
    return slowest, ring_bytes * (link.all_to_all if op == "all-to-all" else 1.0) / link.bytes_per_s


def axis_links(topo: Topology, mesh: dict[str, int]) -> dict[str, Link]:
    """mesh axis (of size > 1) -> the bandwidth one chip has over it."""
    return (tpu_links if topo.chip.is_tpu else gpu_links)(topo, mesh)


# ----------------------------------------------------------------------------- one plan
