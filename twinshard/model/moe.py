"""Mixture-of-experts feed-forward math (GShard / Switch routing with expert capacity), on arrays.

Pure functions like twinshard/model/layers.py; the NNX module that owns the weights is
transformer.MoEFeedForward. Notation: B batch, T sequence, D d_model, G groups of S tokens
(G = B*T/S), E experts, k choices per token, C buffer slots per expert per group
(ModelConfig.expert_capacity), F each expert's SwiGLU width.

One block, for x [B, T, D] (after ln2):

    router logits   [G, S, E]  float32: x @ router, softmax -> probs
    top-k           [G, S, k]  expert ids and weights, renormalised over the k (k = 1: weight 1)
    buffer slot     [G, S, k]  per expert, choice-major: all first choices of the group in token
                               order, then all second choices, ...; slot >= C: dropped there
    dispatch        [G, S, E, C]  one-hot of the kept slots (compute dtype)
    combine         [G, S, E, C]  the same times the token's weight for that expert
    expert input    [E, G, C, D]  einsum(dispatch, x)           -> dispatch hook
    experts         [E', G', C, D] SwiGLU per expert (E' = E, or E/ep under expert parallelism)
    expert output   [E, G, C, D]                                 <- combine hook
    y               [B, T, D]  einsum(combine, expert output)

A token dropped at one of its experts gets nothing from that expert; dropped at all of them, its
block output is exactly 0 and the residual carries it through. Capacity is per group, and a group
is part of one sequence, so a device holding whole groups drops exactly what one device drops.

`moe_ffn_ragged` (ModelConfig.moe_dispatch='ragged') is the dropless block without buffers: the
same routing, the N k assignments as rows sorted by expert through jax.lax.ragged_dot, and the
hooks `dispatch_rows` / `combine_rows` in place of `dispatch` / `combine`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from twinshard.model import layers

Array = jax.Array
Stats = dict[str, Array]


def _identity(x: Array) -> Array:
    return x


def router_probs(xg: Array, router: Array) -> tuple[Array, Array]:
    """xg [G, S, D] (compute dtype), router [D, E] -> (logits, probs) [G, S, E], both float32:
    routing decisions are made on float32 logits whatever the compute dtype."""
    logits = jnp.einsum("gsd,de->gse", xg.astype(jnp.float32), router.astype(jnp.float32))
    return logits, jax.nn.softmax(logits, axis=-1)


def top_k_routing(probs: Array, k: int) -> tuple[Array, Array]:
    """probs [G, S, E] -> (weights [G, S, k] float32 renormalised to sum 1, ids [G, S, k] int32),
    the k most probable experts of each token, best first (distinct experts)."""
    top, ids = jax.lax.top_k(probs, k)
    return top / jnp.sum(top, axis=-1, keepdims=True), ids


def route(x: Array, router: Array, k: int, group_size: int) -> tuple[Array, ...]:
    """x [B, T, D] -> (xg [G, S, D], logits and probs [G, S, E] f32, weights [G, S, k] f32,
    ids [G, S, k] int32, choices [G, S, k, E] int32 one-hot of the ids): every dispatch's routing."""
    b, t, d = x.shape
    xg = x.reshape(b * t // group_size, group_size, d)  # [G, S, D]: S consecutive tokens of one sequence
    logits, probs = router_probs(xg, router)  # [G, S, E] f32
    weights, ids = top_k_routing(probs, k)  # [G, S, k]
    return xg, logits, probs, weights, ids, jax.nn.one_hot(ids, router.shape[-1], dtype=jnp.int32)


def router_losses(logits: Array, probs: Array, chosen: Array) -> tuple[Array, Array]:
    """(aux, z) float32 [] from the router's logits, probs [G, S, E] and chosen [G, S, k, E] (the
    one-hot choices, float32, counted before any capacity drop): moe_ffn's docstring."""
    _, s, k, e = chosen.shape
    assigned = jnp.sum(chosen, axis=(1, 2)) / (k * s)  # f_i per group [G, E]: no gradient (counts)
    aux = jnp.mean(e * jnp.sum(assigned * jnp.mean(probs, axis=1), axis=-1))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return aux, z


def buffer_slots(choices: Array) -> Array:
    """choices [G, S, k, E] one-hot int32 of each token's k experts -> slot [G, S, k] int32: the
    choice's place in its expert's buffer, choice-major (every first choice of the group, in token
    order, before any second choice), so a token loses its second expert to overflow first."""
    g, s, k, e = choices.shape
    order = choices.transpose(0, 2, 1, 3).reshape(g, k * s, e)  # [G, k*S, E], choice-major
    taken = (jnp.cumsum(order, axis=1) - 1).reshape(g, k, s, e).transpose(0, 2, 1, 3)  # [G, S, k, E]
    return jnp.sum(taken * choices, axis=-1)


def moe_ffn(x: Array, router: Array, w1: Array, w2: Array, w3: Array, *, experts_per_token: int,
            capacity: int, group_size: int, dispatch: Callable[[Array], Array] = _identity,
            combine: Callable[[Array], Array] = _identity) -> tuple[Array, Stats]:
    """The MoE feed-forward of x [B, T, D] -> (y [B, T, D] in x's dtype, this layer's router stats).

    router [D, E]; w1, w3 [E', D, F]; w2 [E', F, D], as the strategy hands them (E' = E, or the
    E/ep local experts under expert parallelism: the expert math reads E' from its inputs).
    `dispatch` / `combine` (Parallelism's hooks) move the [E, G, C, D] buffers to and from the
    devices that hold the experts; identity on one device.

    Stats (per layer; a strategy that splits the groups over devices averages aux and z and
    sums the counts):
        aux                float32 []  Switch load-balancing loss, E sum_i f_i P_i per group
                                       (f_i: share of the group's k*S assignments, before the
                                       capacity drop, sent to expert i; P_i: mean router
                                       probability of expert i), mean over groups; 1 when uniform
        z                  float32 []  ST-MoE z-loss: mean over tokens of logsumexp(logits)^2
        tokens_per_expert  int32 [E]   kept assignments per expert, summed over groups
        dropped            int32 []    assignments dropped by the capacity limit
    """
    b, t, d = x.shape
    s, k = group_size, experts_per_token
    xg, logits, probs, weights, ids, choices = route(x, router, k, s)
    slot = buffer_slots(choices)  # [G, S, k]
    keep = slot < capacity  # [G, S, k]
    # one-hot of the kept slot [G, S, k, C]: one_hot of index `capacity` (a dropped choice) is all zeros
    slots = jax.nn.one_hot(jnp.where(keep, slot, capacity), capacity, dtype=jnp.float32)
    chosen = choices.astype(jnp.float32)
    dispatch_mask = jnp.einsum("gske,gskc->gsec", chosen, slots).astype(x.dtype)  # [G, S, E, C] 0/1
    combine_weights = jnp.einsum("gske,gskc->gsec", chosen * weights[..., None], slots).astype(x.dtype)

    expert_in = dispatch(jnp.einsum("gsec,gsd->egcd", dispatch_mask, xg))  # [E', G', C, D]
    h1 = jnp.einsum("egcd,edf->egcf", expert_in, w1)  # [E', G', C, F]
    h3 = jnp.einsum("egcd,edf->egcf", expert_in, w3)
    expert_out = combine(jnp.einsum("egcf,efd->egcd", layers.swiglu_gate(h1, h3), w2))  # [E, G, C, D]
    y = jnp.einsum("gsec,egcd->gsd", combine_weights, expert_out).reshape(b, t, d)

    aux, z = router_losses(logits, probs, chosen)
    kept = choices * keep[..., None].astype(jnp.int32)  # [G, S, k, E]
    stats = {"aux": aux, "z": z, "tokens_per_expert": jnp.sum(kept, axis=(0, 1, 2)),
             "dropped": jnp.sum(jnp.logical_not(keep), dtype=jnp.int32)}
    return y, stats


# ----------------------------------------------------------------------------
# Dropless: the k N assignments as rows sorted by expert, through jax.lax.ragged_dot.
# ----------------------------------------------------------------------------

def _no_exchange(rows: Array, group_sizes: Array) -> tuple[Array, Array, None]:
    return rows, group_sizes, None


def _no_return(rows: Array, plan: None) -> Array:
    return rows


def inverse_permutation(order: Array) -> Array:
    """order [n] (a permutation of 0..n-1) -> inverse [n] with inverse[order[i]] = i, so
    `a[order][inverse] == a`: one integer scatter, no second sort."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def expert_ffn_rows(rows: Array, w1: Array, w2: Array, w3: Array, group_sizes: Array) -> Array:
    """SwiGLU of each expert on its rows: rows [A, D] grouped by expert (group_sizes [E'] int32,
    expert i's rows after those of experts < i; rows past their sum give 0), w1, w3 [E', D, F],
    w2 [E', F, D] -> [A, D]."""
    h1 = jax.lax.ragged_dot(rows, w1, group_sizes)  # [A, F]
    h3 = jax.lax.ragged_dot(rows, w3, group_sizes)
    return jax.lax.ragged_dot(layers.swiglu_gate(h1, h3), w2, group_sizes)


def moe_ffn_ragged(x: Array, router: Array, w1: Array, w2: Array, w3: Array, *, experts_per_token: int,
                   group_size: int, dispatch_rows: Callable = _no_exchange,
                   combine_rows: Callable = _no_return) -> tuple[Array, Stats]:
    """`moe_ffn` without capacity (ModelConfig.moe_dispatch='ragged', capacity_factor 0): the same
    routing, weights, aux and z, and the same y up to float rounding, with nothing dropped and no
    [E, G, C, D] buffers. For x [B, T, D], N = B T tokens, A = N k assignments:

        route           as moe_ffn: ids, weights [G, S, k]; group_size only shapes aux's groups
        sort            [A]        a stable argsort of the ids (token-major: assignment a is token
                                   a // k's choice a % k): grouped by expert, token order within one
        rows            [A, D]     x's row of each sorted assignment; group sizes [E] tokens per expert
        dispatch_rows   [A', D]    the rows of this device's experts grouped by expert, sizes [E']
        experts         [A', D]    expert_ffn_rows: three jax.lax.ragged_dot and SwiGLU
        combine_rows    [A, D]     back in the sorted order of `rows`
        y               [B, T, D]  unsorted (inverse permutation), times each choice's weight,
                                   summed over the k choices

    dispatch_rows(rows, sizes) -> (rows', sizes', plan) and combine_rows(rows', plan) are
    Parallelism's hooks (identity on one device; manual ep: ragged_all_to_all over `expert`).
    Stats as moe_ffn's, dropped = 0 and tokens_per_expert the group sizes.
    """
    b, t, d = x.shape
    k = experts_per_token
    xg, logits, probs, weights, ids, choices = route(x, router, k, group_size)
    order = jnp.argsort(ids.reshape(-1), stable=True)  # [A]: by expert, then by token
    sizes = jnp.sum(choices, axis=(0, 1, 2))  # [E] int32: assignments per expert (they sum to A)
    rows, local_sizes, plan = dispatch_rows(xg.reshape(b * t, d)[order // k], sizes)
    out = combine_rows(expert_ffn_rows(rows, w1, w2, w3, local_sizes), plan)  # [A, D], sorted
    out = out[inverse_permutation(order)].reshape(b * t, k, d)  # [N, k, D], token-major
    y = jnp.einsum("nkd,nk->nd", out, weights.reshape(b * t, k).astype(x.dtype)).reshape(b, t, d)
    aux, z = router_losses(logits, probs, choices.astype(jnp.float32))
    stats = {"aux": aux, "z": z, "tokens_per_expert": sizes, "dropped": jnp.zeros((), jnp.int32)}
    return y, stats
