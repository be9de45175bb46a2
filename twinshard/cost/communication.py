"""Which collectives the manual twin (manual_parallel/) runs per train step, strategy by strategy.

One `Row` per kind of collective (`count` collectives, `bytes` the summed result sizes, as the
ledger counts them), in the notation of twinshard/cost/__init__.py; each strategy's rows are
`_<name>(ctx)`, found by STRATEGY_ROWS from twinshard/parallel/strategies.py (a declared strategy
without one fails at import). The model, strategy by strategy, is in docs/design.md ("The
collectives per strategy, counted")."""

from __future__ import annotations

from collections.abc import Callable

from twinshard.cost.rows import (Ctx, Row, cross_entropy_rows, fsdp_rows, fsdp_step_rows, kv_sum_rows, loss_row,
                                 matrix_weights, norm_row, norm_weights, repeated, row, token_axes, tp_rows)
from twinshard.cost.weights import F32, kv_replicated, leaf_label, rules as placed_rules, shard_count, weights
from twinshard.parallel import context, strategies
from twinshard.parallel.strategies import KV_HEADS

# ----------------------------------------------------------------------------- strategies


def _single(ctx: Ctx) -> list[Row]:
    """One device moves nothing."""
    return []


def _dp(ctx: Ctx) -> list[Row]:
    """Gradients averaged over data, leaf by leaf, in the weight dtype; the loss averaged for the metrics."""
    grads = [row(ctx, "backward", "all-reduce", ("data",), w.leaves, w.layers * w.size * ctx.w,
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
    """GPipe (manual_parallel/pp.py): the stage hops, the replicated leaves' gradients and the loss summed over stage."""
    return _hop_rows(ctx) + _stage_sum_rows(ctx) + [norm_row(ctx, ("stage",)), _stage_loss_row(ctx)]


def _ticks(ctx: Ctx) -> int:
    """GPipe: M + S - 1 forward ticks; the schedules run by hand (1f1b, interleaved, zb_h1): every tick
    of their table hands an output on and a gradient back."""
    from twinshard.parallel import pipeline

    m, n = ctx.microbatches, ctx.mesh["stage"]
    return pipeline.ticks(m, n) if ctx.schedule == "gpipe" else pipeline.build(ctx.schedule, n, m, ctx.virtual).ticks


def _hop_rows(ctx: Ctx) -> list[Row]:
    """One micro-batch's activations [B/(data M), T, D] per tick and hop, forward and back; with
    V > 1 chunks a ring (the last stage's output goes round to stage 0's next chunk)."""
    ticks, b, wrap = _ticks(ctx), ctx.batch // (ctx.d * ctx.microbatches), ctx.virtual > 1
    act, ring = f"[{b},{ctx.seq},{ctx.cfg.d_model}]", " and S-1 -> 0" if wrap else ""
    return [
        row(ctx, "forward", "collective-permute", ("stage",), ticks, ctx.activation(b),
            f"shift_to_next_stage: ppermute s -> s+1{ring} of {act}, one per tick ({ticks} ticks)", shift=(1, wrap)),
        row(ctx, "backward", "collective-permute", ("stage",), ticks, ctx.activation(b),
            f"shift_to_previous_stage: ppermute s+1 -> s of d{act}, one per tick", shift=(-1, wrap)),
    ]


def gspmd_hop_rows(ctx: Ctx) -> list[Row]:
    """The GSPMD twin's pipeline (auto_parallel/pp.py, any V): V M + S - 1 ticks (V = 1: GPipe's M + S - 1,
    V > 1: nearly V times as many), each rolling the stage buffer [S, B/(data M), T, D] one stage on.
    Forward a ring s -> s+1 (S-1 -> 0: what goes round to stage 0's queue); backward its transpose,
    which XLA splits (measured, JAX 0.12) into the line s+1 -> s and the pair 0 -> S-1. Nothing moves
    outside the loop: the queue ends on stage 0, whose row the loss reads (an all-reduce, not modelled here)."""
    n, b = ctx.mesh["stage"], ctx.batch // (ctx.d * ctx.microbatches)
    ticks, a = ctx.virtual * ctx.microbatches + n - 1, ctx.activation(b)
    act = f"[{b},{ctx.seq},{ctx.cfg.d_model}]"
    return [
        row(ctx, "forward", "collective-permute", ("stage",), ticks, a,
            f"roll of the stage buffer: s -> s+1 and S-1 -> 0 of {act}, one per tick ({ticks} ticks)", shift=(1, True)),
        row(ctx, "backward", "collective-permute", ("stage",), ticks, a,
            f"the roll's transpose, its line s+1 -> s of d{act}, one per tick", shift=(-1, False)),
        row(ctx, "backward", "collective-permute", ("stage",), ticks, a,
            f"the roll's transpose, its pair 0 -> S-1 of d{act}, one per tick", shift=(n - 1, False)),
    ]


# ----------------------------------------------------------------------------- tp_sp


def _tp_sp(ctx: Ctx) -> list[Row]:
    """Megatron sequence parallelism (manual_parallel/tp_sp.py) with B/data sequences per device."""
    b = ctx.batch // ctx.d
    rows = repeated(ctx.k, _tp_sp_micro_batch_rows(ctx, b // ctx.k)) + [norm_row(ctx, ("tensor",))]
    if ctx.d == 1:
        return rows + kv_sum_rows(ctx)
    rules = placed_rules("tp_sp", ctx.cfg, ctx.mesh)
    shards = {w.name: shard_count(w, rules, ctx.mesh) for w in weights(ctx.cfg)}  # over tensor
    # replicated kv heads: their sum over tensor joins the mean over data (one all-reduce each)
    over = lambda w: ("data", "tensor") if KV_HEADS in w.axes and kv_replicated(ctx.cfg, ctx.mesh) else ("data",)  # noqa: E731
    return rows + [row(ctx, "backward", "all-reduce", over(w), w.leaves, w.layers * w.size * ctx.w // shards[w.name],
                       f"pmean over data of d({w.name}) {leaf_label(w)}"
                       + (f"/{shards[w.name]} (its tensor shard)" if shards[w.name] > 1 else "")
                       + (", summed over tensor (kv heads replicated over it)" if len(over(w)) > 1 else ""))
                   for w in weights(ctx.cfg)] + [loss_row(ctx)]


def _fsdp_tp_sp(ctx: Ctx) -> list[Row]:
    """FSDP over data (each device gathers its tensor shard of every matrix) beside tp_sp's sequence
    gathers and scatters over tensor on B/data sequences (manual_parallel/fsdp_tp_sp.py); the sequence
    is gathered again in the backward pass under remat, as tp_sp's."""
    kv_norm = [norm_row(ctx, ("data",))] if kv_replicated(ctx.cfg, ctx.mesh) else []
    sequence = repeated(ctx.k, _tp_sp_micro_batch_rows(ctx, ctx.batch // ctx.d // ctx.k))
    return (fsdp_rows(ctx, tensor_shards=ctx.t) + sequence + kv_sum_rows(ctx, data_shards=ctx.d)
            + [norm_row(ctx, ("data", "tensor")), *kv_norm, loss_row(ctx)])


def _tp_sp_micro_batch_rows(ctx: Ctx, batch: int) -> list[Row]:
    """TP's rows with each all-reduce of the residual stream split into a reduce-scatter (where g,
    or backward f, sums) and an all-gather: 8 (t-1)/t A ring bytes per layer, exactly TP's."""
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
            "copy_to_tp backward: psum of each RMSNorm gain's gradient [D] f32 (its tokens' share; the gain "
            "is cast to float32 before the hook)"),
    ] + ([row(ctx, "backward", "reduce-scatter", ("tensor",), L, a // t,
              f"scatter_sequence after output_proj recomputed under remat=full (SequenceParallel.layer_policy "
              f"saves the layer input alone; the MLP's recompute reads the residual stream it rebuilds)")]
         if ctx.cfg.remat == "full" else [])
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
    """psum over stage of the stage-replicated leaves' gradients in the weight dtype (matrices as 1/data
    shards under pp_fsdp)."""
    out = []
    for w in weights(ctx.cfg):
        if not w.stacked:
            shards = ctx.d if w.is_matrix else 1
            out.append(row(ctx, "backward", "all-reduce", ("stage",), 1, w.size * ctx.w // shards,
                           f"psum over stage of d({w.name}) {leaf_label(w)}{f'/{shards}' if shards > 1 else ''} "
                           "(replicated over stage)"))
    return out


def _stage_loss_row(ctx: Ctx) -> Row:
    return row(ctx, "metrics", "all-reduce", ("stage",), 1, F32, "psum over stage of the loss (last stage's; f32)")


def _pp_fsdp(ctx: Ctx) -> list[Row]:
    """pp's hops and stage sums plus fsdp's gather_step over data inside each stage (manual_parallel/pp_fsdp.py)."""
    return (_hop_rows(ctx) + fsdp_step_rows(ctx, 1, ctx.mesh["stage"]) + _stage_sum_rows(ctx)
            + [norm_row(ctx, axes) for axes in (("stage", "data"), ("stage",), ("data",))]
            + [_stage_loss_row(ctx), loss_row(ctx)])


# ----------------------------------------------------------------------------- context parallelism


def _ring_rows(ctx: Ctx, batch: int) -> list[Row]:
    """Ring attention on `batch` sequences per device: per layer 2(C-1) ring_shifts of K/V blocks
    [b, Hkv, T/C, dh] forward, the reverse ring backward; K times per step."""
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
    """ulysses (manual_parallel/ulysses.py): per layer 4 all-to-alls forward (q, k, v to head shards,
    the output back), their inverses backward; a remat policy saves their outputs, so nothing re-runs."""
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
    """The ring (or `attention`'s rows); every gradient leaf and the loss averaged over context."""
    grads = [row(ctx, "backward", "all-reduce", ("context",), w.leaves, w.layers * w.size * ctx.w,
                 f"pmean over context of d({w.name}) {leaf_label(w)}") for w in weights(ctx.cfg)]
    return attention(ctx, ctx.batch) + grads + [
        row(ctx, "metrics", "all-reduce", ("context",), 1, F32, "pmean over context of the loss (f32 scalar)")]


def _fsdp_cp(ctx: Ctx, attention: Callable[[Ctx, int], list[Row]] = _ring_rows) -> list[Row]:
    """FSDP over data, the ring on B/d sequences, each matrix gradient shard averaged over context (weight dtype)."""
    fsdp = [r for r in fsdp_rows(ctx, tensor_shards=1) if r.op != "all-reduce"]
    shards = [row(ctx, "backward", "all-reduce", ("context",), w.leaves, w.layers * w.size * ctx.w // ctx.d,
                  f"pmean over context of d({w.name}) {leaf_label(w)}/data (its shard)") for w in matrix_weights(ctx)]
    gains = [row(ctx, "backward", "all-reduce", ("data", "context"), w.leaves, w.layers * w.size * ctx.w,
                 f"pmean over data,context of d({w.name}) {leaf_label(w)} (replicated norm gains)")
             for w in norm_weights(ctx)]
    return fsdp + attention(ctx, ctx.batch // ctx.d) + shards + gains + [
        norm_row(ctx, ("data",)),
        row(ctx, "metrics", "all-reduce", ("data", "context"), 1, F32, "pmean over data,context of the loss")]


# ----------------------------------------------------------------------------- expert parallelism


def _exchange_rows(ctx: Ctx) -> list[Row]:
    """Per micro-batch and MoE layer: the dispatch and combine all_to_alls of [E, G, C, D], inverses backward."""
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
    """The dropless exchange (ragged_dispatch / ragged_combine) per micro-batch and MoE layer, on A =
    B/(data expert K) T k rows: the int32 counts' all_to_all (forward only), then the ragged rows;
    bytes are the static buffers, whatever the routing sends."""
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
    """ep (manual_parallel/ep.py): the exchanges; dense gradients averaged over (data, expert), experts' over data."""
    tokens = token_axes(ctx, "data", "expert")
    grads = []
    for w in weights(ctx.cfg):
        over = token_axes(ctx, "data") if w.is_experts else tokens
        if over:
            split = ctx.mesh["expert"] if w.is_experts else 1
            grads.append(row(ctx, "backward", "all-reduce", over, w.leaves, w.layers * w.size * ctx.w // split,
                             f"pmean over {','.join(over)} of d({w.name}) {leaf_label(w)}"
                             + (" (this device's experts)" if split > 1 else "")))
    return _exchange_rows(ctx) + grads + [
        norm_row(ctx, ("expert",)),
        row(ctx, "metrics", "all-reduce", tokens, 1, F32, f"pmean over {','.join(tokens)} of the loss (f32 scalar)")]


def _fsdp_ep(ctx: Ctx) -> list[Row]:
    """fsdp_ep (manual_parallel/fsdp_ep.py): FSDP over data, the exchanges, dense shards averaged over expert."""
    fsdp = [r for r in fsdp_rows(ctx, tensor_shards=1) if r.op != "all-reduce"]
    shards = [row(ctx, "backward", "all-reduce", ("expert",), w.leaves, w.layers * w.size * ctx.w // ctx.d,
                  f"pmean over expert of d({w.name}) {leaf_label(w)}/data (its shard)")
              for w in matrix_weights(ctx) if not w.is_experts]
    gains = [row(ctx, "backward", "all-reduce", ("data", "expert"), w.leaves, w.layers * w.size * ctx.w,
                 f"pmean over data,expert of d({w.name}) {leaf_label(w)} (replicated norm gains)")
             for w in norm_weights(ctx)]
    return fsdp + _exchange_rows(ctx) + shards + gains + [
        norm_row(ctx, ("data",)), norm_row(ctx, ("data", "expert")),
        row(ctx, "metrics", "all-reduce", ("data", "expert"), 1, F32, "pmean over data,expert of the loss")]


# ----------------------------------------------------------------------------- hsdp


def _hsdp(ctx: Ctx) -> list[Row]:
    """HSDP (manual_parallel/hsdp.py): fsdp's gathers and scatters over fsdp inside each slice; across
    slices (data, over DCN) only each gradient's mean: a matrix's 1/fsdp shard right after each of its
    reduce-scatters (hsdp_gather's backward: per layer, in the dtype it was scattered in), a norm gain
    whole after its mean inside the slice, in the weight dtype; the global norm's psum stays inside (the
    gradients agree across slices), the loss's scalar mean spans both axes."""
    fsdp = fsdp_rows(ctx, tensor_shards=1, axis="fsdp")
    scatters = [r for r in fsdp if r.op == "reduce-scatter"]  # one per matrix weight, in their order
    across = [row(ctx, "backward", "all-reduce", ("data",), r.count, r.bytes // r.count, f"hsdp_gather backward: pmean over "
                  f"data (DCN) of the shard d({w.name})/fsdp its psum_scatter over fsdp left")
              for w, r in zip(matrix_weights(ctx), scatters, strict=True)]
    across += [row(ctx, "backward", "all-reduce", ("data",), w.leaves, w.layers * w.size * ctx.w,
                   f"pmean over data (DCN) of d({w.name}) {leaf_label(w)} (norm gains, after their mean over fsdp)")
               for w in norm_weights(ctx)]
    return fsdp + across + [norm_row(ctx, ("fsdp",)), row(ctx, "metrics", "all-reduce", ("data", "fsdp"), 1, F32,
                                                            "pmean over data,fsdp of the loss (f32 scalar)")]


def _rows_of(name: str) -> Callable[[Ctx], list[Row]]:
    """The rows function `_<name>` of the strategy declared as `name`."""
    rows = globals().get(f"_{name}")
    if rows is None:
        raise ImportError(f"strategy {name!r} (twinshard/parallel/strategies.py) has no collective rows: "
                          f"define _{name}(ctx) in twinshard/cost/communication.py.")
    return rows


STRATEGY_ROWS: dict[str, Callable[[Ctx], list[Row]]] = {s.name: _rows_of(s.name) for s in strategies.DECLARATIONS}
