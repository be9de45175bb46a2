"""Mixture-of-experts feed-forward math (GShard / Switch routing with expert capacity), on arrays;
transformer.MoEFeedForward owns the weights. Notation: G groups of S tokens (G = B*T/S), E experts,
k choices per token, C buffer slots per expert per group, F each expert's SwiGLU width. The block,
shape by shape, and the dropless `moe_ffn_ragged` are in docs/experts.md."""

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
    """xg [G, S, D], router [D, E] -> (logits, probs) [G, S, E], both float32 whatever the compute dtype."""
    logits = jnp.einsum("gsd,de->gse", xg.astype(jnp.float32), router.astype(jnp.float32))
    return logits, jax.nn.softmax(logits, axis=-1)


def top_k_routing(probs: Array, k: int) -> tuple[Array, Array]:
    """probs [G, S, E] -> (weights [G, S, k] f32 renormalised, ids [G, S, k] int32), best first."""
    top, ids = jax.lax.top_k(probs, k)
    return top / jnp.sum(top, axis=-1, keepdims=True), ids


def route(x: Array, router: Array, k: int, group_size: int) -> tuple[Array, ...]:
    """x [B, T, D] -> (xg [G, S, D], logits, probs [G, S, E] f32, weights [G, S, k] f32, ids [G, S, k]
    int32, choices [G, S, k, E] int32 one-hot)."""
    b, t, d = x.shape
    xg = x.reshape(b * t // group_size, group_size, d)  # [G, S, D]: S consecutive tokens of one sequence
    logits, probs = router_probs(xg, router)  # [G, S, E] f32
    weights, ids = top_k_routing(probs, k)  # [G, S, k]
    return xg, logits, probs, weights, ids, jax.nn.one_hot(ids, router.shape[-1], dtype=jnp.int32)


def router_losses(logits: Array, probs: Array, chosen: Array) -> tuple[Array, Array]:
    """(aux, z) float32 [] from logits, probs [G, S, E] and the one-hot choices before any capacity drop."""
    _, s, k, e = chosen.shape
    assigned = jnp.sum(chosen, axis=(1, 2)) / (k * s)  # f_i per group [G, E]: no gradient (counts)
    aux = jnp.mean(e * jnp.sum(assigned * jnp.mean(probs, axis=1), axis=-1))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return aux, z


def buffer_slots(choices: Array) -> Array:
    """choices [G, S, k, E] -> slot [G, S, k] int32 in its expert's buffer, choice-major (a token loses
    its second expert to overflow first)."""
    g, s, k, e = choices.shape
    order = choices.transpose(0, 2, 1, 3).reshape(g, k * s, e)  # [G, k*S, E], choice-major
    taken = (jnp.cumsum(order, axis=1) - 1).reshape(g, k, s, e).transpose(0, 2, 1, 3)  # [G, S, k, E]
    return jnp.sum(taken * choices, axis=-1)


def moe_ffn(x: Array, router: Array, w1: Array, w2: Array, w3: Array, *, experts_per_token: int,
            capacity: int, group_size: int, dispatch: Callable[[Array], Array] = _identity,
            combine: Callable[[Array], Array] = _identity) -> tuple[Array, Stats]:
    """x [B, T, D] -> (y [B, T, D], router stats: aux, z, tokens_per_expert [E], dropped []); w1, w3
    [E', D, F], w2 [E', F, D] with E' = E or E/ep (`dispatch` / `combine` move the [E, G, C, D] buffers)."""
    b, t, d = x.shape
    s, k = group_size, experts_per_token
    xg, logits, probs, weights, ids, choices = route(x, router, k, s)
    slot = buffer_slots(choices)  # [G, S, k]
    keep = slot < capacity  # [G, S, k]
    # one-hot of the kept slot [G, S, k, C] (index `capacity`, a dropped choice, is all zeros)
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


# Dropless: the k N assignments as rows sorted by expert, through jax.lax.ragged_dot.

def _no_exchange(rows: Array, group_sizes: Array) -> tuple[Array, Array, None]:
    return rows, group_sizes, None


def _no_return(rows: Array, plan: None) -> Array:
    return rows


def inverse_permutation(order: Array) -> Array:
    """The inverse of permutation `order` (one integer scatter, no second sort)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def expert_ffn_rows(rows: Array, w1: Array, w2: Array, w3: Array, group_sizes: Array) -> Array:
    """SwiGLU of each expert on rows [A, D] grouped by expert (group_sizes [E'] int32; rows past their
    sum give 0), w1, w3 [E', D, F], w2 [E', F, D] -> [A, D]."""
    h1 = jax.lax.ragged_dot(rows, w1, group_sizes)  # [A, F]
    h3 = jax.lax.ragged_dot(rows, w3, group_sizes)
    return jax.lax.ragged_dot(layers.swiglu_gate(h1, h3), w2, group_sizes)


def moe_ffn_ragged(x: Array, router: Array, w1: Array, w2: Array, w3: Array, *, experts_per_token: int,
                   group_size: int, dispatch_rows: Callable = _no_exchange,
                   combine_rows: Callable = _no_return) -> tuple[Array, Stats]:
    """`moe_ffn` without capacity (moe_dispatch='ragged'): the same routing, aux, z and y up to
    rounding, nothing dropped; the N k assignments sorted by expert into rows [A, D] run through
    ragged_dot. dispatch_rows(rows, sizes) -> (rows', sizes', plan) and combine_rows(rows', plan)
    are the strategy's hooks (manual ep: ragged_all_to_all over `expert`)."""
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
