"""Which collectives the manual twin (manual_parallel/) runs per train step, strategy by strategy.

One `Row` per kind of collective, in the notation of twinshard/cost/__init__.py. Each
strategy's rows are one function named after it, `_<name>(ctx)` (`_dp`, `_fsdp`, ...);
`STRATEGY_ROWS` finds them by the names declared in twinshard/parallel/strategies.py, and
a declared strategy without its function fails at import. Each row names the manual twin's
line in `what`.

A collective in the scan body (FSDP's gather and scatter, Megatron's f/g)
runs once per layer: `count` times per step (the ledger multiplies by the
while loop's trip count); one on a whole gradient leaf (the DP mean) runs
once per leaf.

Collective rows (one `Row` per kind of collective; `count` collectives of
`bytes / count` bytes each). Byte conventions are the ledger's: `bytes` is the
array size of the collective's RESULT, summed over `count`:

    all-gather      the gathered (full) array
    reduce-scatter  the scattered shard (the result), = operand / n
    all-reduce      the array

and `ring_bytes` is what one device sends with a ring algorithm on a group of
n devices: all-gather (n-1)/n x result, reduce-scatter (n-1) x result,
all-reduce 2(n-1)/n x bytes (`twinshard.hlo.ring_bytes`).

Scalars (the loss, a squared gradient norm) and the cross-entropy statistics
are float32 (4 bytes) whatever `dtype_bytes` says: the loss is computed in f32.
So are the master params, their gradients and the optimizer state (DP's
gradient all-reduce and the norm gains' mean move f32). What
`s` sizes is what the compute dtype touches: activations (TP's all-reduces),
FSDP's gathered weights (cast to bf16 before the gather) and their gradients
(reduce-scattered in bf16, cast to f32 after).

Per strategy:

dp (data=d). backward: one all-reduce (pmean) over data of every gradient
    leaf, N*4 bytes (f32) in total (scaling book: 2N(d-1)/d x 4
    ring bytes per device). metrics: all-reduce (pmean) of the f32 loss.
    optimizer: none (gradients are replicated after the mean, so the global
    norm is local).
fsdp (data=d; each matrix sharded over data on its D dim, norms replicated).
    forward: all-gather of each matrix (7L+2), bytes = the full matrix.
    backward: all-gather again (gathered weights are rematerialized, not
    saved) of every matrix but the embedding (7L+1): the backward of a lookup
    is a scatter-add of the output gradient that never reads the table, so
    its re-gather is dead code; reduce-scatter of each matrix gradient (result =
    matrix/d); all-reduce of each norm gradient leaf (ln1 and ln2 [L, D],
    ln_final [D]: (2L+1)*D*4 bytes in total, f32).
    optimizer: all-reduce of the f32 partial sum of squared (sharded)
    gradients for the global norm. metrics: all-reduce of the loss. Per step
    each matrix (but the embedding) moves 3x its size through the ring
    ((d-1)/d * (2 gathers + 1 scatter)), the scaling book's FSDP volume.
tp (tensor=t; Megatron). Activation A = B*T*D*s bytes, token stats B*T*4.
    forward: per layer 2 all-reduces of A (Megatron g after output_proj and
    after w2); 1 all-reduce of A for the vocab-parallel embedding (masked
    local lookup + psum); the vocab-parallel cross-entropy: 1 all-reduce with
    max (pmax) of the per-token max and 2 all-reduces (psum) of per-token
    sum-exp and target logit, B*T*4 bytes each. backward: per layer 2
    all-reduces of A (Megatron f before attention and before the MLP) + 1 (f
    before lm_head). Weight gradients need no communication. optimizer:
    all-reduce over tensor of the f32 squared-norm partial sum. metrics: none
    (the loss is already identical on every device).
    Grouped-query attention with t > Hkv (kv heads replicated over tensor, each device
    using its kv head's slice: manual_parallel/tp.py): backward, one all-reduce over tensor
    per k/v leaf of its f32 gradient, L*D*Hkv*dh*4 bytes each (`kv_sum_rows`).
fsdp_tp (data=d, tensor=t). Each matrix sharded over tensor (heads / mlp /
    vocab dim) and over data (its D dim). fsdp's rows over data, but each
    gathered array is the matrix's TENSOR shard (full/t bytes; GQA's k and v
    full/min(t, Hkv): the kv head slice where t > Hkv) and each reduce-scatter
    result is that / d; tp's rows over tensor with the
    per-device batch b = B/d (A = (B/d)*T*D*s, stats (B/d)*T*4); the
    squared-norm all-reduce runs over (data, tensor); the loss is all-reduced
    over data; with t > Hkv, tp's k/v sums on the 1/d shards.
cp (context=C; twinshard/parallel/context.py, manual_parallel/cp.py). Every weight replicated;
    each device holds T/C tokens of every sequence. forward: per layer 2(C-1)
    collective-permutes of a K or V block [B, Hkv, T/C, dh] (ring attention's ring_shift; Hkv the
    key/value heads, H without grouped-query attention);
    backward: the reverse ring, 2(C-1) more. A sequence shard's gradient is a partial
    mean like a data shard's: all-reduce (pmean) over context of every gradient leaf (12,
    N*4 bytes), and of the loss. optimizer: none (replicated gradients).
fsdp_cp (data=d, context=C). fsdp's gathers and reduce-scatters over data; the ring with
    b = B/d; each matrix gradient SHARD (f32, 1/d) all-reduced over context (params are
    replicated over context: hybrid sharding, manual_parallel/fsdp_cp.py); each norm gain
    and the loss all-reduced once over (data, context); the squared-norm psum over data.
ulysses, fsdp_ulysses (context=C): cp's and fsdp_cp's rows with the ring replaced by 4 all-to-alls
    over context per layer forward (q, k, v [b, H (Hkv r), T/C, dh] to head shards, the output back)
    and their 4 inverses backward (`_head_exchange_rows`).
tp_sp (tensor=t, data=d >= 1; Megatron sequence parallelism, manual_parallel/tp_sp.py). TP's
    placement, the residual stream split along T. Each of TP's all-reduces of A (with
    b = B/d) becomes its two halves: forward, 2L reduce-scatters (result A/t) after
    output_proj and w2, 1 after the embedding lookup, 2L all-gathers (result A) before
    attention and the MLP, 1 before lm_head; backward, the conjugates (2L + 1
    reduce-scatters, 2L + 1 all-gathers); the cross-entropy's 3 all-reduces as TP; 2L + 1
    all-reduces of the RMSNorm gains' f32 gradients [D] (each device normalises only its
    tokens). Per layer the ring bytes equal TP's: 8 (t-1)/t A. Under a remat policy other
    than none the 2L column-parallel inputs are gathered again in the backward pass.
    With `collective_matmul` each of the 2L per-layer all-gathers is t-1 collective-permutes
    of A/t (forward) and so is its reduce-scatter (backward). With d > 1: dp's gradient
    means over data of each leaf's tensor shard and the loss mean. With t > Hkv: tp's k/v sums
    over tensor, joined to the k/v leaves' means over data where d > 1 (one all-reduce over
    (data, tensor) each).
pp, pp_fsdp (stage=S): the stage hops of `_hop_rows` and the stage sums; see `_pp`, `_pp_fsdp`.

Gradient accumulation (`grad_accum` = K > 1, micro-batches of b/K sequences). What
runs in each micro-batch's forward and backward runs K times per step (`repeated`): tp's
rows, on activations of b/K sequences (the same bytes per step, K x the count). The
gradient syncs run once, after the micro-batch loop: dp's means, the norm psum, the
loss. fsdp (and fsdp_tp's data rows) changes structure (manual_parallel/fsdp.py
`gather_step`): each matrix LEAF is all-gathered once before the loop (a stacked
[L, ...] leaf at once: 7 + 2 gathers of the same bytes as the 7L + 2 per-layer ones),
never re-gathered, and its accumulated gradient reduce-scattered once (7 + 2).
"""

from __future__ import annotations

from collections.abc import Callable

from twinshard.cost.rows import (Ctx, Row, cross_entropy_rows, fsdp_rows, fsdp_step_rows, kv_sum_rows, loss_row,
                                 matrix_weights, norm_row, norm_weights, repeated, row, tp_rows)
from twinshard.cost.weights import F32, kv_replicated, leaf_label, rules as placed_rules, shard_count, weights
from twinshard.parallel import context, strategies
from twinshard.parallel.strategies import KV_HEADS

# ----------------------------------------------------------------------------- strategies


def _dp(ctx: Ctx) -> list[Row]:
    """Gradients averaged over data, leaf by leaf; the loss averaged for the metrics."""
    grads = [row(ctx, "backward", "all-reduce", ("data",), w.leaves, w.layers * w.size * F32,
                 f"pmean over data of d({w.name}) {leaf_label(w)}") for w in weights(ctx.cfg)]
    return grads + [loss_row(ctx)]


def _fsdp(ctx: Ctx) -> list[Row]:
    return fsdp_rows(ctx, tensor_shards=1) + [norm_row(ctx, ("data",)), loss_row(ctx)]


def _tp(ctx: Ctx) -> list[Row]:
    return tp_rows(ctx, batch=ctx.batch) + kv_sum_rows(ctx) + [norm_row(ctx, ("tensor",))]


def _fsdp_tp(ctx: Ctx) -> list[Row]:
    # replicated kv heads: their leaves are split over data alone, a sharding group of the norm's own
    kv_norm = [norm_row(ctx, ("data",))] if kv_replicated(ctx.cfg, ctx.mesh) else []
    return (fsdp_rows(ctx, tensor_shards=ctx.t) + tp_rows(ctx, batch=ctx.batch // ctx.d)
            + kv_sum_rows(ctx, data_shards=ctx.d) + [norm_row(ctx, ("data", "tensor")), *kv_norm, loss_row(ctx)])


def _pp(ctx: Ctx) -> list[Row]:
    """GPipe (manual_parallel/pp.py): M + S - 1 ticks, each handing one micro-batch's
    activations [B/M, T, D] to the next stage forward and its gradient back; the replicated
    embedding, ln_final and lm_head gradients summed over stage; the loss summed over stage
    (only the last stage's is non-zero)."""
    return _hop_rows(ctx) + _stage_sum_rows(ctx) + [norm_row(ctx, ("stage",)), _stage_loss_row(ctx)]


def _ticks(ctx: Ctx) -> int:
    """GPipe: M + S - 1 forward ticks, then as many backward; 1F1B: every tick of its table
    hands a forward output on AND an input gradient back (zeros when the stage idled)."""
    from twinshard.parallel import pipeline

    m, n = ctx.microbatches, ctx.mesh["stage"]
    return pipeline.ticks(m, n) if ctx.schedule == "gpipe" else len(pipeline.one_f_one_b(m, n)[0])


def _hop_rows(ctx: Ctx) -> list[Row]:
    """One micro-batch's activations [B/(data M), T, D] per tick and hop, forward and back."""
    ticks, b = _ticks(ctx), ctx.batch // (ctx.d * ctx.microbatches)
    act = f"[{b},{ctx.seq},{ctx.cfg.d_model}]"
    return [
        row(ctx, "forward", "collective-permute", ("stage",), ticks, ctx.activation(b),
            f"shift_to_next_stage: ppermute s -> s+1 of {act}, one per tick ({ticks} ticks)", shift=(1, False)),
        row(ctx, "backward", "collective-permute", ("stage",), ticks, ctx.activation(b),
            f"shift_to_previous_stage: ppermute s+1 -> s of d{act}, one per tick", shift=(-1, False)),
    ]


# ----------------------------------------------------------------------------- tp_sp


def _tp_sp(ctx: Ctx) -> list[Row]:
    """Megatron sequence parallelism (manual_parallel/tp_sp.py) with B/data sequences per
    device: its per-micro-batch rows K times, the gains' psums, then TP's norm psum and, with
    data > 1, dp's gradient means and the loss mean over data."""
    b = ctx.batch // ctx.d
    rows = repeated(ctx.k, _tp_sp_micro_batch_rows(ctx, b // ctx.k)) + [norm_row(ctx, ("tensor",))]
    if ctx.d == 1:
        return rows + kv_sum_rows(ctx)
    rules = placed_rules("tp_sp", ctx.cfg, ctx.mesh)
    shards = {w.name: shard_count(w, rules, ctx.mesh) for w in weights(ctx.cfg)}  # over tensor
    # replicated kv heads: their sum over tensor joins the mean over data (one all-reduce each)
    over = lambda w: ("data", "tensor") if KV_HEADS in w.axes and kv_replicated(ctx.cfg, ctx.mesh) else ("data",)  # noqa: E731
    return rows + [row(ctx, "backward", "all-reduce", over(w), w.leaves, w.layers * w.size * F32 // shards[w.name],
                       f"pmean over data of d({w.name}) {leaf_label(w)}"
                       + (f"/{shards[w.name]} (its tensor shard)" if shards[w.name] > 1 else "")
                       + (", summed over tensor (kv heads replicated over it)" if len(over(w)) > 1 else ""))
                   for w in weights(ctx.cfg)] + [loss_row(ctx)]


def _tp_sp_micro_batch_rows(ctx: Ctx, batch: int) -> list[Row]:
    """TP's rows with each all-reduce of the residual stream split in its two halves (an
    all-reduce is a reduce-scatter followed by an all-gather): the reduce-scatter where TP's g
    (or its backward, f) sums, the all-gather where the next region needs the whole sequence.
    Per layer: the all-gathers' A plus the reduce-scatters' A/t result bytes move, on a ring,
    (t-1)/t A each - 8 (t-1)/t A in all, exactly TP's 4 all-reduces of 2 (t-1)/t A."""
    a, t, L = ctx.activation(batch), ctx.t, ctx.L
    act, shard = f"[{batch},{ctx.seq},{ctx.cfg.d_model}]", f"[{batch},{ctx.seq // t},{ctx.cfg.d_model}]"
    stats = cross_entropy_rows(ctx, batch)  # as TP's: the lm_head sees the whole sequence
    regather = ctx.cfg.remat != "none"  # the column-parallel inputs, see tp_sp.py
    rows = stats + [
        row(ctx, "forward", "reduce-scatter", ("tensor",), 1, a // t,
            f"vocab-parallel embedding: masked local lookup + scatter_sequence {act} -> {shard}"),
        row(ctx, "forward", "reduce-scatter", ("tensor",), 2 * L, a // t,
            f"scatter_sequence {act} -> {shard} after output_proj and after w2 (2 per layer)"),
        row(ctx, "forward", "all-gather", ("tensor",), 1, a, f"gather_sequence {shard} -> {act} before lm_head"),
        row(ctx, "backward", "reduce-scatter", ("tensor",), 1, a // t,
            f"gather_sequence backward: psum_scatter of d{act} before lm_head"),
        row(ctx, "backward", "all-gather", ("tensor",), 2 * L + 1, a,
            f"scatter_sequence backward: all_gather of d{shard} (2 per layer, + the embedding's output)"),
        row(ctx, "backward", "all-reduce", ("tensor",), 2 * L + 1, ctx.cfg.d_model * F32,
            "copy_to_tp backward: psum of each RMSNorm gain's gradient [D] f32 (its tokens' share)"),
    ]
    if ctx.cfg.collective_matmul:  # collectives.all_gather_matmul: t - 1 hops of a chunk each
        hops = 2 * L * (t - 1)
        return rows + [
            row(ctx, "forward", "collective-permute", ("tensor",), hops, a // t,
                f"all_gather_matmul: {t - 1} ppermutes of {shard} before attention and before the MLP",
                shift=(-1, True)),
            row(ctx, "backward", "collective-permute", ("tensor",), hops, a // t,
                f"all_gather_matmul backward: {t - 1} reverse ppermutes of d{shard} (a ring reduce-scatter)",
                shift=(1, True)),
        ] + ([row(ctx, "backward", "collective-permute", ("tensor",), hops, a // t,
                  f"all_gather_matmul's ppermutes recomputed under remat={ctx.cfg.remat}", shift=(-1, True))]
                if regather else [])
    return rows + [
        row(ctx, "forward", "all-gather", ("tensor",), 2 * L, a,
            f"gather_sequence {shard} -> {act} before attention and before the MLP (2 per layer)"),
        row(ctx, "backward", "reduce-scatter", ("tensor",), 2 * L, a // t,
            f"gather_sequence backward: psum_scatter of d{act} (2 per layer)"),
    ] + ([row(ctx, "backward", "all-gather", ("tensor",), 2 * L, a,
              f"gather_sequence recomputed under remat={ctx.cfg.remat} (the shard is saved, not {act})")]
         if regather else [])


def _stage_sum_rows(ctx: Ctx) -> list[Row]:
    """psum over stage of the gradients of the params replicated over stage (embedding,
    ln_final, lm_head): f32, the matrices as their 1/data shards under pp_fsdp."""
    out = []
    for w in weights(ctx.cfg):
        if not w.stacked:
            shards = ctx.d if w.is_matrix else 1
            out.append(row(ctx, "backward", "all-reduce", ("stage",), 1, w.size * F32 // shards,
                           f"psum over stage of d({w.name}) {leaf_label(w)}{f'/{shards}' if shards > 1 else ''} "
                           "(replicated over stage, f32)"))
    return out


def _stage_loss_row(ctx: Ctx) -> Row:
    return row(ctx, "metrics", "all-reduce", ("stage",), 1, F32, "psum over stage of the loss (last stage's; f32)")


def _pp_fsdp(ctx: Ctx) -> list[Row]:
    """pp's hops and stage sums, plus FSDP over data inside each stage, in both schedules
    (manual_parallel/pp_fsdp.py): each matrix leaf of the stage (7 stacked [L/S, ...] leaves,
    the embedding and the lm_head) gathered whole once per step, before the tick loop, and its
    accumulated gradient reduce-scattered once after it (gather_step); the norm gains' mean
    over data; the global norm, one psum per sharding group; the loss (psum over stage, pmean
    over data). The gathers, scatters and norm means are fsdp's under grad_accum, on a stage's
    leaves (manual_parallel/pp_fsdp.py: the same code path)."""
    return (_hop_rows(ctx) + fsdp_step_rows(ctx, 1, ctx.mesh["stage"]) + _stage_sum_rows(ctx)
            + [norm_row(ctx, axes) for axes in (("stage", "data"), ("stage",), ("data",))]
            + [_stage_loss_row(ctx), loss_row(ctx)])


# ----------------------------------------------------------------------------- context parallelism


def _ring_rows(ctx: Ctx, batch: int) -> list[Row]:
    """Ring attention (manual_parallel/ring_attention.py) on `batch` sequences per device, T/C tokens
    each: per layer C-1 ring_shifts of the K block and C-1 of the V block [b, Hkv, T/C, dh] forward
    (Hkv = H without grouped-query attention), the reverse ring of their gradients backward; per
    micro-batch (K times per step)."""
    c, cfg = ctx.mesh["context"], ctx.cfg
    context.check(ctx.seq, c, "contiguous")  # the ledger does not depend on the layout
    b, tc = batch // ctx.k, ctx.seq // c
    block = b * tc * cfg.kv_dim * ctx.s
    kv = f"[{b},{cfg.kv_heads},{tc},{cfg.head_dim}]"
    n = 2 * (c - 1) * ctx.L
    return repeated(ctx.k, [
        row(ctx, "forward", "collective-permute", ("context",), n, block,
            f"ring_shift: ppermute c -> c+1 of the K and the V block {kv}, C-1 each per layer", shift=(1, True)),
        row(ctx, "backward", "collective-permute", ("context",), n, block,
            f"ring_shift backward: ppermute c+1 -> c of dK and dV {kv}, C-1 each per layer", shift=(-1, True)),
    ])


def _head_exchange_rows(ctx: Ctx, batch: int) -> list[Row]:
    """ulysses's attention (manual_parallel/ulysses.py) on `batch` sequences per device, T/C tokens
    each: per layer seq_to_heads of q [b, H, T/C, dh] and of k, v [b, Hkv r, T/C, dh] (r:
    context.kv_repeats) and heads_to_seq of the output forward, their inverses backward; per
    micro-batch (K times per step). A remat policy saves their outputs: nothing re-runs."""
    c, cfg = ctx.mesh["context"], ctx.cfg
    context.check(ctx.seq, c, "contiguous")
    b, tc, kv = batch // ctx.k, ctx.seq // c, cfg.kv_heads * context.kv_repeats(cfg.num_heads, cfg.kv_heads, c)
    q_bytes, kv_bytes = b * tc * cfg.d_model * ctx.s, b * tc * kv * cfg.head_dim * ctx.s
    q_shape, kv_shape = f"[{b},{cfg.num_heads},{tc},{cfg.head_dim}]", f"[{b},{kv},{tc},{cfg.head_dim}]"
    rows = []
    for phase, pre in (("forward", ""), ("backward", "d")):
        rows += [row(ctx, phase, "all-to-all", ("context",), 2 * ctx.L, q_bytes,
                     f"{'heads_to_seq' if pre else 'seq_to_heads'} of {pre}q {q_shape} and "
                     f"{'seq_to_heads' if pre else 'heads_to_seq'} of the {pre}output (1 each per layer)"),
                 row(ctx, phase, "all-to-all", ("context",), 2 * ctx.L, kv_bytes,
                     f"{'heads_to_seq' if pre else 'seq_to_heads'} of {pre}k and {pre}v {kv_shape} (1 each per layer)")]
    return repeated(ctx.k, rows)


def _ulysses(ctx: Ctx) -> list[Row]:
    return _cp(ctx, _head_exchange_rows)


def _fsdp_ulysses(ctx: Ctx) -> list[Row]:
    return _fsdp_cp(ctx, _head_exchange_rows)


def _cp(ctx: Ctx, attention: Callable[[Ctx, int], list[Row]] = _ring_rows) -> list[Row]:
    """The ring (ulysses: `attention`'s rows); every gradient leaf and the loss averaged over context
    (a sequence shard's gradient is a partial mean, as a data shard's: manual_parallel/cp.py)."""
    grads = [row(ctx, "backward", "all-reduce", ("context",), w.leaves, w.layers * w.size * F32,
                 f"pmean over context of d({w.name}) {leaf_label(w)}") for w in weights(ctx.cfg)]
    return attention(ctx, ctx.batch) + grads + [
        row(ctx, "metrics", "all-reduce", ("context",), 1, F32, "pmean over context of the loss (f32 scalar)")]


def _fsdp_cp(ctx: Ctx, attention: Callable[[Ctx, int], list[Row]] = _ring_rows) -> list[Row]:
    """FSDP's gathers and scatters over data (its norm-gain means replaced: one pmean over
    (data, context) each); the ring on B/d sequences; each matrix gradient SHARD (f32, 1/d)
    averaged over context (params are replicated over context: manual_parallel/fsdp_cp.py)."""
    fsdp = [r for r in fsdp_rows(ctx, tensor_shards=1) if r.op != "all-reduce"]
    shards = [row(ctx, "backward", "all-reduce", ("context",), w.leaves, w.layers * w.size * F32 // ctx.d,
                  f"pmean over context of d({w.name}) {leaf_label(w)}/data (f32 shard)") for w in matrix_weights(ctx)]
    gains = [row(ctx, "backward", "all-reduce", ("data", "context"), w.leaves, w.layers * w.size * F32,
                 f"pmean over data,context of d({w.name}) {leaf_label(w)} (replicated f32 norm gains)")
             for w in norm_weights(ctx)]
    return fsdp + attention(ctx, ctx.batch // ctx.d) + shards + gains + [
        norm_row(ctx, ("data",)),
        row(ctx, "metrics", "all-reduce", ("data", "context"), 1, F32, "pmean over data,context of the loss")]


# ----------------------------------------------------------------------------- expert parallelism


def _token_axes(ctx: Ctx, *axes: str) -> tuple[str, ...]:
    """The axes among `axes` of size > 1 (the runner's `_active`): a mean over a size-1 axis is no collective."""
    return tuple(a for a in axes if ctx.mesh.get(a, 1) > 1)


def _exchange_rows(ctx: Ctx) -> list[Row]:
    """Per micro-batch and MoE layer (ModelConfig.moe_layers), on each device's B/(data expert K) sequences: the dispatch and
    combine all_to_alls of the capacity buffers [E, G, C, D] forward, their inverses backward."""
    if ctx.cfg.moe_dispatch == "ragged":
        return _ragged_exchange_rows(ctx)
    cfg, b, moe = ctx.cfg, ctx.batch // (ctx.d * ctx.mesh["expert"] * ctx.k), ctx.cfg.moe_layers
    groups = b * ctx.seq // cfg.moe_group
    buffers = cfg.num_experts * groups * cfg.expert_capacity * cfg.d_model * ctx.s
    shape = f"[{cfg.num_experts},{groups},{cfg.expert_capacity},{cfg.d_model}]"
    return repeated(ctx.k, [
        row(ctx, "forward", "all-to-all", ("expert",), 2 * moe, buffers,
            f"dispatch_to_experts and combine_from_experts: all_to_all of {shape} over expert (2 per layer)"),
        row(ctx, "backward", "all-to-all", ("expert",), 2 * moe, buffers,
            "their backward: the inverse all_to_all of each buffer's gradient (2 per layer)"),
    ])


def _ragged_exchange_rows(ctx: Ctx) -> list[Row]:
    """The dropless exchange (manual_parallel/collectives.py ragged_dispatch / ragged_combine), per
    micro-batch and MoE layer, on each device's A = B/(data expert K) T k assignment rows: one
    all_to_all of the [ep, E/ep + 1] int32 counts and offsets (forward only: integers have no
    gradient); ragged_dispatch into the static [ep A, D] rows where the experts run and
    ragged_combine back into [A, D] forward, their reverses backward. The bytes are the static
    buffers (what a ragged-all-to-all's result holds), whatever the routing sends."""
    cfg, ep, moe = ctx.cfg, ctx.mesh["expert"], ctx.cfg.moe_layers
    a = ctx.batch // (ctx.d * ep * ctx.k) * ctx.seq * cfg.experts_per_token
    expert_rows, token_rows = [ep * a, cfg.d_model], [a, cfg.d_model]  # where the experts run; back home
    size = lambda shape: shape[0] * shape[1] * ctx.s  # noqa: E731
    return repeated(ctx.k, [
        row(ctx, "forward", "all-to-all", ("expert",), moe, ep * (cfg.num_experts // ep + 1) * 4,
            f"expert_route: all_to_all of the [{ep},{cfg.num_experts // ep + 1}] int32 counts and offsets (1 per layer)"),
        row(ctx, "forward", "ragged-all-to-all", ("expert",), moe, size(expert_rows),
            f"ragged_dispatch of the rows into {expert_rows} (1 per layer)"),
        row(ctx, "forward", "ragged-all-to-all", ("expert",), moe, size(token_rows),
            f"ragged_combine of the expert outputs into {token_rows} (1 per layer)"),
        row(ctx, "backward", "ragged-all-to-all", ("expert",), moe, size(expert_rows),
            f"ragged_combine's reverse: the outputs' gradients into {expert_rows} (1 per layer)"),
        row(ctx, "backward", "ragged-all-to-all", ("expert",), moe, size(token_rows),
            f"ragged_dispatch's reverse: the rows' gradients into {token_rows} (1 per layer)"),
    ])


def _ep(ctx: Ctx) -> list[Row]:
    """ep (manual_parallel/ep.py): the exchanges; every replicated gradient leaf averaged over the
    token axes (data, expert), each expert leaf over data (its sum over expert arrived through the
    all_to_all); the expert shards' squared norms summed over expert; the loss averaged."""
    tokens = _token_axes(ctx, "data", "expert")
    grads = []
    for w in weights(ctx.cfg):
        over = _token_axes(ctx, "data") if w.is_experts else tokens
        if over:
            split = ctx.mesh["expert"] if w.is_experts else 1
            grads.append(row(ctx, "backward", "all-reduce", over, w.leaves, w.layers * w.size * F32 // split,
                             f"pmean over {','.join(over)} of d({w.name}) {leaf_label(w)}"
                             + (" (this device's experts)" if split > 1 else "")))
    return _exchange_rows(ctx) + grads + [
        norm_row(ctx, ("expert",)),
        row(ctx, "metrics", "all-reduce", tokens, 1, F32, f"pmean over {','.join(tokens)} of the loss (f32 scalar)")]


def _fsdp_ep(ctx: Ctx) -> list[Row]:
    """fsdp_ep (manual_parallel/fsdp_ep.py): FSDP's gathers and scatters over data (the experts'
    local E/ep), the exchanges, each replicated-over-expert matrix shard averaged over expert, each
    norm gain over (data, expert); the norm psums of the two sharding groups; the loss averaged."""
    fsdp = [r for r in fsdp_rows(ctx, tensor_shards=1) if r.op != "all-reduce"]
    shards = [row(ctx, "backward", "all-reduce", ("expert",), w.leaves, w.layers * w.size * F32 // ctx.d,
                  f"pmean over expert of d({w.name}) {leaf_label(w)}/data (f32 shard)")
              for w in matrix_weights(ctx) if not w.is_experts]
    gains = [row(ctx, "backward", "all-reduce", ("data", "expert"), w.leaves, w.layers * w.size * F32,
                 f"pmean over data,expert of d({w.name}) {leaf_label(w)} (replicated f32 norm gains)")
             for w in norm_weights(ctx)]
    return fsdp + _exchange_rows(ctx) + shards + gains + [
        norm_row(ctx, ("data",)), norm_row(ctx, ("data", "expert")),
        row(ctx, "metrics", "all-reduce", ("data", "expert"), 1, F32, "pmean over data,expert of the loss")]


def _rows_of(name: str) -> Callable[[Ctx], list[Row]]:
    """The rows function of the strategy declared as `name`: `_<name>` in this module."""
    rows = globals().get(f"_{name}")
    if rows is None:
        raise ImportError(f"strategy {name!r} (twinshard/parallel/strategies.py) has no collective rows: "
                          f"define _{name}(ctx) in twinshard/cost/communication.py.")
    return rows


STRATEGY_ROWS: dict[str, Callable[[Ctx], list[Row]]] = {s.name: _rows_of(s.name) for s in strategies.DECLARATIONS}
