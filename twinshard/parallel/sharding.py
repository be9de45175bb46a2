"""A value's sharding checked against a declared spec, at trace time when JAX's Explicit mode
puts the sharding in its type: the explicit twin's hooks run it, twinshard.testing re-exports it."""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec as P


def expect_sharding(x, spec: P) -> None:
    """Assert that `x` is sharded as `spec`: its partitions, and its `unreduced` / `reduced` mesh
    axes.

    x: a concrete array (its placement, on any mesh: `x.sharding`), or, under JAX's Explicit
    mode, a tracer inside a traced function (checked at trace time) or an aval (`jax.typeof(x)`),
    whose type carries the sharding; or a `jax.ShapeDtypeStruct` with a NamedSharding. The type
    of a value on Auto mesh axes says nothing about where it is (measured, JAX 0.12: an array
    placed P('data') on an Auto mesh has the type sharding P(None, None)), so a tracer or aval
    there is refused. Trailing unsplit dims may be left out of `spec`, a 1-tuple of axes equals
    the axis, and mesh axes of size 1 split nothing (P('data') on a data axis of 1 equals
    P(None)). Raises AssertionError naming both."""
    shape, sharding, shown, typed = _type_of(x)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise AssertionError(f"expected sharding {spec} for {shown}: its type carries no NamedSharding")
    sizes = dict(sharding.mesh.shape)
    auto = [a for a, t in zip(sharding.mesh.axis_names, sharding.mesh.axis_types)
            if t != jax.sharding.AxisType.Explicit and sizes[a] > 1]
    if typed and auto:
        raise AssertionError(f"expected sharding {spec} for {shown}: its type cannot say, the mesh axes {auto} are "
                             "not Explicit; check the concrete array (outside jit), or use an Explicit mesh.")
    if _canonical(sharding.spec, len(shape), sizes) != _canonical(spec, len(shape), sizes):
        found = f"the type is {shown}, sharding {sharding.spec}" if typed else f"{shown} is sharded {sharding.spec}"
        raise AssertionError(f"expected sharding {spec}; {found}")


def _type_of(x):
    """(shape, sharding, printable type, whether the sharding is read from a type) of an array,
    tracer, aval or ShapeDtypeStruct."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.shape, x.sharding, f"{x.dtype}{list(x.shape)}", False
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return x.shape, x.sharding, jax.typeof(x).str_short(), False  # where it is, on any mesh
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    return aval.shape, aval.sharding, aval.str_short(), True


def _canonical(s: P, ndim: int, sizes: Mapping[str, int]):
    """A spec as (partitions per dim, unreduced, reduced), axes of size 1 dropped."""
    def axes(entry) -> tuple[str, ...]:
        found = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return tuple(a for a in found if sizes.get(a, 2) > 1)
    parts = s.partitions + (None,) * (ndim - len(s.partitions))
    return (tuple(axes(p) for p in parts), frozenset(axes(tuple(s.unreduced))),
            frozenset(axes(tuple(s.reduced))))
