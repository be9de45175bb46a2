"""The matmul every layer runs and the typing its custom backwards share: `matmul` (dW as ONE dot,
int8 forward and dx under quantize.py), `partial_sums` (a contraction's Explicit-mode output sharding)
and `cotangent_like` (a custom backward's cotangent as autodiff would type it)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from twinshard.model import quantize

Array = jax.Array


def _product(x: Array, w: Array) -> Array:
    """x [..., in] @ w [in, out]: a 2-D dot on rows, an einsum keeping the batch dims otherwise."""
    if x.ndim == 2:
        return jnp.dot(x, w, out_sharding=partial_sums("ij,jk->ik", x, w))
    return jnp.einsum("...i,io->...o", x, w, out_sharding=partial_sums("...i,io->...o", x, w))


def partial_sums(spec: str, a: Array, b: Array) -> jax.sharding.NamedSharding | None:
    """The output sharding of `jnp.einsum(spec, a, b)` in Explicit mode (None elsewhere): `unreduced`
    over a contracted dim split alike in both (JAX 0.12 refuses that contraction without one)."""
    types = jax.typeof(a), jax.typeof(b)
    mesh = next((t.sharding.mesh for t in types if not t.sharding.mesh.empty), None)
    if mesh is None or not mesh.explicit_axes:
        return None
    terms, out = spec.split("->")
    n = types[0].ndim - len(terms.split(",")[0].replace("...", ""))  # the dims '...' stands for
    expand = lambda term: term.replace("...", "".join(chr(0x3b1 + i) for i in range(n)))  # noqa: E731
    da, db = ({letter: _partition(t, i) for i, letter in enumerate(expand(term))}
              for term, t in zip(terms.split(","), types))
    unreduced = {axis for letter in set(da) & set(db) - set(expand(out))
                 if da[letter] is not None and da[letter] == db[letter] for axis in _mesh_axes(da[letter])}
    parts = [da[letter] if letter in da else db[letter] for letter in expand(out)]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*parts, unreduced=unreduced))


def _partition(aval, dim: int):
    """The mesh axis (or tuple of axes, or None) splitting dim `dim` of `aval`."""
    spec = aval.sharding.spec.partitions
    return spec[dim] if dim < len(spec) else None


def _mesh_axes(partition) -> tuple[str, ...]:
    return (partition,) if isinstance(partition, str) else tuple(partition)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul(x: Array, w: Array, quantization: str = "none", token_axes: tuple[str, ...] = ()) -> Array:
    """x [..., in] @ w [in, out] -> [..., out] with dW as ONE dot x^T g -> [in, out]: autodiff's
    transpose(dot(g, x)) fused into AdamW column by column, several times slower on CPU (measured, JAX 0.12).
    quantization "int8": y and dx by int8 dots (twinshard/model/quantize.py), dW unquantized; "int8_dw": dW too,
    its scales over every token (`token_axes`: the mesh axes splitting them inside shard_map)."""
    return _matmul_fwd(x, w, quantization, token_axes)[0]


def _matmul_fwd(x: Array, w: Array, quantization: str, token_axes: tuple[str, ...]) -> tuple[Array, tuple]:
    if quantization == "none":
        return _product(x, w), (x, w, None)
    y, s_w = quantize.int8_forward(x, w, partial_sums("...i,io->...o", x, w))
    return y, (x, w, s_w)


def _matmul_bwd(quantization: str, token_axes: tuple[str, ...], res: tuple, g: Array) -> tuple[Array, Array]:
    x, w, s_w = res  # x: [..., in], w: [in, out], g: [..., out]; s_w [1, out]: the forward's int8 scales of w
    if s_w is not None:  # [..., in]: the forward's int8 w, g times its scales per token
        dx = quantize.int8_dx(g, w, s_w, partial_sums("...o,io->...i", g, w))
    else:
        dx = (jnp.dot(g, w.T, out_sharding=partial_sums("ij,jk->ik", g, w.T)) if g.ndim == 2
              else jnp.einsum("...o,io->...i", g, w, out_sharding=partial_sums("...o,io->...i", g, w)))
    # x^T g: ONE dot_general(x, g) -> [in, out]
    spec = partial_sums("...i,...o->io", x, g)
    if quantization == "int8_dw":
        dw = quantize.int8_dw(x, g, token_axes, spec)
    else:
        dw = jnp.einsum("...i,...o->io", x, g, out_sharding=spec)
    return cotangent_like(dx, x), cotangent_like(dw, w)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def cotangent_like(ct: Array, primal: Array) -> Array:
    """A custom backward's cotangent as autodiff would leave it: the primal's dtype, psummed over the axes
    only it varies over (docs/design.md, JAX facts), in Explicit mode resharded to the cotangent type."""
    if extra := tuple(sorted(varying_axes(ct) - varying_axes(primal))):
        ct = jax.lax.psum(ct, extra)
    elif jax.typeof(primal).sharding.mesh.explicit_axes:
        want = jax.typeof(primal).to_ct_aval().sharding
        if jax.typeof(ct).sharding.spec != want.spec:
            ct = jax.sharding.reshard(ct, want)
    return ct.astype(primal.dtype)


def varying_axes(x: Array) -> frozenset:
    """The mesh axes x varies over inside shard_map (JAX 0.12: jax.typeof(x).manual_axis_type.varying; no `.vma`)."""
    return jax.typeof(x).manual_axis_type.varying
