"""The named collectives of the shard_map twin, each with its forward and backward.

Every function here runs inside `jax.shard_map(..., check_vma=True)`. With
`check_vma`, JAX tracks which values vary over which mesh axes, and autodiff
inserts a `psum` wherever an axis-invariant value meets a varying one. We do not
leave that to autodiff: each conjugate pair below is a `custom_vjp` whose
forward and backward name their collective, so every collective in the
compiled HLO traces back to a line in this file (or a direct `psum`/`pmean` in
a strategy file).

    operator                  forward                     backward
    fsdp_gather(w, ax, dim)   all_gather over ax          psum_scatter over ax, / |ax|
    copy_to_tp(x, ax)     f   identity                    psum over ax
    reduce_from_tp(x, ax) g   psum over ax                identity
"""

from __future__ import annotations

import functools

import jax
from jax import lax

Array = jax.Array


# ----------------------------------------------------------------------------
# FSDP (ZeRO-3): gather a weight's shards for a matmul; scatter its gradient back.
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fsdp_gather(w_shard: Array, axis: str, dim: int) -> Array:
    """All-gather the FSDP shards of a weight along `dim` (forward).

    Backward: the weight gradient is reduce-scattered back to the shard layout
    and divided by the axis size, so a local-mean loss yields the gradient of the
    global mean (ZeRO's "average-reduce-scatter"). Autodiff would transpose
    all_gather into the same psum_scatter, but without the mean: writing the
    pair out makes both directions visible.
    """
    return lax.all_gather(w_shard, axis, axis=dim, tiled=True)


def _fsdp_gather_fwd(w_shard, axis, dim):
    return fsdp_gather(w_shard, axis, dim), None  # saves nothing: the shard is re-gathered


def _fsdp_gather_bwd(axis, dim, _, grad_full):
    n = lax.axis_size(axis)
    return (lax.psum_scatter(grad_full, axis, scatter_dimension=dim, tiled=True) / n,)


fsdp_gather.defvjp(_fsdp_gather_fwd, _fsdp_gather_bwd)


# ----------------------------------------------------------------------------
# Megatron-LM's conjugate operators (Shoeybi et al. 2019, section 3, "f" and "g").
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_tp(x: Array, axis: str) -> Array:
    """Megatron's f, before a column-parallel matmul: identity in forward
    (every device already holds x), all-reduce (psum) of the input gradient in
    backward (each device's column shard contributed a partial dL/dx)."""
    return lax.pcast(x, axis, to="varying")  # a type change: no data moves


def _copy_fwd(x, axis):
    return copy_to_tp(x, axis), None


def _copy_bwd(axis, _, grad):
    return (lax.psum(grad, axis),)


copy_to_tp.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_tp(x: Array, axis: str) -> Array:
    """Megatron's g, after a row-parallel matmul: all-reduce (psum) of the
    partial sums in forward, identity in backward (the gradient of a sum is
    the same for every summand)."""
    return lax.psum(x, axis)


def _reduce_fwd(x, axis):
    return reduce_from_tp(x, axis), None


def _reduce_bwd(axis, _, grad):
    return (lax.pcast(grad, axis, to="varying"),)  # a type change: no data moves


reduce_from_tp.defvjp(_reduce_fwd, _reduce_bwd)
