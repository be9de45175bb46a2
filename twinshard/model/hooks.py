"""The seam between the mesh-free model and a parallelism strategy: the model calls a hook of a
`Parallelism` object; this base class is the single-device behaviour (-: in the table below).

    hook                    auto_parallel (GSPMD)     manual_parallel (shard_map)   explicit_parallel (types)
    weight(w, axes)         FSDP: pin the use layout  FSDP: all_gather over data;   FSDP: reshard to
                                                      TP: a replicated kv weight's  [D, F]{R:data}
                                                      own kv head
    constrain(x, axes)      with_sharding_constraint  -                             check the declared type
    enter_tensor_parallel   tp_sp: whole T            Megatron f: identity / psum   f: reshard to {R:tensor}
    exit_tensor_parallel    tp_sp: T shards           Megatron g: psum / identity   g: reshard {U:tensor} away
    column_parallel(x, ws)  tp_sp: region layouts     sequence parallelism: gather  -
    row_parallel(x, w)                                T; collective matmul: fused
    positions(t)            cp: true positions        cp: this shard's positions    -
    attention(q, k, v)      splash in a shard_map;    cp: ring attention            splash in a shard_map
                            cp: masked by positions
    embed(ids, table)       tp_sp: then T shards      vocab-parallel lookup + psum  .at[ids].get(out_sharding);
                                                                                    TP: typed {U:tensor}
    token_loss(...)         -                         vocab-parallel cross-entropy  TP: manual's, in a shard_map
    chunked_token_loss(...) per batch shard (vmap)    the same, chunk by chunk      -
    layer_stack(...)        pp: stages under vmap     - (manual pp.py: own loop)    - (no pipelines)
    layer_policy(policy)    -                         + save psum outputs; FSDP:    + save reductions; FSDP:
                                                      never save a gathered weight  the same
    head(lm_head, x)        -                         FSDP: checkpoint (re-gather)  FSDP: the same
    gather_step(params,..)  FSDP: matrices whole      FSDP: all_gather once         FSDP: reshard once
    dispatch(x) / combine   ep: the [E, G, C, D]      ep: all_to_all over `expert`  - (no experts)
                            buffers' layout           (combine: the inverse)
    dispatch_rows(r, sizes) - (the model's own math)  ep, moe_dispatch=ragged:      - (no experts)
    combine_rows(r, plan)                             ragged_all_to_all, regrouped

The hooks run in the scan body over the stacked layers, on ONE layer's weight (W1 as [D, F]).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from twinshard.model import layers, loss

Array = jax.Array
Policy = Callable[..., bool]  # a jax.checkpoint policy (twinshard/model/remat.py names them)
Axes = tuple[str | None, ...]


class Parallelism:
    """Single-device behaviour; subclasses add sharding or collectives."""

    flat_rows = True  # the matmuls run on flattened [B*T, in] rows (layers.linear's `flat`)

    def weight(self, w: Array, axes: Axes) -> Array:
        """The full weight for a matmul (FSDP gathers its shards here); one layer's, in the scan."""
        return w

    def constrain(self, x: Array, axes: Axes) -> Array:
        """Pin an activation's layout (GSPMD hint); identity elsewhere."""
        return x

    def enter_tensor_parallel(self, x: Array) -> Array:
        """Before a column-parallel matmul (Megatron's f)."""
        return x

    def exit_tensor_parallel(self, x: Array) -> Array:
        """After a row-parallel matmul (Megatron's g)."""
        return x

    def column_parallel(self, x: Array, ws: tuple[Array, ...], axes: Axes | None = None) -> tuple[Array, ...]:
        """x [B, T, D] @ each w [D, out] -> [B, T, out] each, after Megatron's f; axes: each output's
        logical axis (None: the SwiGLU's mlp)."""
        x = self.enter_tensor_parallel(x)
        return layers.linears(x, ws, self.flat_rows)

    def row_parallel(self, x: Array, w: Array) -> Array:
        """x [B, T, in] @ w [in, D] -> [B, T, D]: the row-parallel matmul, then Megatron's g."""
        return self.exit_tensor_parallel(layers.linear(x, w, self.flat_rows))

    def positions(self, t: int) -> Array:
        """Positions in the whole sequence of this program's t tokens (RoPE): 0..t-1."""
        return jnp.arange(t)

    def attention(self, q: Array, k: Array, v: Array, impl: str = "auto", block: int = 0) -> Array:
        """Causal attention of this program's q, k, v [B, h, T, dh] (layers.causal_attention)."""
        return layers.causal_attention(q, k, v, impl, block=block)

    def layer_stack(self, stacked: dict, cfg, x: Array, scan: Callable[..., Array]) -> Array:
        """The L stacked blocks [L, ...] on x [B, T, D] with the model's `scan(stacked, cfg, x, hooks)`;
        a pipeline splits the stack into stages (auto_parallel/pp.py)."""
        return scan(stacked, cfg, x, self)

    def embed(self, ids: Array, table: Array) -> Array:
        return layers.embedding(ids, table)

    def layer_policy(self, policy: Policy | None) -> Policy | None:
        """The jax.checkpoint policy of one scanned layer, given ModelConfig.remat's (None: none)."""
        return policy

    def gather_step(self, params: Any, axes: Any, specs: Any, dtype: str) -> Any:
        """The params every micro-batch of a step reads (FSDP: each matrix gathered once)."""
        return params

    def head(self, lm_head: Callable[[Array], Array], x: Array) -> Array:
        """lm_head(x): x [B, T, D] -> logits [B, T, V(_local)] (or the chunked loss [B, T])."""
        return lm_head(x)

    def dispatch(self, x: Array) -> Array:
        """x [E, G, C, D] capacity buffers to the devices of their experts (manual ep: [E/ep, G*ep, C, D])."""
        return x

    def combine(self, x: Array) -> Array:
        """The experts' outputs back to the devices of their groups: the inverse of `dispatch`."""
        return x

    def dispatch_rows(self, rows: Array, group_sizes: Array) -> tuple[Array, Array, Any]:
        """Dropless path: rows [A, D] sorted by expert, group_sizes [E] -> (this device's experts' rows
        [A', D], their group sizes [E'], a plan for `combine_rows`); manual ep: A' = ep A."""
        return rows, group_sizes, None

    def combine_rows(self, rows: Array, plan: Any) -> Array:
        """The experts' outputs [A', D] back to this device's sorted assignments [A, D]."""
        return rows

    def token_loss(self, logits: Array, targets: Array, vocab_size: int) -> Array:
        """Per-token cross-entropy [B, T] from logits [B, T, V(_local)]."""
        return loss.token_cross_entropy(logits, targets, vocab_size)

    def chunked_token_loss(self, x: Array, w: Array, targets: Array, vocab_size: int, chunks: int) -> Array:
        """Per-token cross-entropy [B, T] of x [B, T, D] @ w [D, V(_local)], `chunks` chunks at a time."""
        return loss.chunked_token_cross_entropy(x, w, targets, vocab_size, chunks)


SINGLE_DEVICE = Parallelism()
