"""Meshes for every strategy: parsing, defaults and validation.

Both twins build their mesh here, so an invalid (strategy, mesh, model, batch) fails the same
way, with a ValueError naming the value and a valid alternative, before anything compiles.
Mesh syntax: `data:4,tensor:2`; an omitted axis is size 1.
"""

from __future__ import annotations

import math
from typing import Iterator, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from twinshard.parallel import strategies
from twinshard.parallel.strategies import ANY, KV_HEADS, MANY, ONE

AXES = ("data", "tensor")  # the axes of DATA_TENSOR's meshes (mesh_str shows both)
# Mesh order: stage outermost (one hop per micro-batch), then data, expert, context, and tensor
# innermost (Megatron's all-reduces every layer get the closest chips).
ORDER = strategies.ORDER
DATA_TENSOR = strategies.DATA_TENSOR  # dp, fsdp, tp, fsdp_tp: their meshes name exactly data and tensor

# strategy -> {mesh axis: the size it needs}; the axes of its mesh, in ORDER.
NEEDS: dict[str, dict[str, str]] = {s.name: dict(s.mesh) for s in strategies.DECLARATIONS}


def check_strategy(strategy: str) -> None:
    strategies.get(strategy)  # a ValueError naming the strategies


def _needs(strategy: str | None) -> dict[str, str]:
    """The strategy's axes and sizes; None: the base strategies' data and tensor, any size."""
    return {a: ANY for a in AXES} if strategy is None else NEEDS[strategy]


def _is_base(strategy: str | None) -> bool:
    return strategy is None or strategy in DATA_TENSOR


def _required(strategy: str | None) -> tuple[str, ...]:
    """The axes a mesh string must name: the axes the strategy splits (without one: both base axes)."""
    needs = _needs(strategy)
    return AXES if strategy is None else tuple(a for a in ORDER if needs.get(a) == MANY)


def _example(strategy: str | None) -> str:
    """A mesh string for the strategy: its default on 8 devices."""
    return mesh_str(default_mesh(strategy, 8) if strategy is not None else {"data": 4, "tensor": 2}, strategy)


def _axis_sizes(spec: str, allowed, unknown, bad) -> dict[str, int]:
    """'a:2,b:4' -> {'a': 2, 'b': 4} for axes in `allowed`; a ValueError bad(part, why) at the first part that
    names an axis not allowed (why: unknown(name)), names one twice or gives no whole size >= 1."""
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, colon, size = (x.strip() for x in part.partition(":"))
        if name not in allowed:
            why = unknown(name)
        elif name in shape:
            why = f"axis {name!r} appears twice"
        elif not colon or not size.isdigit() or int(size) < 1:
            why = f"size {size!r} of axis {name!r} is not an integer >= 1"
        else:
            shape[name] = int(size)
            continue
        raise ValueError(bad(part, why))
    return shape


def parse_mesh(spec: str, strategy: str | None = None) -> dict[str, int]:
    """'data:4,tensor:2' -> {'data': 4, 'tensor': 2}; with `strategy`, its axes only, an omitted one 1."""
    if strategy is not None:
        check_strategy(strategy)
    if not isinstance(spec, str):
        raise ValueError(f"mesh spec must be a string such as {_example(strategy)!r}, got {spec!r}.")
    allowed = tuple(a for a in ORDER if a in _needs(strategy))
    whose = "" if strategy is None else f" of strategy {strategy}"
    form = "data:N,tensor:M" if _is_base(strategy) else ",".join(f"{a}:N" for a in _required(strategy))
    shape = _axis_sizes(spec, allowed, lambda name: f"unknown axis {name!r} (the axes{whose} are {', '.join(allowed)})",
                        lambda part, why: f"bad mesh {spec!r} at {part!r}: {why}; write it as {form} with "
                                          f"each axis once and sizes >= 1 (e.g. {_example(strategy)}).")
    missing = [a for a in _required(strategy) if a not in shape]
    if missing:
        if strategy is None:
            example = ",".join(f"{a}:{shape.get(a, 1)}" for a in AXES) if shape else "data:4,tensor:2"
            raise ValueError(f"mesh {spec!r} lacks axis {missing[0]!r}; name both axes (size 1 allowed), "
                             f"e.g. {example}.")
        raise ValueError(f"mesh {spec!r} lacks axis {missing[0]!r}, which strategy {strategy} splits; "
                         f"e.g. {_example(strategy)}.")
    return {a: shape.get(a, 1) for a in allowed}


def _check_device_count(n_devices: int) -> None:
    if isinstance(n_devices, bool) or not isinstance(n_devices, (int, np.integer)) or n_devices < 1:
        raise ValueError(f"device count {n_devices!r} must be an integer >= 1.")


def default_mesh(strategy: str, n_devices: int) -> dict[str, int]:
    """All devices on the strategy's one split axis; a second gets the smallest factor (fsdp_tp on 8: data:4,tensor:2)."""
    check_strategy(strategy)
    _check_device_count(n_devices)
    needs = NEEDS[strategy]
    shape = dict.fromkeys(needs, 1)
    split = [a for a in needs if needs[a] == MANY]
    if len(split) == 1:
        shape[split[0]] = n_devices
    else:
        first, second = split
        shape[second] = next((k for k in range(2, n_devices) if n_devices % k == 0), n_devices)
        shape[first] = n_devices // shape[second]
    return shape


def mesh_str(shape: Mapping[str, int], strategy: str | None = None) -> str:
    """'data:4,tensor:2'; for the newer strategies only the axes they may split, or > 1 ('stage:4')."""
    needs = _needs(strategy)
    shown = [a for a in ORDER if a in shape and (_is_base(strategy) or needs.get(a) != ONE or shape[a] != 1)]
    return ",".join(f"{a}:{shape[a]}" for a in shown)


def _sized(needs: Mapping[str, str], shape: Mapping[str, int]) -> bool:
    return all(shape[a] > 1 if n == MANY else shape[a] == 1 if n == ONE else True for a, n in needs.items())


def _fix(strategy: str, n_devices: int) -> str:
    """A valid alternative: the default mesh, or (if there is none on n devices) what is needed."""
    default = default_mesh(strategy, n_devices)
    if _sized(NEEDS[strategy], default):
        return f"try --mesh={mesh_str(default, strategy)}"
    fits = [s for s in DATA_TENSOR if _sized(NEEDS[s], default_mesh(s, n_devices))]
    split = [a for a in NEEDS[strategy] if NEEDS[strategy][a] == MANY]
    need = (f"a device count with a factor pair {', '.join(split)} > 1 (4, 6, 8, ...)" if len(split) == 2
            else "at least 2 devices")
    return (f"strategy {strategy} needs {need}, have {n_devices}; run on more devices or use "
            + (f"strategy {' or '.join(fits)}" if fits else "the single-device runner"))


def _mesh_problem(strategy: str, shape: Mapping[str, int], n_devices: int) -> str | None:
    """What is wrong with `shape` for `strategy` on `n_devices` (None: nothing), without a fix."""
    needs = NEEDS[strategy]
    axes = tuple(a for a in ORDER if a in needs)
    if not isinstance(shape, Mapping):
        return f"mesh {shape!r} is not a mapping of axis name to size such as {{'data': 4, 'tensor': 2}}"
    unknown, missing = [a for a in shape if a not in axes], [a for a in axes if a not in shape]
    if unknown or missing:
        what = f"has axis {unknown[0]!r}, not one of {', '.join(axes)}" if unknown else f"lacks axis {missing[0]!r}"
        name = "name both axes" if _is_base(strategy) else "name every axis of the strategy"
        return f"mesh {dict(shape)} {what}; {name} (size 1 allowed)"
    for axis in axes:
        size = shape[axis]
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            return f"mesh axis {axis}={size!r} must be an integer >= 1"
    for axis in axes:
        if needs[axis] == MANY and shape[axis] < 2 or needs[axis] == ONE and shape[axis] != 1:
            want = "> 1" if needs[axis] == MANY else "= 1"
            return f"strategy {strategy} needs {axis} {want}, got mesh {mesh_str(shape, strategy)}"
    if math.prod(shape.values()) != n_devices:
        return (f"mesh {mesh_str(shape, strategy)} has {math.prod(shape.values())} devices but {n_devices} "
                "are available")
    return None


def check_mesh(strategy: str, shape: Mapping[str, int], n_devices: int) -> None:
    """Every axis of the strategy present, sized as it needs, using every device (no model checks)."""
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
_FIELDS = {"batch": "--batch_size", "embed": "d_model", "heads": "num_heads", "kv_heads": "--num_kv_heads", "mlp": "d_ff",
           "seq": "--context_length", "experts": "--num_experts"}
# Checked elsewhere, with a better message: `layers` over `stage` (pipeline.check names the
# stage counts that fit L), `seq` over `context` (context.check: zig-zag needs 2C chunks).
_NOT_HERE = frozenset({("layers", "stage"), ("seq", "context")})


def axis_size(shape: Mapping[str, int], axis: str | tuple[str, ...]) -> int:
    """Devices along a mesh axis, or along a tuple of axes (ep's batch over data x expert)."""
    return shape.get(axis, 1) if isinstance(axis, str) else math.prod(shape.get(a, 1) for a in axis)


def _divisibility_problem(dims: Mapping[str, int], rules: Mapping[str, str],
                          shape: Mapping[str, int]) -> tuple[str, str] | None:
    """(what does not divide, the config change that fixes it), or None."""
    for name, size in dims.items():
        axis = rules.get(name)
        if axis is None or (name, axis) in _NOT_HERE or size % axis_size(shape, axis) == 0:
            continue
        n = axis_size(shape, axis)
        if name == KV_HEADS:  # split when the axis divides them, else replicated (Strategy.placed)
            if n % size == 0:
                continue
            return (f"kv_heads={size} neither divides nor is divided by mesh axis {axis}={n} (a device's query "
                    f"heads would span two key/value heads)",
                    f"make num_kv_heads (--num_kv_heads) a divisor or a multiple of {n}")
        change = (f"pick a vocab_size whose padded size (a multiple of 128) is a multiple of {n}"
                  if name == "vocab" else f"make {name} ({_FIELDS.get(name, name)}) a multiple of {n}")
        where = f"mesh axis {axis}={n}" if isinstance(axis, str) else f"mesh axes {' x '.join(axis)} = {n} devices"
        return f"{name}={size} is not divisible by {where}", change
    return None


def factorings(axes: tuple[str, ...], n: int) -> Iterator[dict[str, int]]:
    """Every {axis: size} over `axes` with product n, most devices on the outer axes first."""
    if len(axes) == 1:
        yield {axes[0]: n}
        return
    for k in (k for k in range(1, n + 1) if n % k == 0):
        for rest in factorings(axes[:-1], n // k):
            yield {**rest, axes[-1]: k}


def fitting_mesh(needs: Mapping[str, str], dims: Mapping[str, int], rules: Mapping[str, str],
                 n_devices: int, prefer: Mapping[str, int] | None = None) -> dict[str, int] | None:
    """A mesh on exactly n_devices sized as `needs` that splits every dimension evenly; `prefer` first."""
    candidates = list(factorings(tuple(a for a in ORDER if a in needs), n_devices))
    if prefer is not None:
        candidates.insert(0, dict(prefer))
    for shape in candidates:
        if _sized(needs, shape) and _divisibility_problem(dims, rules, shape) is None:
            return shape
    return None


def advice(needs: Mapping[str, str], dims: Mapping[str, int], rules: Mapping[str, str], n_devices: int,
           prefer: Mapping[str, int] | None = None, strategy: str | None = None) -> str:
    """One step that works: a mesh on these devices, else the most devices that have one."""
    shape = fitting_mesh(needs, dims, rules, n_devices, prefer)
    if shape is not None:
        return f"try --mesh={mesh_str(shape, strategy)}"
    for k in range(n_devices - 1, 1, -1):
        shape = fitting_mesh(needs, dims, rules, k)
        if shape is not None:
            return (f"no mesh on {n_devices} devices splits this model for this strategy; run on {k}: "
                    f"--devices={k} --mesh={mesh_str(shape, strategy)}")
    return f"no mesh on {n_devices} or fewer devices splits this model for this strategy"


def check_divisible(dims: Mapping[str, int], rules: Mapping[str, str], shape: Mapping[str, int],
                    advise: bool = True) -> None:
    """Every logical dimension split by `rules` must divide by its mesh axis size; the error advises a
    mesh on the same devices unless advise=False (launch.plan: the search takes minutes on a pod)."""
    problem = _divisibility_problem(dims, rules, shape)
    if problem is None:
        return
    if not advise:
        raise ValueError(f"{problem[0]}; {problem[1]}.")
    used = {a for axis in rules.values() for a in ((axis,) if isinstance(axis, str) else axis)}
    needs = {a: MANY if a in used else ONE for a in shape}
    fix = advice(needs, dims, rules, math.prod(shape.values()))
    raise ValueError(f"{problem[0]}; {fix}, or {problem[1]}.")


def resolve(strategy: str, spec: str | None, dims: Mapping[str, int], rules: Mapping[str, str],
            n_devices: int) -> dict[str, int]:
    """Parse (or default) the mesh and check it against the strategy, the devices and the model;
    an error advises one mesh (or device count) that passes all three checks."""
    shape = resolve_axes(strategy, None if spec is None else parse_mesh(spec, strategy), dims, rules, n_devices)
    check_split(strategy, shape, dims, rules)
    return shape


def resolve_axes(strategy: str, asked: Mapping[str, int] | None, dims: Mapping[str, int],
                 rules: Mapping[str, str], n_devices: int) -> dict[str, int]:
    """`resolve`'s mesh (the parsed spec `asked`, or the default) checked against the strategy and
    the devices only."""
    check_strategy(strategy)
    _check_device_count(n_devices)
    shape = default_mesh(strategy, n_devices) if asked is None else dict(asked)
    problem = _mesh_problem(strategy, shape, n_devices)
    if problem is not None:
        _refuse(strategy, problem, dims, rules, n_devices)
    return shape


def check_split(strategy: str, shape: Mapping[str, int], dims: Mapping[str, int], rules: Mapping[str, str]) -> None:
    """`resolve`'s divisibility check of a mesh `resolve_axes` accepted."""
    if (split := _divisibility_problem(dims, rules, shape)) is not None:
        _refuse(strategy, f"{split[0]} (or {split[1]})", dims, rules, math.prod(shape.values()))


def _refuse(strategy: str, problem: str, dims: Mapping[str, int], rules: Mapping[str, str], n_devices: int):
    fix = advice(NEEDS[strategy], dims, rules, n_devices, default_mesh(strategy, n_devices), strategy)
    raise ValueError(f"{problem}; {fix}.")


def make_mesh(shape: Mapping[str, int], axis_type: AxisType = AxisType.Auto,
              devices: list | None = None) -> Mesh:
    """A mesh of the axes in `shape`, in ORDER; on CPU the device order is row-major
    (partition id = data_index * tensor_size + tensor_index)."""
    names = tuple(a for a in ORDER if a in shape)
    sizes = tuple(shape[a] for a in names)
    if devices is None:
        return jax.make_mesh(sizes, names, axis_types=(axis_type,) * len(names))
    return Mesh(np.asarray(devices).reshape(sizes), names, axis_types=(axis_type,) * len(names))


# Across slices (--dcn_mesh): a slice is a pod of chips joined by ICI; slices reach each other over the
# data-center network (DCN), ~10-100x slower. Each mesh axis lies wholly across slices or wholly
# inside one; the DCN axes are outermost in the device order (create_hybrid_device_mesh's blocks).

_DCN_EXAMPLE = "--strategy=hsdp --dcn_mesh=data:2 --mesh=fsdp:4"


def _named_axes(spec: str | None) -> list[str]:
    return [p.partition(":")[0].strip() for p in (spec or "").split(",") if p.strip()]


def parse_dcn_mesh(spec: str | None, strategy: str, mesh_spec: str | None = None) -> dict[str, int]:
    """--dcn_mesh 'data:2' -> {'data': 2}: the axes across slices, each one the strategy may put on
    DCN (Strategy.dcn) and named in no --mesh; None or '' -> {} (one slice)."""
    if not spec:
        return {}
    declared = strategies.get(strategy)
    if not declared.dcn:
        raise ValueError(f"--dcn_mesh={spec}: strategy {strategy} cannot cross slices (each of its collectives "
                         f"would cross DCN every layer); the strategies that can are {', '.join(strategies.CROSS_DCN)}"
                         f", e.g. {_DCN_EXAMPLE}.")
    shape = _axis_sizes(spec, declared.dcn, lambda name: f"axis {name!r} cannot cross slices under {strategy} (its "
                        f"axis across slices: {', '.join(declared.dcn)})",
                        lambda part, why: f"bad --dcn_mesh={spec!r} at {part!r}: {why}; e.g. {_DCN_EXAMPLE}.")
    both = [a for a in _named_axes(mesh_spec) if a in shape]
    if both:
        inner = ",".join(p for p in (mesh_spec or "").split(",") if p.partition(":")[0].strip() not in shape)
        raise ValueError(f"axis {both[0]!r} is named in both --dcn_mesh={spec} and --mesh={mesh_spec}: an axis lies "
                         f"either across slices or inside one; drop it from --mesh (--mesh={inner or 'fsdp:4'}).")
    return shape


def hybrid_spec(strategy: str, dcn: Mapping[str, int], mesh_spec: str | None, n_devices: int) -> str:
    """The whole mesh's spec: the DCN axes, then --mesh's (default: the strategy's one other split axis
    on every device of a slice, hsdp's fsdp:n/slices)."""
    slices = math.prod(dcn.values())
    if mesh_spec is None:
        inner = [a for a in _required(strategy) if a not in dcn]
        mesh_spec = ",".join(f"{a}:{max(n_devices // slices, 1) if a == inner[0] else 1}" for a in inner)
    return ",".join([*(f"{a}:{n}" for a, n in dcn.items()), mesh_spec])


class _SimulatedSlice:
    """A device of one process's simulated slice: the device, with the slice_index a TPU device has."""

    def __init__(self, device, slice_index: int):
        self.device, self.slice_index = device, slice_index

    def __getattr__(self, name):
        return getattr(self.device, name)


def granules(devices) -> tuple[str, list]:
    """How the devices group into slices: 'slice_index' (TPU slices, AOT topologies of num_slices),
    'process_index' (CPU processes: each one a slice), or 'simulated' (one CPU process: its devices,
    in order, split by the caller). Measured (JAX 0.12): the CPU devices of a multi-process run have a
    slice_index, 0 in every process, so one slice_index is no slice count on a CPU."""
    indices = sorted({getattr(d, "slice_index", 0) for d in devices})
    if len(indices) > 1 or devices[0].platform != "cpu":
        return "slice_index", indices
    if len(processes := sorted({d.process_index for d in devices})) > 1:
        return "process_index", processes
    return "simulated", [0]


def check_slices(dcn: Mapping[str, int], devices) -> None:
    """The DCN mesh's product is the slice count (simulated: it splits the devices evenly), or one line."""
    slices, (how, found) = math.prod(dcn.values()), granules(devices)
    spec = ",".join(f"{a}:{n}" for a, n in dcn.items())
    axis = next(iter(dcn))
    if how != "simulated" and slices != len(found):
        by = "slice_index" if how == "slice_index" else "process (each process a slice)"
        raise ValueError(f"--dcn_mesh={spec} spans {slices} slices but the {len(devices)} devices are in "
                         f"{len(found)} (by {by}); write --dcn_mesh={axis}:{len(found)}.")
    if how == "simulated" and len(devices) % slices:
        fits = [k for k in range(2, len(devices) + 1) if len(devices) % k == 0]
        raise ValueError(f"--dcn_mesh={spec} splits this process's {len(devices)} devices into {slices} simulated "
                         f"slices, unevenly; choose {axis} from {fits}.")


def hybrid_mesh(shape: Mapping[str, int], dcn: Mapping[str, int], devices=None) -> np.ndarray:
    """The devices of a mesh across slices, shaped as `shape` in ORDER (mesh_utils.create_hybrid_device_mesh):
    each DCN axis (`dcn`, sized in slices) steps from slice to slice, the other axes stay inside one.
    One process without slice_index (CPU tests) splits its devices, in order, into equal simulated slices."""
    from jax.experimental import mesh_utils

    devices = list(jax.devices() if devices is None else devices)
    check_slices(dcn, devices)
    names = [a for a in ORDER if a in shape]
    inner = [shape[a] // dcn.get(a, 1) for a in names]  # [1, 4] for hsdp data:2 (DCN) x fsdp:4 (ICI)
    outer = [dcn.get(a, 1) for a in names]  # [2, 1]
    how, _ = granules(devices)
    if how != "simulated":
        return mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=how == "process_index")
    per_slice = len(devices) // math.prod(outer)
    wrapped = [_SimulatedSlice(d, i // per_slice) for i, d in enumerate(devices)]
    placed = mesh_utils.create_hybrid_device_mesh(inner, outer, wrapped)
    return np.vectorize(lambda d: d.device, otypes=[object])(placed)


def slices_line(shape: Mapping[str, int], dcn: Mapping[str, int], devices) -> str:
    """'mesh data:2,fsdp:4 across 2 slices (data:2 over DCN, by process)': what the launchers log."""
    how = {"slice_index": "by slice_index", "process_index": "by process",
           "simulated": "simulated: one process's devices split in order"}[granules(list(devices))[0]]
    spec = ",".join(f"{a}:{n}" for a, n in dcn.items())
    return f"mesh {mesh_str(shape)} across {math.prod(dcn.values())} slices ({spec} over DCN, {how})"
