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
    shift_to_next_stage(x, ax) ppermute s -> s+1         ppermute s+1 -> s
    ring_shift(x, ax, k)      ppermute i -> i+k mod n     ppermute i+k -> i mod n (the reverse ring)
    gather_sequence(x, ax)    all_gather over ax along T  psum_scatter over ax along T
    scatter_sequence(x, ax)   psum_scatter over ax along T all_gather over ax along T
    all_gather_matmul(x, ws, ax)  n-1 ring_shifts (k = -1),    n-1 reverse ring_shifts:
                              each beside the matmul of     a ring reduce-scatter of dx
                              the chunk held
    dispatch_to_experts(x, ax)  all_to_all over ax:         the inverse all_to_all
                              [E, G, C, D] -> [E/n, nG, C, D] ([E/n, nG, C, D] -> [E, G, C, D])
    combine_from_experts(x, ax) the inverse all_to_all      all_to_all over ax
    ragged_dispatch(x, route, m, ax)  ragged_all_to_all     the reverse ragged_all_to_all
                              over ax: [A, D] -> [m, D]     [m, D] -> [A, D] (route.reverse())
    ragged_combine(x, route, a, ax)   the reverse           ragged_all_to_all over ax
                              ragged_all_to_all [m, D] -> [a, D]    ([a, D] -> [m, D])
    expert_route(sizes, a, ax)  all_to_all over ax of the   - (integers: no gradient)
                              per-expert counts [n, E/n + 1]
    seq_to_heads(x, ax)       all_to_all over ax:         heads_to_seq of the gradient
                              [B, h, T/n, dh] -> [B, h/n, T, dh]
    heads_to_seq(x, ax)       the inverse all_to_all      seq_to_heads of the gradient
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from twinshard.model import layers

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


# ----------------------------------------------------------------------------
# Pipeline parallelism: hand a micro-batch's activations to the next stage.
# ----------------------------------------------------------------------------

def _to_next(n: int) -> list[tuple[int, int]]:
    return [(k, k + 1) for k in range(n - 1)]  # stage S-1 sends nothing; stage 0 receives zeros


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def shift_to_next_stage(x: Array, axis: str) -> Array:
    """Pipeline hand-off (forward): stage s sends x [B/M, T, D] to stage s+1, a ppermute
    (collective-permute) over `axis`; stage 0 receives zeros.

    Backward: the reverse ppermute, stage s+1 -> s: the gradient of the activations
    stage s+1 received goes back to the stage that produced them (stage S-1 receives
    zeros). Autodiff would transpose the ppermute into the same reverse permutation;
    writing the pair out names both directions."""
    return lax.ppermute(x, axis, perm=_to_next(lax.axis_size(axis)))


def _shift_fwd(x, axis):
    return shift_to_next_stage(x, axis), None


def _shift_bwd(axis, _, grad):
    return (shift_to_previous_stage(grad, axis),)


shift_to_next_stage.defvjp(_shift_fwd, _shift_bwd)


def shift_to_previous_stage(x: Array, axis: str) -> Array:
    """1F1B's backward hand-off, written by hand (never differentiated): stage s+1 sends the
    gradient of the activations it received, x [B/M, T, D], back to stage s (ppermute over
    `axis`); the last stage receives zeros. It is `shift_to_next_stage`'s backward, run as
    forward code because 1F1B interleaves the backward passes itself."""
    return lax.ppermute(x, axis, perm=[(dst, src) for src, dst in _to_next(lax.axis_size(axis))])


# ----------------------------------------------------------------------------
# A ring: every device passes a block k places on, cyclically (ring attention's K/V
# blocks, k = 1; the collective matmul's sequence chunks, k = -1).
# ----------------------------------------------------------------------------

def _ring(n: int, offset: int) -> list[tuple[int, int]]:
    return [(i, (i + offset) % n) for i in range(n)]  # device i sends to i + offset mod n


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def ring_shift(x: Array, axis: str, offset: int) -> Array:
    """Pass x to the device `offset` places on in the ring over `axis`: i -> i + offset mod n, a
    collective-permute (device i then holds the block of device i - offset).

    Backward: the reverse ring, i + offset -> i: the gradient of the block goes back to the
    device that sent it. Autodiff would transpose the ppermute the same way; the pair written
    out names both directions (and lets a remat policy find the received block:
    ring_attention.saves_ring_shifts)."""
    return lax.ppermute(x, axis, perm=_ring(lax.axis_size(axis), offset))


def _ring_fwd(x, axis, offset):
    return ring_shift(x, axis, offset), None


def _ring_bwd(axis, offset, _, grad):
    return (ring_shift(grad, axis, -offset),)


ring_shift.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------
# Megatron sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
# Recomputation in Large Transformer Models", section 4.2.2: g and g-bar). The
# residual stream between the tensor-parallel regions is split along the sequence,
# [B, T/tensor, D]; these replace Megatron's f and g around those regions.
# An all-reduce is a reduce-scatter followed by an all-gather: TP's g (psum) becomes
# the reduce-scatter half, and the all-gather half moves to the next region's entry.
# ----------------------------------------------------------------------------

SEQ = 1  # the sequence dim of the residual stream [B, T, D]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_sequence(x: Array, axis: str) -> Array:
    """Before a column-parallel matmul (sequence parallelism's replacement for f): all-gather
    the sequence shards, x [B, T/n, D] -> [B, T, D], in `axis` order (shard i holds tokens
    [i T/n, (i+1) T/n)).

    Backward: each device's column shard contributed a partial dL/dx for EVERY token, and
    each device needs the sum for its own tokens only: a reduce-scatter (psum_scatter) along T,
    [B, T, D] -> [B, T/n, D] (TP's f all-reduced the whole [B, T, D] instead)."""
    return lax.all_gather(x, axis, axis=SEQ, tiled=True)


def _gather_seq_fwd(x, axis):
    return gather_sequence(x, axis), None  # saves nothing: the matmuls save what they read


def _gather_seq_bwd(axis, _, grad):
    return (lax.psum_scatter(grad, axis, scatter_dimension=SEQ, tiled=True),)


gather_sequence.defvjp(_gather_seq_fwd, _gather_seq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def scatter_sequence(x: Array, axis: str) -> Array:
    """After a row-parallel matmul (sequence parallelism's replacement for g): sum the partial
    outputs over `axis` and keep this device's sequence shard, a reduce-scatter (psum_scatter)
    along T, [B, T, D] -> [B, T/n, D]. A sum, not a mean: each device holds one summand.

    Backward: every device's partial output fed the same sum, so each needs the gradient of
    the whole sequence: an all-gather along T, [B, T/n, D] -> [B, T, D]."""
    return lax.psum_scatter(x, axis, scatter_dimension=SEQ, tiled=True)


def _scatter_seq_fwd(x, axis):
    return scatter_sequence(x, axis), None


def _scatter_seq_bwd(axis, _, grad):
    return (lax.all_gather(grad, axis, axis=SEQ, tiled=True),)


scatter_sequence.defvjp(_scatter_seq_fwd, _scatter_seq_bwd)


# ----------------------------------------------------------------------------
# Collective matmul (Wang et al. 2023, "Overlap Communication with Dependent Computation
# via Decomposition in Large Deep Learning Models"; the shard_map documentation's
# all-gather matmul): gather_sequence followed by the column-parallel matmuls, decomposed
# so that each hop of the gather hides behind a matmul.
# ----------------------------------------------------------------------------

def all_gather_matmul(x_shard: Array, ws: tuple[Array, ...], axis: str) -> tuple[Array, ...]:
    """all_gather(x_shard along T over `axis`) @ w for each w, without the all-gather.

    x_shard: [B, T/n, D], this device's (i's) sequence chunk; ws: [D, out_j] each (q, k, v
    or w1, w3 columns) -> [B, T, out_j] each, as `gather_sequence(x) @ w`.
    n steps: at step s this device holds chunk (i + s) mod n; it multiplies it by every w into
    rows [(i+s) mod n * T/n, ...) of the outputs while a `ring_shift` (collective-permute)
    passes the chunk to device i-1 and brings chunk (i + s + 1) mod n from device i+1. The matmul and
    the send of step s do not depend on each other, so the scheduler may run them at once:
    n-1 collective-permutes of [B, T/n, D] move what the all-gather moved on a ring, (n-1)/n
    of [B, T, D] per device.

    Backward (autodiff of the loop; each hop's backward is ring_shift's, the reverse ring
    i -> i+1): each step's input gradient dY[chunk] @ w^T is added to the gradient
    arriving from the step after it, so the backward pass is n-1 collective-permutes of
    [B, T/n, D] that carry partial sums around the ring: a ring reduce-scatter of dx (what
    gather_sequence's backward psum_scatter does in one collective), each hop beside the
    matmul of a chunk's gradient. The weight gradient sum over steps of chunk^T dY[chunk]
    reads every chunk: under remat none they are saved (n of [B, T/n, D], the gathered x's
    size), under a remat policy the forward ppermutes run again in the backward pass.

    On a TPU ahead-of-time compile every hop is an async collective-permute pair that the
    scheduler brackets around the chunk's dots, forward and backward (measured, libtpu 0.0.50;
    read it with `python -m launch.collectives --collective_matmul --topology=v5e:2x2 --hlo=...`);
    XLA:CPU has no async collectives, so the CPU program cannot show the overlap.
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


# ----------------------------------------------------------------------------
# Expert parallelism (GShard, Lepikhin et al. 2020): tokens travel to the devices holding
# their experts and back. An all_to_all's transpose is the inverse all_to_all, so the two
# operators below are each other's backward.
# ----------------------------------------------------------------------------

def _to_experts(x: Array, axis: str) -> Array:
    """[E, G, C, D] -> [E/n, n G, C, D]: expert chunk j of every device goes to device j, which
    stacks the n senders' groups in device order."""
    return lax.all_to_all(x, axis, split_axis=0, concat_axis=1, tiled=True)


def _from_experts(x: Array, axis: str) -> Array:
    """[E/n, n G, C, D] -> [E, G, C, D]: the inverse of `_to_experts`."""
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=0, tiled=True)


def _exchange(forward, backward, doc: str):
    """A custom_vjp op(x, axis): `forward` in the forward pass, `backward` on the gradient (it
    saves nothing); the two expert exchanges below are this with the roles swapped."""
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


# ----------------------------------------------------------------------------
# Dropless expert parallelism (ModelConfig.moe_dispatch='ragged'; MaxText's and levanter's):
# each device's assignments, rows sorted by expert, travel as ONE ragged_all_to_all over the
# expert axis, only as many rows to each peer as its experts were chosen. The output buffer needs
# a static size: peer j's rows land in region j of ep A rows (A: every device's assignments), the
# worst case of all ep A landing on one device, so no capacity check is needed. XLA:CPU has no
# ragged-all-to-all (manual_parallel/ep.py refuses CPU devices).
# ----------------------------------------------------------------------------

class RaggedRoute(NamedTuple):
    """One ragged_all_to_all over an axis of n devices, as this device sees it: each field [n]
    int32, indexed by peer j (this device included)."""
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
    """group_sizes [E] int32: this device's `rows` assignments per expert, its rows sorted by
    expert; peer j holds experts j E/n .. (j+1) E/n - 1, so the rows for j are contiguous.
    -> (the route of `ragged_dispatch`, received counts [n, E/n]: peer j's rows per local expert).

    One small all_to_all over `axis` of [n, E/n + 1] int32: to each peer its experts' counts and
    where their rows start here (the offsets the reverse exchange writes to). Peer j's rows land
    in region j of n * rows (recv_offsets j * rows): every device knows every region's start, so
    the offsets need no second exchange."""
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
    """ragged_all_to_all of x [A, ...] along `route` into zeros [rows, ...] (rows not received stay 0).
    The result takes the type of the buffer it writes into (JAX 0.12), so the zeros are cast to
    vary as x does (and over `axis`): check_vma then sees the exchanged rows as varying."""
    varying = tuple(jax.typeof(x).manual_axis_type.varying | {axis})
    out = lax.pcast(jnp.zeros((rows, *x.shape[1:]), x.dtype), varying, to="varying")
    return lax.ragged_all_to_all(x, out, route.send_offsets, route.send_sizes, route.peer_offsets,
                                 route.recv_sizes, axis_name=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def ragged_dispatch(x: Array, route: RaggedRoute, rows: int, axis: str) -> Array:
    """This device's assignment rows x [A, D] to the devices of their experts along `route`
    (expert_route): [rows, D], peer j's rows from route.recv_offsets[j]. Backward: the reverse
    ragged_all_to_all, each row's gradient back to the device and row it came from (JAX 0.12's
    own transpose would add two all_to_alls of the offsets, which the route already holds)."""
    return _ragged_exchange(x, route, rows, axis)


def _ragged_dispatch_fwd(x, route, rows, axis):
    return _ragged_exchange(x, route, rows, axis), (route, x.shape[0])


def _ragged_dispatch_bwd(rows, axis, saved, grad):
    route, sent = saved
    return _ragged_exchange(grad, route.reverse(), sent, axis), None


ragged_dispatch.defvjp(_ragged_dispatch_fwd, _ragged_dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def ragged_combine(x: Array, route: RaggedRoute, rows: int, axis: str) -> Array:
    """The experts' outputs x [m, D], where `ragged_dispatch` along `route` put their inputs, back
    to the devices and rows they came from: [rows, D]. Backward: `ragged_dispatch`'s exchange."""
    return _ragged_exchange(x, route.reverse(), rows, axis)


def _ragged_combine_fwd(x, route, rows, axis):
    return _ragged_exchange(x, route.reverse(), rows, axis), (route, x.shape[0])


def _ragged_combine_bwd(rows, axis, saved, grad):
    route, received = saved
    return _ragged_exchange(grad, route, received, axis), None


ragged_combine.defvjp(_ragged_combine_fwd, _ragged_combine_bwd)


# ----------------------------------------------------------------------------
# All-to-all sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): attention's sequence
# shards become head shards of whole sequences and back; each op is the other's backward.
# ----------------------------------------------------------------------------

HEADS, TOKENS = 1, 2  # the head and sequence dims of q, k, v [B, h, T, dh]


def _to_heads(x: Array, axis: str) -> Array:
    """[B, h, T/n, dh] -> [B, h/n, T, dh]: head chunk j of every device to device j, which stacks
    the n senders' tokens in device order (the contiguous layout: the true order)."""
    return lax.all_to_all(x, axis, split_axis=HEADS, concat_axis=TOKENS, tiled=True)


def _to_seq(x: Array, axis: str) -> Array:
    """[B, h/n, T, dh] -> [B, h, T/n, dh]: the inverse of `_to_heads`."""
    return lax.all_to_all(x, axis, split_axis=TOKENS, concat_axis=HEADS, tiled=True)


seq_to_heads = _exchange(_to_heads, _to_seq, """seq_to_heads(x, axis): this device's tokens of every head,
    [B, h, T/n, dh], to whole sequences of its h/n heads, [B, h/n, T, dh]. Backward: heads_to_seq.""")

heads_to_seq = _exchange(_to_seq, _to_heads, """heads_to_seq(x, axis): whole sequences of h/n heads,
    [B, h/n, T, dh], back to this device's tokens of every head, [B, h, T/n, dh]. Backward: seq_to_heads.""")
