"""The row builders of the communication model (twinshard/cost/communication.py): a `Row` per
kind of collective, the `Ctx` every strategy's rows read, and the pieces several strategies
share (FSDP's gathers and scatters, Megatron's all-reduces, the norm and loss means)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from twinshard.config import ModelConfig
from twinshard.cost.weights import (F32, Weight, kv_replicated, layers_held, leaf_label, local_bytes, shape_label,
                                    used_shards, weights)
from twinshard.hlo import ring_bytes as _ring_bytes, shift_pattern
from twinshard.parallel import mesh as mesh_lib
from twinshard.parallel.strategies import KV_HEADS

PHASES = ("forward", "backward", "optimizer", "metrics")
OPS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all", "ragged-all-to-all")
AXES = mesh_lib.ORDER  # ('stage', 'data', 'expert', 'context', 'tensor'): mesh order


# Matrices whose gathered value the backward pass never reads, so FSDP does not re-gather them:
# d(take(table, ids))/d(table) is a scatter-add of the output gradient, independent of the table.
NOT_REGATHERED: frozenset[str] = frozenset({"token_embeddings"})


@dataclass(frozen=True)
class Row:
    """`count` collectives `op` over `axes`; `bytes` and `ring_bytes` summed over count;
    a collective-permute's `pattern` says who sends to whom, as the ledger prints it
    ('stage +1', 'context ring -1': `hlo.shift_pattern`)."""

    phase: str
    op: str
    axes: tuple[str, ...]
    count: int
    bytes: int
    ring_bytes: float
    what: str
    pattern: str = ""


# ----------------------------------------------------------------------------- row builders


@dataclass(frozen=True)
class Ctx:
    """Everything a strategy's rows need."""

    cfg: ModelConfig
    mesh: dict[str, int]
    batch: int  # global B
    seq: int  # T
    s: int  # compute dtype bytes
    k: int = 1  # grad_accum: micro-batches per step
    microbatches: int = 1  # M (pipelines)
    schedule: str = "gpipe"  # pipelines: one of twinshard.config.PIPELINE_SCHEDULES
    virtual: int = 1  # pipelines: chunks per stage (interleaved)
    w: int = F32  # ModelConfig.weight_dtype's bytes: the params', and so every gradient reduction's

    @property
    def d(self) -> int:
        return self.mesh["data"]

    @property
    def t(self) -> int:
        return self.mesh["tensor"]

    @property
    def L(self) -> int:  # noqa: N802
        return self.cfg.num_layers

    def activation(self, batch: int) -> int:
        """A = batch * T * D * s: one residual-stream tensor."""
        return batch * self.seq * self.cfg.d_model * self.s


def row(ctx: Ctx, phase: str, op: str, axes: tuple[str, ...], count: int, each: int, what: str,
        shift: tuple[int, bool] | None = None) -> Row:
    """`count` collectives of `each` result bytes over `axes` (ring bytes from the group size);
    a collective-permute's `shift` = (k, wrap): every device sends k steps along its one axis,
    around a ring (wrap) or along a line whose end sends nothing."""
    assert phase in PHASES and op in OPS and all(a in AXES for a in axes), (phase, op, axes)
    assert (shift is not None) == (op == "collective-permute") and (shift is None or len(axes) == 1), (op, shift)
    n = math.prod(ctx.mesh[a] for a in axes)
    total = count * each
    pattern = "" if shift is None else shift_pattern(axes[0], shift[0], n, shift[1])
    return Row(phase, op, tuple(a for a in AXES if a in axes), count, total, _ring_bytes(op, total, n), what,
               pattern)


def matrix_weights(ctx: Ctx) -> list[Weight]:
    return [w for w in weights(ctx.cfg) if w.is_matrix]


def norm_weights(ctx: Ctx) -> list[Weight]:
    return [w for w in weights(ctx.cfg) if not w.is_matrix]


def _local_bytes(ctx: Ctx, w: Weight, tensor_shards: int = 1) -> int:
    """weights.local_bytes in the compute dtype over `tensor_shards`."""
    return local_bytes(ctx.cfg, w, ctx.mesh, tensor_shards, ctx.s)


def kv_sum_rows(ctx: Ctx, data_shards: int = 1) -> list[Row]:
    """The k/v weights' gradient summed over a `tensor` axis larger than the kv heads, once per step per leaf
    (in the weight dtype)."""
    if not kv_replicated(ctx.cfg, ctx.mesh):
        return []
    return [row(ctx, "backward", "all-reduce", ("tensor",), w.leaves, w.layers * w.size * ctx.w // data_shards,
                f"psum over tensor of d({w.name}) {leaf_label(w)}" + (f"/{data_shards}" if data_shards > 1 else "")
                + " (kv heads replicated over tensor: each device's kv head slice)")
            for w in matrix_weights(ctx) if KV_HEADS in w.axes]


def fsdp_rows(ctx: Ctx, tensor_shards: int, axis: str = "data") -> list[Row]:
    """ZeRO-3 over `axis` (data; hsdp: fsdp): gather each matrix (forward, again backward), scatter its
    gradient, mean the norm gains; `tensor_shards` = t under fsdp_tp (each device gathers its tensor shard)."""
    if ctx.k > 1:
        return fsdp_step_rows(ctx, tensor_shards, axis=axis)
    gather = lambda phase, w, what: row(  # noqa: E731
        ctx, phase, "all-gather", (axis,), w.count, _local_bytes(ctx, w, tensor_shards),
        what.format(f"{w.name} {shape_label(w, used_shards(ctx.cfg, w, tensor_shards))}"))
    rows = [gather("forward", w, f"fsdp_gather: all_gather {{}} over {axis} before its use") for w in matrix_weights(ctx)]
    rows += [gather("backward", w, "fsdp_gather re-gathers {} (remat: gathered weights not saved)")
             for w in matrix_weights(ctx) if w.name not in NOT_REGATHERED]
    rows += [row(ctx, "backward", "reduce-scatter", (axis,), w.count, _local_bytes(ctx, w, tensor_shards) // ctx.mesh[axis],
                 f"fsdp_gather backward: psum_scatter of d({w.name}) over {axis}") for w in matrix_weights(ctx)]
    return rows + _fsdp_norm_rows(ctx, axis=axis)


def fsdp_step_rows(ctx: Ctx, tensor_shards: int, stages: int = 1, axis: str = "data") -> list[Row]:
    """grad_accum > 1 (manual_parallel/fsdp.py gather_step): each matrix leaf gathered once before the
    micro-batch loop, its gradient reduce-scattered once after; pp_fsdp: a stage's [L/S, ...] leaves."""
    rows = [row(ctx, "forward", "all-gather", (axis,), w.leaves,
                layers_held(w, stages) * _local_bytes(ctx, w, tensor_shards),
                f"gather_step: fsdp_gather of {w.name} {leaf_label(w, stages)} over {axis}, once per step")
            for w in matrix_weights(ctx)]
    rows += [row(ctx, "backward", "reduce-scatter", (axis,), w.leaves,
                 layers_held(w, stages) * _local_bytes(ctx, w, tensor_shards) // ctx.mesh[axis],
                 f"fsdp_gather backward: psum_scatter of the accumulated d({w.name}), once per step")
             for w in matrix_weights(ctx)]
    return rows + _fsdp_norm_rows(ctx, stages, axis)


def _fsdp_norm_rows(ctx: Ctx, stages: int = 1, axis: str = "data") -> list[Row]:
    return [row(ctx, "backward", "all-reduce", (axis,), w.leaves, layers_held(w, stages) * w.size * ctx.w,
                f"pmean over {axis} of d({w.name}) {leaf_label(w, stages)} (replicated norm gains)")
            for w in norm_weights(ctx)]


def tp_rows(ctx: Ctx, batch: int) -> list[Row]:
    """Megatron over tensor with `batch` sequences per device, per micro-batch, K times per step."""
    return repeated(ctx.k, _tp_micro_batch_rows(ctx, batch // ctx.k))


def repeated(k: int, rows: list[Row]) -> list[Row]:
    """The rows of one micro-batch, run k times per step (count, bytes, ring bytes x k)."""
    return [dataclasses.replace(r, count=k * r.count, bytes=k * r.bytes, ring_bytes=k * r.ring_bytes)
            for r in rows]


def cross_entropy_rows(ctx: Ctx, batch: int) -> list[Row]:
    """The vocab-parallel cross-entropy's 3 all-reduces of per-token f32 statistics [b, T] (per chunk under loss_chunks)."""
    n = ctx.cfg.loss_chunks or 1
    stats = batch * ctx.seq * F32 // n
    tok = f"[{batch},{ctx.seq}] f32" if n == 1 and not ctx.cfg.loss_chunks else f"[{batch * ctx.seq // n}] f32 x {n} chunks"
    return [
        row(ctx, "forward", "all-reduce", ("tensor",), n, stats,
            f"vocab-parallel cross-entropy: pmax of the per-token max {tok} (an all-reduce with max)"),
        row(ctx, "forward", "all-reduce", ("tensor",), 2 * n, stats,
            f"vocab-parallel cross-entropy: psum of sum-exp and of the target logit {tok}"),
    ]


def _tp_micro_batch_rows(ctx: Ctx, batch: int) -> list[Row]:
    a, L = ctx.activation(batch), ctx.L
    act = f"[{batch},{ctx.seq},{ctx.cfg.d_model}]"
    # tp_overlap_chunks = n: each block runs n chunks of the batch, each with its own f and g
    n = ctx.cfg.tp_overlap_chunks
    chunk, per_layer = (act, "2 per layer") if n == 1 else (
        f"[{batch // n},{ctx.seq},{ctx.cfg.d_model}]", f"2 per layer and chunk, {n} chunks")
    return [
        row(ctx, "forward", "all-reduce", ("tensor",), 1, a,
            f"vocab-parallel embedding: masked local lookup + psum {act}"),
        row(ctx, "forward", "all-reduce", ("tensor",), 2 * L * n, a // n,
            f"Megatron g: psum {chunk} after output_proj and after w2 ({per_layer})"),
        *cross_entropy_rows(ctx, batch),
        row(ctx, "backward", "all-reduce", ("tensor",), 2 * L * n, a // n,
            f"Megatron f: psum of d{chunk} before attention and before the MLP ({per_layer})"),
        row(ctx, "backward", "all-reduce", ("tensor",), 1, a,
            f"Megatron f: psum of d{act} before lm_head"),
    ]


def norm_row(ctx: Ctx, axes: tuple[str, ...]) -> Row:
    return row(ctx, "optimizer", "all-reduce", axes, 1, F32,
               f"global grad norm: psum over {','.join(axes)} of the local sum of squares (f32 scalar)")


def loss_row(ctx: Ctx) -> Row:
    return row(ctx, "metrics", "all-reduce", ("data",), 1, F32, "pmean over data of the loss (f32 scalar)")


def token_axes(ctx: Ctx, *axes: str) -> tuple[str, ...]:
    """The axes among `axes` of size > 1 (the runner's `_active`): a mean over a size-1 axis is no collective."""
    return tuple(a for a in axes if ctx.mesh.get(a, 1) > 1)


def int8_dw_rows(ctx: Ctx) -> list[Row]:
    """--quantization=int8_dw (twinshard/model/quantize.py): dW's int8 scales are maxima over every token, so
    each micro-batch's backward runs, per quantized product, a pmax over the axes that split the tokens of
    each operand's [1, channels] float32 absmax, once per distinct operand (q, k, v read one x; w1, w3 another).
    Per dense layer: x, attention's out, g_q, g_o, the MLP's x and g_w2 over D; g_k, g_v over the kv width;
    the MLP's hidden, g_w1, g_w3 over F. A routed layer quantizes its attention's 6 alone."""
    cfg = ctx.cfg
    axes = token_axes(ctx, "data", "context", "expert")  # the manual runners' TOKEN_AXES
    if cfg.quantization != "int8_dw" or not axes:
        return []
    dense = cfg.first_dense_layers if cfg.num_experts else cfg.num_layers
    layers, runs = cfg.num_layers, ctx.k * ctx.microbatches
    widths = ((cfg.d_model, 4 * layers + 2 * dense, "x, attention's out, g_q, g_o; the MLP's x, g_w2"),
              (cfg.kv_dim, 2 * layers, "g_k, g_v"), (cfg.d_ff, 3 * dense, "the MLP's hidden, g_w1, g_w3"))
    return [row(ctx, "backward", "all-reduce", axes, runs * n, width * F32,
                f"pmax over {','.join(axes)} of dW's int8 absmax [1, {width}]: {what}")
            for width, n, what in widths if n]
