"""The named collectives of the shard_map twin, each a `custom_vjp` whose forward and backward
name their collective, so every collective in the compiled HLO traces back to a line here (or a
direct psum/pmean in a strategy file). All run inside `jax.shard_map(..., check_vma=True)`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from twinshard.model import layers

Array = jax.Array


# FSDP (ZeRO-3): gather a weight's shards for a matmul; scatter its gradient back.

@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fsdp_gather(w_shard: Array, axis: str, dim: int) -> Array:
    """Forward: all_gather over `axis` along `dim`; backward: psum_scatter / |axis|.

    Autodiff would transpose all_gather into the same psum_scatter, without the mean."""
    return lax.all_gather(w_shard, axis, axis=dim, tiled=True)


def _fsdp_gather_fwd(w_shard, axis, dim):
    return fsdp_gather(w_shard, axis, dim), None  # saves nothing: the shard is re-gathered


def _fsdp_gather_bwd(axis, dim, _, grad_full):
    n = lax.axis_size(axis)
    return (lax.psum_scatter(grad_full, axis, scatter_dimension=dim, tiled=True) / n,)


fsdp_gather.defvjp(_fsdp_gather_fwd, _fsdp_gather_bwd)


# HSDP: fsdp_gather inside a slice, its gradient's mean across slices in the same backward.

@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def hsdp_gather(w_shard: Array, inside: str, dim: int, across: str) -> Array:
    """Forward: all_gather over `inside` (the slice's axis) along `dim`, the result varying over `across`
    (a type change: each slice's tokens meet the same weight); backward: psum_scatter over `inside` /
    |inside|, then pmean of that shard over `across` (DCN), right where this weight's gradient is done.

    Issued per use (per layer inside the scanned backward), each DCN all-reduce can run behind the
    backward of the layers below; one pmean after the whole backward has nothing left to hide behind."""
    full = lax.all_gather(w_shard, inside, axis=dim, tiled=True)
    return lax.pcast(full, across, to="varying")  # no data moves


def _hsdp_gather_fwd(w_shard, inside, dim, across):
    return hsdp_gather(w_shard, inside, dim, across), None  # saves nothing: the shard is re-gathered


def _hsdp_gather_bwd(inside, dim, across, _, grad_full):
    (shard,) = _fsdp_gather_bwd(inside, dim, None, grad_full)  # [D, F] -> [D/inside, F], the slice's mean
    return (lax.pmean(shard, across),)  # across slices: invariant over `across`, as the weight is


hsdp_gather.defvjp(_hsdp_gather_fwd, _hsdp_gather_bwd)


# Megatron-LM's conjugate operators (Shoeybi et al. 2019, section 3, "f" and "g").

@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_tp(x: Array, axis: str) -> Array:
    """Megatron's f, before a column-parallel matmul. Forward: identity; backward: psum over `axis`."""
    return lax.pcast(x, axis, to="varying")  # a type change: no data moves


def _copy_fwd(x, axis):
    return copy_to_tp(x, axis), None


def _copy_bwd(axis, _, grad):
    return (lax.psum(grad, axis),)


copy_to_tp.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_tp(x: Array, axis: str) -> Array:
    """Megatron's g, after a row-parallel matmul. Forward: psum over `axis`; backward: identity."""
    return lax.psum(x, axis)


def _reduce_fwd(x, axis):
    return reduce_from_tp(x, axis), None


def _reduce_bwd(axis, _, grad):
    return (lax.pcast(grad, axis, to="varying"),)  # a type change: no data moves


reduce_from_tp.defvjp(_reduce_fwd, _reduce_bwd)


# Pipeline parallelism: hand a micro-batch's activations to the next stage.

def _to_next(n: int, wrap: bool = False) -> list[tuple[int, int]]:
    """s -> s+1; stage S-1 sends nothing and stage 0 receives zeros, unless `wrap` (interleaved
    chunks: S-1 -> 0, the last stage's output to the first stage's next chunk)."""
    return [(k, k + 1) for k in range(n - 1)] + ([(n - 1, 0)] if wrap else [])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def shift_to_next_stage(x: Array, axis: str, wrap: bool = False) -> Array:
    """x [B/M, T, D]. Forward: ppermute stage s -> s+1 over `axis` (wrap: S-1 -> 0 too); backward:
    ppermute s+1 -> s (wrap: 0 -> S-1)."""
    return lax.ppermute(x, axis, perm=_to_next(lax.axis_size(axis), wrap))


def _shift_fwd(x, axis, wrap):
    return shift_to_next_stage(x, axis, wrap), None


def _shift_bwd(axis, wrap, _, grad):
    return (shift_to_previous_stage(grad, axis, wrap),)


shift_to_next_stage.defvjp(_shift_fwd, _shift_bwd)


def shift_to_previous_stage(x: Array, axis: str, wrap: bool = False) -> Array:
    """`shift_to_next_stage`'s backward (ppermute s+1 -> s of x [B/M, T, D]) as forward code, for the
    schedules run by hand."""
    return lax.ppermute(x, axis, perm=[(dst, src) for src, dst in _to_next(lax.axis_size(axis), wrap)])


# A ring: every device passes a block k places on, cyclically (ring attention's K/V blocks,
# k = 1; the collective matmul's sequence chunks, k = -1).

def _ring(n: int, offset: int) -> list[tuple[int, int]]:
    return [(i, (i + offset) % n) for i in range(n)]  # device i sends to i + offset mod n


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def ring_shift(x: Array, axis: str, offset: int) -> Array:
    """Forward: ppermute i -> i + offset mod n over `axis`; backward: the reverse ring, i + offset -> i."""
    return lax.ppermute(x, axis, perm=_ring(lax.axis_size(axis), offset))


def _ring_fwd(x, axis, offset):
    return ring_shift(x, axis, offset), None


def _ring_bwd(axis, offset, _, grad):
    return (ring_shift(grad, axis, -offset),)


ring_shift.defvjp(_ring_fwd, _ring_bwd)


# Megatron sequence parallelism (Korthikanti et al. 2022, section 4.2.2: g and g-bar): the residual
# stream between tensor-parallel regions is [B, T/tensor, D]; these replace f and g around them.

SEQ = 1  # the sequence dim of the residual stream [B, T, D]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_sequence(x: Array, axis: str) -> Array:
    """[B, T/n, D] -> [B, T, D]. Forward: all_gather over `axis` along T; backward: psum_scatter along T."""
    return lax.all_gather(x, axis, axis=SEQ, tiled=True)


def _gather_seq_fwd(x, axis):
    return gather_sequence(x, axis), None  # saves nothing: the matmuls save what they read


def _gather_seq_bwd(axis, _, grad):
    return (lax.psum_scatter(grad, axis, scatter_dimension=SEQ, tiled=True),)


gather_sequence.defvjp(_gather_seq_fwd, _gather_seq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def scatter_sequence(x: Array, axis: str) -> Array:
    """[B, T, D] partial sums -> [B, T/n, D].

    Forward: psum_scatter over `axis` along T; backward: all_gather along T."""
    return lax.psum_scatter(x, axis, scatter_dimension=SEQ, tiled=True)


def _scatter_seq_fwd(x, axis):
    return scatter_sequence(x, axis), None


def _scatter_seq_bwd(axis, _, grad):
    return (lax.all_gather(grad, axis, axis=SEQ, tiled=True),)


scatter_sequence.defvjp(_scatter_seq_fwd, _scatter_seq_bwd)


# Collective matmul (Wang et al. 2023; the shard_map documentation's all-gather matmul):
# gather_sequence then the column-parallel matmuls, each hop of the gather beside a matmul.

def all_gather_matmul(x_shard: Array, ws: tuple[Array, ...], axis: str) -> tuple[Array, ...]:
    """`gather_sequence(x_shard) @ w` for each w, x_shard [B, T/n, D], w [D, out_j] -> [B, T, out_j].

    Forward: n-1 ring_shifts (k = -1) of [B, T/n, D], each beside the matmul of the chunk held;
    backward (autodiff): n-1 reverse ring_shifts carrying partial sums of dx, a ring reduce-scatter.
    On a TPU ahead-of-time compile every hop is an async collective-permute pair bracketed around
    the chunk's dots, forward and backward (measured, libtpu 0.0.50); XLA:CPU has no async collectives.
    docs/long-context.md has the schedule.
    """
    n, i = lax.axis_size(axis), lax.axis_index(axis)
    b, t, _ = x_shard.shape
    outs = [jnp.zeros((b, t * n, w.shape[1]), jnp.result_type(x_shard, w)) for w in ws]
    chunk = x_shard
    for step in range(n):
        if step < n - 1:  # the next chunk's hop, independent of this chunk's matmuls
            incoming = ring_shift(chunk, axis, -1)  # to device i-1: then chunk i+s+1 is here
        row = ((i + step) % n) * t
        outs = [lax.dynamic_update_slice_in_dim(out, layers.linear(chunk, w), row, axis=SEQ)
                for out, w in zip(outs, ws)]
        if step < n - 1:
            chunk = incoming
    return tuple(outs)


# Expert parallelism (GShard, Lepikhin et al. 2020): tokens travel to their experts' devices and
# back; an all_to_all's transpose is the inverse all_to_all.

def _to_experts(x: Array, axis: str) -> Array:
    """[E, G, C, D] -> [E/n, n G, C, D]: expert chunk j of every device to device j."""
    return lax.all_to_all(x, axis, split_axis=0, concat_axis=1, tiled=True)


def _from_experts(x: Array, axis: str) -> Array:
    """[E/n, n G, C, D] -> [E, G, C, D]: the inverse of `_to_experts`."""
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=0, tiled=True)


def _exchange(forward, backward, doc: str):
    """A custom_vjp op(x, axis): `forward` in the forward pass, `backward` on the gradient (saves nothing)."""
    op = jax.custom_vjp(lambda x, axis: forward(x, axis), nondiff_argnums=(1,))
    op.defvjp(lambda x, axis: (forward(x, axis), None), lambda axis, _, grad: (backward(grad, axis),))
    op.__doc__ = doc
    return op


dispatch_to_experts = _exchange(_to_experts, _from_experts, """dispatch_to_experts(x, axis): the capacity
    buffers of this device's G groups for all E experts, [E, G, C, D], to the devices holding the
    experts: this device gets its E/n experts' buffers from the n devices along `axis`,
    [E/n, n G, C, D]. Backward: the inverse all_to_all sends each buffer's gradient back to the
    device whose tokens filled it.""")

combine_from_experts = _exchange(_from_experts, _to_experts, """combine_from_experts(x, axis): the
    experts' outputs [E/n, n G, C, D] back to the devices whose tokens they are: [E, G, C, D].
    Backward: the all_to_all of `dispatch_to_experts`, carrying the outputs' gradient to the
    experts.""")


# Dropless expert parallelism (ModelConfig.moe_dispatch='ragged'): each device's rows, sorted by
# expert, travel as ONE ragged_all_to_all over the expert axis into a static buffer of ep A rows
# (peer j's rows in region j; docs/experts.md). XLA:CPU has no ragged-all-to-all.

class RaggedRoute(NamedTuple):
    """One ragged_all_to_all over n devices as this device sees it: each field [n] int32, by peer j."""
    send_offsets: Array  # where the rows for peer j start in this device's operand
    send_sizes: Array  # how many rows go to peer j
    peer_offsets: Array  # where they land in peer j's output (ragged_all_to_all's output_offsets)
    recv_offsets: Array  # where peer j's rows land in this device's output
    recv_sizes: Array  # how many rows come from peer j
    peer_send_offsets: Array  # where those rows started in peer j's operand

    def reverse(self) -> RaggedRoute:
        """The exchange that sends every row back where it came from."""
        return RaggedRoute(self.recv_offsets, self.recv_sizes, self.peer_send_offsets, self.send_offsets,
                           self.send_sizes, self.peer_offsets)


def expert_route(group_sizes: Array, rows: int, axis: str) -> tuple[RaggedRoute, Array]:
    """group_sizes [E] int32 (this device's `rows` rows per expert) -> (the route, received counts [n, E/n]).

    Forward: one all_to_all over `axis` of [n, E/n + 1] int32 (counts and row starts); no gradient.
    """
    n, i = lax.axis_size(axis), lax.axis_index(axis)
    counts = group_sizes.reshape(n, -1)  # [n, E/n]: to peer j, rows per expert of j
    send_sizes = jnp.sum(counts, axis=1)
    send_offsets = jnp.cumsum(send_sizes) - send_sizes
    got = lax.all_to_all(jnp.concatenate([counts, send_offsets[:, None]], axis=1), axis, 0, 0, tiled=True)
    received, peer_send_offsets = got[:, :-1], got[:, -1]  # [n, E/n], [n]
    regions = jnp.arange(n, dtype=send_sizes.dtype) * rows
    route = RaggedRoute(send_offsets, send_sizes, jnp.full((n,), i * rows, send_sizes.dtype), regions,
                        jnp.sum(received, axis=1), peer_send_offsets)
    return route, received


def _ragged_exchange(x: Array, route: RaggedRoute, rows: int, axis: str) -> Array:
    """ragged_all_to_all of x [A, ...] along `route` into zeros [rows, ...].
    The result takes the type of the buffer it writes into (JAX 0.12), so the zeros vary as x does."""
    varying = tuple(jax.typeof(x).manual_axis_type.varying | {axis})
    out = lax.pcast(jnp.zeros((rows, *x.shape[1:]), x.dtype), varying, to="varying")
    return lax.ragged_all_to_all(x, out, route.send_offsets, route.send_sizes, route.peer_offsets,
                                 route.recv_sizes, axis_name=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def ragged_dispatch(x: Array, route: RaggedRoute, rows: int, axis: str) -> Array:
    """[A, D] -> [rows, D]. Forward: ragged_all_to_all along `route`; backward: the reverse one
    (JAX 0.12's own transpose would add two all_to_alls of the offsets)."""
    return _ragged_exchange(x, route, rows, axis)


def _ragged_dispatch_fwd(x, route, rows, axis):
    return _ragged_exchange(x, route, rows, axis), (route, x.shape[0])


def _ragged_dispatch_bwd(rows, axis, saved, grad):
    route, sent = saved
    return _ragged_exchange(grad, route.reverse(), sent, axis), None


ragged_dispatch.defvjp(_ragged_dispatch_fwd, _ragged_dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def ragged_combine(x: Array, route: RaggedRoute, rows: int, axis: str) -> Array:
    """[m, D] -> [rows, D]. Forward: the reverse ragged_all_to_all of `route`; backward: `ragged_dispatch`'s."""
    return _ragged_exchange(x, route.reverse(), rows, axis)


def _ragged_combine_fwd(x, route, rows, axis):
    return _ragged_exchange(x, route.reverse(), rows, axis), (route, x.shape[0])


def _ragged_combine_bwd(rows, axis, saved, grad):
    route, received = saved
    return _ragged_exchange(grad, route, received, axis), None


ragged_combine.defvjp(_ragged_combine_fwd, _ragged_combine_bwd)


# All-to-all sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): sequence shards become
# head shards of whole sequences and back; each op is the other's backward.

HEADS, TOKENS = 1, 2  # the head and sequence dims of q, k, v [B, h, T, dh]


def _to_heads(x: Array, axis: str) -> Array:
    """[B, h, T/n, dh] -> [B, h/n, T, dh]: head chunk j of every device to device j (the true token order)."""
    return lax.all_to_all(x, axis, split_axis=HEADS, concat_axis=TOKENS, tiled=True)


def _to_seq(x: Array, axis: str) -> Array:
    """[B, h/n, T, dh] -> [B, h, T/n, dh]: the inverse of `_to_heads`."""
    return lax.all_to_all(x, axis, split_axis=TOKENS, concat_axis=HEADS, tiled=True)


seq_to_heads = _exchange(_to_heads, _to_seq, """seq_to_heads(x, axis): this device's tokens of every head,
    [B, h, T/n, dh], to whole sequences of its h/n heads, [B, h/n, T, dh]. Backward: heads_to_seq.""")

heads_to_seq = _exchange(_to_seq, _to_heads, """heads_to_seq(x, axis): whole sequences of h/n heads,
    [B, h/n, T, dh], back to this device's tokens of every head, [B, h, T/n, dh]. Backward: seq_to_heads.""")
