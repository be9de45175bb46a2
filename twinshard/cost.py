"""The analytic cost model: collectives, FLOPs and memory of one train step.

`cost(model_cfg, strategy, mesh, batch_size)` says, for our exact layers
(twinshard/model/transformer.py), which collectives the *manual* twin
(manual_parallel/) runs per step, how many FLOPs the step does and how much
memory each device holds. It is plain arithmetic (no JAX is run), written in
the scaling book's notation (Austin et al., "How to Scale Your Model",
the training chapter), and it is what the collective ledger of the compiled
HLO (twinshard/hlo.py) is compared with (`compare`, `launch/collectives.py`).

    >>> from twinshard.config import preset
    >>> c = cost(preset("tiny").model, "fsdp", {"data": 8, "tensor": 1}, batch_size=8)
    >>> c.summary()[("reduce-scatter", ("data",))]["count"]   # one per matrix: 7L + 2
    16
    >>> text = c.table()                                       # rows, totals, FLOPs, memory

Notation
--------
    B  global batch (sequences)        d  size of mesh axis `data`
    T  sequence length                 t  size of mesh axis `tensor`
    D  d_model (= H*dh)                b  per-device batch: B/d (dp, fsdp, fsdp_tp), B (tp)
    H  heads, dh head dim              L  num_layers
    F  d_ff                            V  padded vocab (multiple of 128)
    s  bytes per element of the COMPUTE dtype (dtype_bytes: 4 = float32, 2 = bfloat16)

The parameter tree (`weights(cfg)`; leaf names as in twinshard/model/transformer.py). The
blocks are one stack scanned over L (model.scan_layers): each block weight is
a leaf [L, ...] with logical axes ('layers', ...), and the scan body uses one
layer's slice (the shape below):

    kind    weight                   shape        logical axes     count   leaves
    matrix  token_embeddings         [V, D]       (vocab, embed)   1       1
    matrix  attn.{q,k,v}_proj        [D, H*dh]    (embed, heads)   3L      3 x [L, D, H*dh]
    matrix  attn.output_proj         [H*dh, D]    (heads, embed)   L       1 x [L, H*dh, D]
    matrix  ffn.{w1,w3}              [D, F]       (embed, mlp)     2L      2 x [L, D, F]
    matrix  ffn.w2                   [F, D]       (mlp, embed)     L       1 x [L, F, D]
    matrix  lm_head                  [D, V]       (embed, vocab)   1       1
    norm    ln1, ln2                 [D]          (norm,)          2L      2 x [L, D]
    norm    ln_final                 [D]          (norm,)          1       1

so there are 7L + 2 matrices and 2L + 1 norm vectors in 12 leaves,
N = 2VD + L(4D^2 + 3DF + 2D) + D parameters (= `ModelConfig.num_params()`).
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

Per strategy (each is one small function below: `_dp`, `_fsdp`, `_tp`,
`_fsdp_tp`; each row names the manual twin's line in `what`):

dp (data=d). backward: one all-reduce (pmean) over data of every gradient
    leaf, 12 all-reduces (9 stacked + 3) of N*s bytes in total (scaling book: 2N(d-1)/d*s
    ring bytes per device). metrics: all-reduce (pmean) of the f32 loss.
    optimizer: none (gradients are replicated after the mean, so the global
    norm is local).
fsdp (data=d; each matrix sharded over data on its D dim, norms replicated).
    forward: all-gather of each matrix (7L+2), bytes = the full matrix.
    backward: all-gather again (gathered weights are rematerialized, not
    saved) of every matrix but the embedding (7L+1): the backward of a lookup
    is a scatter-add of the output gradient that never reads the table, so
    its re-gather is dead code (measured: the manual twin's compiled step has
    2(7L+2)-1 all-gathers); reduce-scatter of each matrix gradient (result =
    matrix/d); all-reduce of each norm gradient leaf (ln1 and ln2 [L, D],
    ln_final [D]: 3, (2L+1)*D*s bytes in total).
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
fsdp_tp (data=d, tensor=t). Each matrix sharded over tensor (heads / mlp /
    vocab dim) and over data (its D dim). fsdp's rows over data, but each
    gathered array is the matrix's TENSOR shard (full/t bytes) and each
    reduce-scatter result is full/(t*d); tp's rows over tensor with the
    per-device batch b = B/d (A = (B/d)*T*D*s, stats (B/d)*T*4); the
    squared-norm all-reduce runs over (data, tensor); the loss is all-reduced
    over data.
cp (context=C; twinshard/parallel/context.py, manual_parallel/cp.py). Every weight replicated;
    each device holds T/C tokens of every sequence. forward: per layer 2(C-1)
    collective-permutes of a K or V block [B, H, T/C, dh] (ring attention's ring_shift);
    backward: the reverse ring, 2(C-1) more. A sequence shard's gradient is a partial
    mean like a data shard's: all-reduce (pmean) over context of every gradient leaf (12,
    N*4 bytes), and of the loss. optimizer: none (replicated gradients).
fsdp_cp (data=d, context=C). fsdp's gathers and reduce-scatters over data; the ring with
    b = B/d; each matrix gradient SHARD (f32, 1/d) all-reduced over context (params are
    replicated over context: hybrid sharding, manual_parallel/fsdp_cp.py); each norm gain
    and the loss all-reduced once over (data, context); the squared-norm psum over data.
    Activations (`memory`): those of T/C tokens, plus the C-1 received K and V blocks and
    each ring step's statistics (its probabilities are recomputed: `_cp_activations`).
    FLOPs: the formula below (every score); ring attention computes only the visible blocks
    after its own, (C+1)/(2C) of the attention scores in total (zig-zag: half a block per
    device per step, balanced; contiguous: the same total, device c doing c + 1 blocks).

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
    means over data of each leaf's tensor shard and the loss mean.

Gradient accumulation (`grad_accum` = K > 1, micro-batches of b/K sequences). What
runs in each micro-batch's forward and backward runs K times per step (`_times`): tp's
rows, on activations of b/K sequences (the same bytes per step, K x the count). The
gradient syncs run once, after the micro-batch loop: dp's means, the norm psum, the
loss. fsdp (and fsdp_tp's data rows) changes structure (manual_parallel/fsdp.py
`gather_step`): each matrix LEAF is all-gathered once before the loop (a stacked
[L, ...] leaf at once: 7 + 2 gathers of the same bytes as the 7L + 2 per-layer ones),
never re-gathered, and its accumulated gradient reduce-scattered once (7 + 2).
FLOPs do not change. Memory: activations of one micro-batch, plus `accumulator`, the
float32 gradient accumulator (dp, tp: the local params' size; fsdp, fsdp_tp: the whole
matrices over data, / t), and under fsdp `gathered_weights` becomes every matrix,
gathered in the compute dtype (/ t): both are resident for the whole step.

FLOPs (`Flops`): a matmul [m,k]x[k,n] costs 2mkn.
    forward  = 2 * B*T * N_mm + L * 2 * 2 * B * T^2 * D
    with N_mm = L(4D*H*dh + 3DF) + DV the matmul parameters (the embedding is a
    lookup: 0 FLOPs; norms, RoPE, softmax, SiLU are elementwise and ignored).
    The attention term is QK^T and AV, 2*B*T*T*D each per layer; it is NOT
    halved for causality (our attention computes the full T x T scores and
    masks them). backward = 2 x forward (grad wrt inputs + grad wrt weights).
    total = 3 x forward; per device = total / (d*t) (every strategy splits all
    matmuls evenly: batch over data, heads / d_ff / vocab over tensor).

Memory per device (`Memory`, bytes):
    params     sum over leaves of f32 leaf bytes / (its data shards x tensor shards)
    grads      = params (same sharding)
    optimizer  by `optimizer` (O(1) counters and placeholders ignored): adamw 2 x params
               (mu, nu); lion, sgd 1 x params (mu; momentum trace); adafactor, per
               leaf with two dims >= 128 (optim.factored_dims) a row and a column
               statistic (the leaf without its largest / second-largest dim, each
               split over the mesh axes of the dims it keeps), else a full v
    activations, saved for the backward pass, per layer by `remat` (ModelConfig.remat,
        the jax.checkpoint policy of each layer: twinshard/model/transformer.py REMAT_POLICIES):
        none       b*T*(6D + 5D/t + 3F/t + 4 + H/t) elements: what autodiff saves
                   (jax.ad_checkpoint.print_saved_residuals, JAX 0.12; exact on one device
                   and in the manual tp twin, tests/test_remat.py; the norms' 2 gains [D]
                   left out so that the activations scale with the batch): 6 x [b,T,D] of
                   the residual stream and the norms (replicated under TP: the block input,
                   the residual after attention, the norms' outputs, and the rows [b*T, D]
                   the column-parallel matmuls read for their weight gradients); 5 x
                   [b,T,D/t] in attention (q and k after RoPE, v, the output o, the merged
                   heads output_proj reads); 3 x [b,T,F/t] in SwiGLU (w1 and w3 outputs,
                   W2's input: layers.swiglu_gate recomputes the sigmoid); per-token norm
                   statistics (4 x [b,T,1]) and the rows' log-sum-exp [b,H/t,T,1]. No
                   [T, T] array: layers.recompute_attention (the default off-GPU; cuDNN
                   flash attention on a GPU in bf16 keeps none either) recomputes the
                   probabilities in the backward pass, which `attention_backward` counts.
                   (Autodiff of the reference or of jax.nn's XLA attention would save the
                   scores and the probabilities, 2 x [b,H/t,T,T] f32 per layer, instead of o.)
        full       b*T*D: the layer input (the checkpoint's argument); + b*T*D under
                   tensor parallelism, the attention block's g output (the manual twin
                   saves Megatron g's psum outputs so no all-reduce is recomputed, and
                   needs the first one to rebuild the residual stream)
        dots_no_batch  b*T*(2D + 3D/t + 2F/t): the input, q, k, v, output_proj's
                   output (TP: g's psum of it), w1 and w3 outputs. w2's output is a dot
                   too, but the backward pass never reads it: JAX saves what is read.
        dots       dots_no_batch + b*T*D/t (the AV product) + b*(H/t)*T^2 (the QK^T scores)
        and, for every policy, one layer's `none` residuals once: the working set the
        backward loop rebuilds (or, under none, the cotangents it builds) for the layer it
        differentiates, + its attention backward's [T, T] arrays (`attention_backward`).
        The per-layer counts of full / dots / dots_no_batch are exact (equal to JAX's
        saved_residuals on one device and in the manual tp twin, tests/test_remat.py).
        tp_sp      everything outside the tensor-parallel regions / t (the residual stream,
                   norms, their statistics, the reduce-scatter outputs), the rest as tp; under
                   none also the two gathered [b,T,D] inputs of the column-parallel matmuls
                   (`_saved_per_layer_sequence`, exact against JAX's saved residuals)
        pp, pp_fsdp  a stage's L/S layers on micro-batches of b/M rows, by `schedule`
                   (`_pipeline_activations`): gpipe saves them in all M + S - 1 ticks and runs
                   the loss on all b rows; 1f1b holds one micro-batch's residuals (its backward
                   op re-runs the stage's forward) beside 3S stage inputs [b/M, T, D], and runs
                   the loss per micro-batch; the backward working set is one micro-batch's
        final      2*b*T*D (ln_final in/out; tp_sp: b*T*D/t in, b*T*D gathered out) + b*T*V/t (logits) x s, and b*T*V/t x 4
        (exp(z - max) in the f32 loss); the rest x s bytes. Not rematerialized by any
        policy (the manual FSDP twin checkpoints the lm_head matmul alone, which keeps
        its input and output). An estimate: XLA fuses, recomputes and frees buffers
        (compare with `compiled.memory_analysis()`; tests/test_remat.py states the factor).
    gathered_weights (fsdp, fsdp_tp: transient) one layer's gathered matrices or
        the gathered embedding / lm_head, whichever is larger: 7 per layer at
        full/t elements each, x s bytes (gathered in the compute dtype).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from twinshard.parallel import context, mesh as mesh_lib, strategies
from twinshard.config import PIPELINE_SCHEDULES, REMAT_POLICIES, ModelConfig
from twinshard.hlo import ring_bytes as _ring_bytes, shift_pattern

PHASES = ("forward", "backward", "optimizer", "metrics")
OPS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")
AXES = mesh_lib.ORDER  # ('stage', 'data', 'context', 'tensor'): mesh order
PIPELINES = strategies.of_family("pipeline")  # on a `stage` axis (twinshard/parallel/pipeline.py); their mesh names it
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # ModelConfig.dtype -> bytes per element
F32 = 4  # bytes of the loss, the squared-norm scalar and the cross-entropy statistics

# logical axis -> mesh axis of everything each strategy splits (its declaration's tables).
RULES: dict[str, dict[str, str]] = {s.name: s.split_rules for s in strategies.DECLARATIONS}


# Matrices whose gathered value the backward pass never reads, so FSDP does not re-gather them:
# d(take(table, ids))/d(table) is a scatter-add of the output gradient, independent of the table.
NOT_REGATHERED: frozenset[str] = frozenset({"token_embeddings"})


# ----------------------------------------------------------------------------- the parameter tree


@dataclass(frozen=True)
class Weight:
    """A group of identical per-layer weights (e.g. the 3L q/k/v projections).

    `count` weights of `shape` are used per forward pass. A `stacked` group
    lives in `count // layers` parameter leaves of shape [layers, *shape] (the
    scanned block stack: e.g. q, k, v are 3 leaves [L, D, H*dh]); collectives
    inside the scan body act on one layer's weight (`count` of them per
    step), those on whole gradients on one leaf (`leaves` of them).
    """

    name: str
    shape: tuple[int, ...]  # one layer's weight
    axes: tuple[str, ...]  # its logical axes
    count: int
    layers: int = 1  # L for the stacked block params, 1 otherwise

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def leaves(self) -> int:
        """Number of parameter arrays (a stacked leaf holds `layers` weights)."""
        return self.count // self.layers

    @property
    def leaf_shape(self) -> tuple[int, ...]:
        return self.shape if self.layers == 1 else (self.layers, *self.shape)

    @property
    def leaf_axes(self) -> tuple[str, ...]:
        return self.axes if self.layers == 1 else ("layers", *self.axes)

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) == 2


def weights(cfg: ModelConfig) -> list[Weight]:
    """The weights of `TransformerLM`, grouped by shape and role (block weights stacked [L, ...])."""
    v, d, f, hd, n = cfg.padded_vocab_size, cfg.d_model, cfg.d_ff, cfg.num_heads * cfg.head_dim, cfg.num_layers
    return [
        Weight("token_embeddings", (v, d), ("vocab", "embed"), 1),
        Weight("attn.{q,k,v}_proj", (d, hd), ("embed", "heads"), 3 * n, layers=n),
        Weight("attn.output_proj", (hd, d), ("heads", "embed"), n, layers=n),
        Weight("ffn.{w1,w3}", (d, f), ("embed", "mlp"), 2 * n, layers=n),
        Weight("ffn.w2", (f, d), ("mlp", "embed"), n, layers=n),
        Weight("lm_head", (d, v), ("embed", "vocab"), 1),
        Weight("ln1, ln2", (d,), ("norm",), 2 * n, layers=n),
        Weight("ln_final", (d,), ("norm",), 1),
    ]


# ----------------------------------------------------------------------------- result types


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


@dataclass(frozen=True)
class Flops:
    """FLOPs of one train step (see the module docstring for the formula)."""

    matmul_params: int  # N_mm: parameters that take part in a matmul
    forward_matmul: int  # 2 * B*T * N_mm
    forward_attention: int  # L * 2 * 2 * B * T^2 * D (QK^T and AV, causal mask not exploited)
    forward: int
    backward: int  # 2 x forward
    total: int  # 3 x forward
    per_device: float  # total / number of devices


@dataclass(frozen=True)
class Memory:
    """Bytes per device (see the module docstring for the formula)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    gathered_weights: int  # transient FSDP working set (0 without FSDP)
    accumulator: int = 0  # float32 gradient accumulator of grad_accum > 1 (0 without accumulation)
    # the backward loop's working set: one layer's residuals (rebuilt under remat) or their
    # cotangents, `saved_per_layer(..., "none")` of one layer (see `memory`)
    backward_layer: int = 0

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations + self.gathered_weights
                + self.accumulator + self.backward_layer)

    @property
    def temporaries(self) -> int:
        """What XLA's memory_analysis() counts as temporaries (not arguments): all but the
        params and the optimizer state, which are the (donated) step's arguments."""
        return self.total - self.params - self.optimizer


@dataclass(frozen=True)
class Cost:
    strategy: str
    mesh: dict[str, int]
    batch_size: int
    seq_len: int
    dtype_bytes: int
    collectives: list[Row]
    flops: Flops
    memory: Memory
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[tuple[str, tuple[str, ...]], dict[str, float]]:
        """(op, axes) -> {count, bytes, ring_bytes} (the shape of `Ledger.summary()`)."""
        return summarize(self.collectives)

    def by_axes(self) -> dict[tuple[str, ...], dict[str, float]]:
        """axes -> {count, bytes, ring_bytes}, all ops together."""
        out: dict[tuple[str, ...], dict[str, float]] = {}
        for (_, axes), s in self.summary().items():
            acc = out.setdefault(axes, {"count": 0, "bytes": 0, "ring_bytes": 0.0})
            for k in acc:
                acc[k] += s[k]
        return out

    def table(self) -> str:
        """Fixed-width text: one line per row, then per-axis totals, FLOPs and memory."""
        head = ("phase", "op", "axes", "count", "bytes", "ring bytes", "what")
        lines = [(r.phase, r.op, r.pattern or ",".join(r.axes), str(r.count), human(r.bytes), human(r.ring_bytes),
                  r.what)
                 for r in self.collectives]
        out = _fmt_table(head, lines) if lines else ["(no collectives)"]
        for axes, s in self.by_axes().items():
            out.append(f"total over {','.join(axes)}: {s['count']} collectives, {human(s['bytes'])}, "
                       f"ring {human(s['ring_bytes'])} per device")
        f, m = self.flops, self.memory
        out.append(f"flops/step: {f.total:.4g} total (forward {f.forward:.4g} = matmul {f.forward_matmul:.4g} "
                   f"+ attention {f.forward_attention:.4g}; backward 2x), {f.per_device:.4g} per device")
        out.append(f"memory/device: params {human(m.params)}, grads {human(m.grads)}, optimizer "
                   f"{human(m.optimizer)}, activations ~{human(m.activations)}"
                   + (f", gathered weights ~{human(m.gathered_weights)}" if m.gathered_weights else "")
                   + (f", gradient accumulator {human(m.accumulator)}" if m.accumulator else "")
                   + f"; total ~{human(m.total)}")
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "mesh": dict(self.mesh), "batch_size": self.batch_size,
            "seq_len": self.seq_len, "dtype_bytes": self.dtype_bytes,
            "collectives": [{**dataclasses.asdict(r), "axes": list(r.axes)} for r in self.collectives],
            "summary": [{"op": op, "axes": list(axes), **v} for (op, axes), v in self.summary().items()],
            "flops": dataclasses.asdict(self.flops),
            "memory": {**dataclasses.asdict(self.memory), "total": self.memory.total},
            "notes": list(self.notes),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.as_dict(), **kwargs)

    def __str__(self) -> str:
        return self.table()


# ----------------------------------------------------------------------------- row builders


@dataclass(frozen=True)
class _Ctx:
    """Everything a strategy's rows need."""

    cfg: ModelConfig
    mesh: dict[str, int]
    batch: int  # global B
    seq: int  # T
    s: int  # dtype bytes
    k: int = 1  # grad_accum: micro-batches per step
    microbatches: int = 1  # M (pipelines)
    schedule: str = "gpipe"  # pipelines: gpipe or 1f1b

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


def row(ctx: _Ctx, phase: str, op: str, axes: tuple[str, ...], count: int, each: int, what: str,
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


def _matrices(ctx: _Ctx) -> list[Weight]:
    return [w for w in weights(ctx.cfg) if w.is_matrix]


def _norms(ctx: _Ctx) -> list[Weight]:
    return [w for w in weights(ctx.cfg) if not w.is_matrix]


def _fsdp_rows(ctx: _Ctx, tensor_shards: int) -> list[Row]:
    """ZeRO-3 over data: gather each matrix (forward, again in backward), scatter its gradient,
    all-reduce each replicated norm gradient. `tensor_shards` = t under fsdp_tp (each device
    gathers only its tensor shard), 1 under fsdp."""
    if ctx.k > 1:
        return _fsdp_step_rows(ctx, tensor_shards)
    gather = lambda phase, w, what: row(  # noqa: E731
        ctx, phase, "all-gather", ("data",), w.count, w.size * ctx.s // tensor_shards,
        what.format(f"{w.name} {_shape(w, tensor_shards)}"))
    rows = [gather("forward", w, "fsdp_gather: all_gather {} over data before its use") for w in _matrices(ctx)]
    rows += [gather("backward", w, "fsdp_gather re-gathers {} (remat: gathered weights not saved)")
             for w in _matrices(ctx) if w.name not in NOT_REGATHERED]
    rows += [row(ctx, "backward", "reduce-scatter", ("data",), w.count,
                 w.size * ctx.s // (tensor_shards * ctx.d),
                 f"fsdp_gather backward: psum_scatter of d({w.name}) over data") for w in _matrices(ctx)]
    return rows + _fsdp_norm_rows(ctx)


def _fsdp_step_rows(ctx: _Ctx, tensor_shards: int, stages: int = 1) -> list[Row]:
    """grad_accum = K > 1 (manual_parallel/fsdp.py gather_step): each matrix LEAF (a stacked
    [L, ...] block leaf at once) gathered once before the micro-batch loop and never re-gathered,
    its accumulated gradient reduce-scattered once after it; the norm gradients' mean once.
    pp_fsdp (`stages` = S): the same on a stage's leaves, [L/S, ...] of a block weight."""
    rows = [row(ctx, "forward", "all-gather", ("data",), w.leaves, _held(w, stages) * w.size * ctx.s // tensor_shards,
                f"gather_step: fsdp_gather of {w.name} {_leaf_shape(w, stages)} over data, once per step")
            for w in _matrices(ctx)]
    rows += [row(ctx, "backward", "reduce-scatter", ("data",), w.leaves,
                 _held(w, stages) * w.size * ctx.s // (ctx.d * tensor_shards),
                 f"fsdp_gather backward: psum_scatter of the accumulated d({w.name}), once per step")
             for w in _matrices(ctx)]
    return rows + _fsdp_norm_rows(ctx, stages)


def _fsdp_norm_rows(ctx: _Ctx, stages: int = 1) -> list[Row]:
    return [row(ctx, "backward", "all-reduce", ("data",), w.leaves, _held(w, stages) * w.size * F32,
                f"pmean over data of d({w.name}) {_leaf_shape(w, stages)} (replicated f32 norm gains)")
            for w in _norms(ctx)]


def _held(w: Weight, stages: int = 1) -> int:
    """How many of w's layers one device holds: L/S of a stacked block weight split over `stages`
    pipeline stages (L without a pipeline), 1 otherwise."""
    return w.layers // stages if w.layers > 1 else 1


def _tp_rows(ctx: _Ctx, batch: int) -> list[Row]:
    """Megatron over tensor with `batch` sequences per device (B under tp, B/d under fsdp_tp):
    per micro-batch of batch/K sequences, K times per step (they are in each micro-batch's
    forward and backward)."""
    return _times(ctx.k, _tp_micro_batch_rows(ctx, batch // ctx.k))


def _times(k: int, rows: list[Row]) -> list[Row]:
    """The rows of one micro-batch, run k times per step (count, bytes, ring bytes x k)."""
    return [dataclasses.replace(r, count=k * r.count, bytes=k * r.bytes, ring_bytes=k * r.ring_bytes)
            for r in rows]


def _cross_entropy_rows(ctx: _Ctx, batch: int) -> list[Row]:
    """The vocab-parallel cross-entropy's 3 all-reduces of per-token statistics [b, T] f32."""
    stats, tok = batch * ctx.seq * F32, f"[{batch},{ctx.seq}] f32"
    return [
        row(ctx, "forward", "all-reduce", ("tensor",), 1, stats,
            f"vocab-parallel cross-entropy: pmax of the per-token max {tok} (an all-reduce with max)"),
        row(ctx, "forward", "all-reduce", ("tensor",), 2, stats,
            f"vocab-parallel cross-entropy: psum of sum-exp and of the target logit {tok}"),
    ]


def _tp_micro_batch_rows(ctx: _Ctx, batch: int) -> list[Row]:
    a, L = ctx.activation(batch), ctx.L
    act = f"[{batch},{ctx.seq},{ctx.cfg.d_model}]"
    return [
        row(ctx, "forward", "all-reduce", ("tensor",), 1, a,
            f"vocab-parallel embedding: masked local lookup + psum {act}"),
        row(ctx, "forward", "all-reduce", ("tensor",), 2 * L, a,
            f"Megatron g: psum {act} after output_proj and after w2 (2 per layer)"),
        *_cross_entropy_rows(ctx, batch),
        row(ctx, "backward", "all-reduce", ("tensor",), 2 * L, a,
            f"Megatron f: psum of d{act} before attention and before the MLP (2 per layer)"),
        row(ctx, "backward", "all-reduce", ("tensor",), 1, a,
            f"Megatron f: psum of d{act} before lm_head"),
    ]


def _norm_row(ctx: _Ctx, axes: tuple[str, ...]) -> Row:
    return row(ctx, "optimizer", "all-reduce", axes, 1, F32,
               f"global grad norm: psum over {','.join(axes)} of the local sum of squares (f32 scalar)")


def _loss_row(ctx: _Ctx) -> Row:
    return row(ctx, "metrics", "all-reduce", ("data",), 1, F32, "pmean over data of the loss (f32 scalar)")


# ----------------------------------------------------------------------------- strategies


def _dp(ctx: _Ctx) -> list[Row]:
    """Gradients averaged over data, leaf by leaf; the loss averaged for the metrics."""
    grads = [row(ctx, "backward", "all-reduce", ("data",), w.leaves, w.layers * w.size * F32,
                 f"pmean over data of d({w.name}) {_leaf_shape(w)}") for w in weights(ctx.cfg)]
    return grads + [_loss_row(ctx)]


def _fsdp(ctx: _Ctx) -> list[Row]:
    return _fsdp_rows(ctx, tensor_shards=1) + [_norm_row(ctx, ("data",)), _loss_row(ctx)]


def _tp(ctx: _Ctx) -> list[Row]:
    return _tp_rows(ctx, batch=ctx.batch) + [_norm_row(ctx, ("tensor",))]


def _fsdp_tp(ctx: _Ctx) -> list[Row]:
    return (_fsdp_rows(ctx, tensor_shards=ctx.t) + _tp_rows(ctx, batch=ctx.batch // ctx.d)
            + [_norm_row(ctx, ("data", "tensor")), _loss_row(ctx)])


def _pp(ctx: _Ctx) -> list[Row]:
    """GPipe (manual_parallel/pp.py): M + S - 1 ticks, each handing one micro-batch's
    activations [B/M, T, D] to the next stage forward and its gradient back; the replicated
    embedding, ln_final and lm_head gradients summed over stage; the loss summed over stage
    (only the last stage's is non-zero)."""
    return _hop_rows(ctx) + _stage_sum_rows(ctx) + [_norm_row(ctx, ("stage",)), _stage_loss_row(ctx)]


def _ticks(ctx: _Ctx) -> int:
    """GPipe: M + S - 1 forward ticks, then as many backward; 1F1B: every tick of its table
    hands a forward output on AND an input gradient back (zeros when the stage idled)."""
    from twinshard.parallel import pipeline

    m, n = ctx.microbatches, ctx.mesh["stage"]
    return pipeline.ticks(m, n) if ctx.schedule == "gpipe" else len(pipeline.one_f_one_b(m, n)[0])


def _hop_rows(ctx: _Ctx) -> list[Row]:
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


def _tp_sp(ctx: _Ctx) -> list[Row]:
    """Megatron sequence parallelism (manual_parallel/tp_sp.py) with B/data sequences per
    device: its per-micro-batch rows K times, the gains' psums, then TP's norm psum and, with
    data > 1, dp's gradient means and the loss mean over data."""
    b = ctx.batch // ctx.d
    rows = _times(ctx.k, _tp_sp_micro_batch_rows(ctx, b // ctx.k)) + [_norm_row(ctx, ("tensor",))]
    if ctx.d == 1:
        return rows
    shards = {w.name: _shards(w, RULES["tp_sp"], ctx.mesh) for w in weights(ctx.cfg)}  # over tensor
    return rows + [row(ctx, "backward", "all-reduce", ("data",), w.leaves, w.layers * w.size * F32 // shards[w.name],
                       f"pmean over data of d({w.name}) {_leaf_shape(w)}"
                       + (f"/{shards[w.name]} (its tensor shard)" if shards[w.name] > 1 else ""))
                   for w in weights(ctx.cfg)] + [_loss_row(ctx)]


def _tp_sp_micro_batch_rows(ctx: _Ctx, batch: int) -> list[Row]:
    """TP's rows with each all-reduce of the residual stream split in its two halves (an
    all-reduce is a reduce-scatter followed by an all-gather): the reduce-scatter where TP's g
    (or its backward, f) sums, the all-gather where the next region needs the whole sequence.
    Per layer: the all-gathers' A plus the reduce-scatters' A/t result bytes move, on a ring,
    (t-1)/t A each - 8 (t-1)/t A in all, exactly TP's 4 all-reduces of 2 (t-1)/t A."""
    a, t, L = ctx.activation(batch), ctx.t, ctx.L
    act, shard = f"[{batch},{ctx.seq},{ctx.cfg.d_model}]", f"[{batch},{ctx.seq // t},{ctx.cfg.d_model}]"
    stats = _cross_entropy_rows(ctx, batch)  # as TP's: the lm_head sees the whole sequence
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


def _stage_sum_rows(ctx: _Ctx) -> list[Row]:
    """psum over stage of the gradients of the params replicated over stage (embedding,
    ln_final, lm_head): f32, the matrices as their 1/data shards under pp_fsdp."""
    out = []
    for w in weights(ctx.cfg):
        if w.layers == 1:
            shards = ctx.d if w.is_matrix else 1
            out.append(row(ctx, "backward", "all-reduce", ("stage",), 1, w.size * F32 // shards,
                           f"psum over stage of d({w.name}) {_leaf_shape(w)}{f'/{shards}' if shards > 1 else ''} "
                           "(replicated over stage, f32)"))
    return out


def _stage_loss_row(ctx: _Ctx) -> Row:
    return row(ctx, "metrics", "all-reduce", ("stage",), 1, F32, "psum over stage of the loss (last stage's; f32)")


def _pp_fsdp(ctx: _Ctx) -> list[Row]:
    """pp's hops and stage sums, plus FSDP over data inside each stage, in both schedules
    (manual_parallel/pp_fsdp.py): each matrix leaf of the stage (7 stacked [L/S, ...] leaves,
    the embedding and the lm_head) gathered whole once per step, before the tick loop, and its
    accumulated gradient reduce-scattered once after it (gather_step); the norm gains' mean
    over data; the global norm, one psum per sharding group; the loss (psum over stage, pmean
    over data). The gathers, scatters and norm means are fsdp's under grad_accum, on a stage's
    leaves (manual_parallel/pp_fsdp.py: the same code path)."""
    return (_hop_rows(ctx) + _fsdp_step_rows(ctx, 1, ctx.mesh["stage"]) + _stage_sum_rows(ctx)
            + [_norm_row(ctx, axes) for axes in (("stage", "data"), ("stage",), ("data",))]
            + [_stage_loss_row(ctx), _loss_row(ctx)])


# ----------------------------------------------------------------------------- context parallelism


def _ring_rows(ctx: _Ctx, batch: int) -> list[Row]:
    """Ring attention (manual_parallel/ring_attention.py) on `batch` sequences per device, T/C tokens
    each: per layer C-1 ring_shifts of the K block and C-1 of the V block [b, H, T/C, dh] forward,
    the reverse ring of their gradients backward; per micro-batch (K times per step)."""
    c, cfg = ctx.mesh["context"], ctx.cfg
    context.check(ctx.seq, c, "contiguous")  # the ledger does not depend on the layout
    b, tc = batch // ctx.k, ctx.seq // c
    block = b * tc * cfg.num_heads * cfg.head_dim * ctx.s
    kv = f"[{b},{cfg.num_heads},{tc},{cfg.head_dim}]"
    n = 2 * (c - 1) * ctx.L
    return _times(ctx.k, [
        row(ctx, "forward", "collective-permute", ("context",), n, block,
            f"ring_shift: ppermute c -> c+1 of the K and the V block {kv}, C-1 each per layer", shift=(1, True)),
        row(ctx, "backward", "collective-permute", ("context",), n, block,
            f"ring_shift backward: ppermute c+1 -> c of dK and dV {kv}, C-1 each per layer", shift=(-1, True)),
    ])


def _cp(ctx: _Ctx) -> list[Row]:
    """The ring; every gradient leaf and the loss averaged over context (a sequence shard's
    gradient is a partial mean, as a data shard's: manual_parallel/cp.py)."""
    grads = [row(ctx, "backward", "all-reduce", ("context",), w.leaves, w.layers * w.size * F32,
                 f"pmean over context of d({w.name}) {_leaf_shape(w)}") for w in weights(ctx.cfg)]
    return _ring_rows(ctx, ctx.batch) + grads + [
        row(ctx, "metrics", "all-reduce", ("context",), 1, F32, "pmean over context of the loss (f32 scalar)")]


def _fsdp_cp(ctx: _Ctx) -> list[Row]:
    """FSDP's gathers and scatters over data (its norm-gain means replaced: one pmean over
    (data, context) each); the ring on B/d sequences; each matrix gradient SHARD (f32, 1/d)
    averaged over context (params are replicated over context: manual_parallel/fsdp_cp.py)."""
    fsdp = [r for r in _fsdp_rows(ctx, tensor_shards=1) if r.op != "all-reduce"]
    shards = [row(ctx, "backward", "all-reduce", ("context",), w.leaves, w.layers * w.size * F32 // ctx.d,
                  f"pmean over context of d({w.name}) {_leaf_shape(w)}/data (f32 shard)") for w in _matrices(ctx)]
    gains = [row(ctx, "backward", "all-reduce", ("data", "context"), w.leaves, w.layers * w.size * F32,
                 f"pmean over data,context of d({w.name}) {_leaf_shape(w)} (replicated f32 norm gains)")
             for w in _norms(ctx)]
    return fsdp + _ring_rows(ctx, ctx.batch // ctx.d) + shards + gains + [
        _norm_row(ctx, ("data",)),
        row(ctx, "metrics", "all-reduce", ("data", "context"), 1, F32, "pmean over data,context of the loss")]


def _cp_activations(cfg: ModelConfig, remat: str, b: int, seq: int, c: int, s: int) -> tuple[int, int, int]:
    """(saved elements of all layers, backward working set bytes, final bytes) of a device holding
    T/C tokens under ring attention: the position-wise residuals of T/C tokens (`saved_per_layer`
    with t = 1), plus what the ring's checkpointed merges keep: the C-1 received K and V blocks
    (saved under every policy: cp.py's layer_policy) and each step's running statistics (acc
    [b, H, T/C, dh], max and sum [b, H, T/C, 1]); the backward loop also rebuilds one block's
    scores and probabilities [b, H, T/C, T/C]. An estimate, like the rest of the activation model:
    measured totals (tools/long_context.py, d_model 64, 8 heads, L = 2, B = 1, context:8, T = 512,
    2048, 4096, 8192: 4.8, 15.5, 40.9, 131.5 MiB per device, round 11) against 4.9, 15.5, 36.7,
    103.0."""
    tc, d, v = seq // c, cfg.d_model, cfg.padded_vocab_size
    ring, block = ring_attention_memory(b, cfg.num_heads, tc, cfg.head_dim, c)
    layers = cfg.num_layers * (saved_per_layer(cfg, remat, b, tc, 1) + ring)
    backward_layer = (saved_per_layer(cfg, "none", b, tc, 1) + ring + block) * s
    final = (2 * b * tc * d + b * tc * v) * s + b * tc * v * F32
    return layers, backward_layer, final


def ring_attention_memory(b: int, h: int, tc: int, dh: int, c: int) -> tuple[int, int]:
    """(elements one layer's ring attention saves, elements its backward rebuilds at once) on a
    device holding q, k, v [b, h, T/C, dh] of C shards (manual_parallel/ring_attention.py): the
    C-1 received K and V blocks and each of the C steps' running statistics (acc [b, h, T/C, dh],
    max and sum [b, h, T/C, 1]: a checkpointed merge saves its inputs only); the backward pass
    rebuilds one block's scores and probabilities [b, h, T/C, T/C] at a time."""
    kv = 2 * (c - 1) * b * h * tc * dh
    stats = c * (b * h * tc * dh + 2 * b * h * tc)
    return kv + stats, 2 * b * h * tc * tc


STRATEGY_ROWS: dict[str, Callable[[_Ctx], list[Row]]] = {
    "dp": _dp, "fsdp": _fsdp, "tp": _tp, "fsdp_tp": _fsdp_tp, "pp": _pp, "pp_fsdp": _pp_fsdp, "tp_sp": _tp_sp,
    "cp": _cp, "fsdp_cp": _fsdp_cp,
}


# ----------------------------------------------------------------------------- flops and memory


def flops(cfg: ModelConfig, batch: int, seq: int, n_devices: int = 1) -> Flops:
    d, hd, f, v, n = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.d_ff, cfg.padded_vocab_size, cfg.num_layers
    n_mm = n * (4 * d * hd + 3 * d * f) + d * v  # q,k,v,o + w1,w2,w3 per layer, + lm_head
    fwd_mm = 2 * batch * seq * n_mm
    fwd_attn = n * 2 * 2 * batch * seq * seq * hd  # QK^T and AV; the causal half is computed too
    fwd = fwd_mm + fwd_attn
    return Flops(n_mm, fwd_mm, fwd_attn, fwd, 2 * fwd, 3 * fwd, 3 * fwd / n_devices)


def _shards(w: Weight, rules: Mapping[str, str], mesh: Mapping[str, int]) -> int:
    return math.prod(mesh[rules[a]] for a in w.leaf_axes if a in rules)


def _optimizer_bytes(cfg: ModelConfig, rules: Mapping[str, str], mesh: Mapping[str, int],
                     optimizer: str) -> int:
    """Optimizer-state bytes per device (f32; see the module docstring)."""
    from twinshard.train.optim import factored_dims  # optax is imported only when memory is asked for

    def kept(shape, axes, dims) -> int:  # elements per device of a statistic keeping `dims`
        split = math.prod(mesh[rules[axes[k]]] for k in dims if axes[k] in rules)
        return math.prod(shape[k] for k in dims) // split

    per_param = {"adamw": 2, "lion": 1, "sgd": 1}
    total = 0
    for w in weights(cfg):
        shape, axes, every = w.leaf_shape, w.leaf_axes, range(len(w.leaf_shape))
        if optimizer in per_param:
            total += w.leaves * per_param[optimizer] * kept(shape, axes, every)
        elif optimizer == "adafactor":
            dims = factored_dims(shape)
            stats = [every] if dims is None else [[k for k in every if k != d] for d in dims]
            total += w.leaves * sum(kept(shape, axes, s) for s in stats)
        else:
            raise ValueError(f"optimizer={optimizer!r} has no memory model; choose one of "
                             f"{', '.join(per_param)}, adafactor.")
    return total * F32


def saved_per_layer(cfg: ModelConfig, remat: str, b: int, seq: int, t: int, sequence: bool = False) -> int:
    """Elements one layer saves for the backward pass under `remat` (module docstring);
    b sequences per device, t tensor shards (1 without tensor parallelism); `sequence`:
    Megatron sequence parallelism (tp_sp), the residual stream on sequence shards."""
    d, f, h = cfg.d_model, cfg.d_ff, cfg.num_heads
    scores = b * (h // t) * seq * seq  # [b, H/t, T, T]
    if sequence:
        return _saved_per_layer_sequence(cfg, remat, b, seq, t, scores)
    if remat == "none":  # what autodiff saves: JAX's print_saved_residuals, listed in the docstring
        return b * seq * (6 * d + 5 * d // t + 3 * f // t + 4 + h // t)
    if remat == "full":
        return b * seq * d * (2 if t > 1 else 1)  # + Megatron g's output under tp
    no_batch = b * seq * (2 * d + 3 * d // t + 2 * f // t)
    if remat == "dots_no_batch":
        return no_batch
    if remat == "dots":
        return no_batch + b * seq * d // t + scores
    raise ValueError(f"remat={remat!r} has no memory model; choose one of {', '.join(REMAT_POLICIES)}.")


def attention_backward(cfg: ModelConfig, b: int, seq: int, t: int) -> int:
    """Bytes of the [T, T] arrays one layer's attention backward holds at once: the recomputed
    probabilities and d(q k^T), 2 x [b, H/t, T, T] float32 (layers.recompute_attention; XLA
    writes ds over dp). No layer saves a [T, T] array for the backward, so at long context
    this working set, not the residuals, is what grows with T^2. Measured (tiny, batch 4, one
    CPU device, temp_size_in_bytes against the model): T = 1024, 194.8 MiB against 75.0
    without this term, 203.0 with it; T = 256, 25.8 against 19.2 / 27.2.
    It models the default kernel off-GPU. Not modelled: cuDNN flash attention (a GPU in bf16)
    builds no [T, T] array at all, so the term overestimates a bf16 GPU plan by these bytes;
    `--attention=xla` / `reference` save the scores and the probabilities in every layer
    (2 x [b,H/t,T,T] f32 per layer, uncounted); under remat=dots in bf16 the saved q k^T is
    f32, counted at the compute dtype's bytes."""
    return 2 * b * (cfg.num_heads // t) * seq * seq * F32


def _pipeline_activations(cfg: ModelConfig, remat: str, b: int, seq: int, stages: int, microbatches: int,
                          schedule: str) -> tuple[int, int]:
    """(saved elements, rows of one micro-batch) of a pipeline stage holding b rows in M micro-batches
    of b/M, under `schedule` (as manual_parallel/pp.py runs it):
      gpipe  autodiff of the tick loop saves the L/S layers' residuals of every one of the M + S - 1
             ticks (a bubble tick computes, and saves, too);
      1f1b   a backward op is a `jax.vjp` of the stage on the micro-batch's saved input, so the
             residuals of ONE micro-batch's L/S layers are alive at a time, beside three rings of S
             micro-batch activations [b/M, T, D] (the saved inputs and the two inboxes)."""
    from twinshard.parallel import pipeline

    rows, held = b // microbatches, cfg.num_layers // stages
    if schedule == "gpipe":
        return held * saved_per_layer(cfg, remat, rows, seq, 1) * pipeline.ticks(microbatches, stages), rows
    return held * saved_per_layer(cfg, remat, rows, seq, 1) + 3 * stages * rows * seq * cfg.d_model, rows


def _saved_per_layer_sequence(cfg: ModelConfig, remat: str, b: int, seq: int, t: int, scores: int) -> int:
    """tp_sp's saved residuals per layer (JAX's print_saved_residuals in manual_parallel/tp_sp.py,
    exact; tests/test_sequence.py). Outside the regions everything is TP's / t: the layer input,
    the norms and their statistics, Megatron g's (now the reduce-scatter's) output. Inside
    them, as TP: q, k, v, SwiGLU, the scores. New: under `none` the two gathered inputs of the
    column-parallel matmuls [b, T, D] (their weight gradients read them); a remat policy
    saves the shard instead and gathers it again (tp_sp.py)."""
    d, f, h = cfg.d_model, cfg.d_ff, cfg.num_heads
    if remat == "none":  # 4 [b,T/t,D] + 4 [b,T/t,1] + 2 gathered [b,T,D] + q, k, v, o, lse + ...
        return b * seq * (9 * d // t + 2 * d + 3 * f // t + h // t) + 4 * b * seq // t
    if remat == "full":  # the layer input and the attention block's reduce-scatter output, [b,T/t,D]
        return 2 * b * seq * d // t
    no_batch = b * seq * (5 * d // t + 2 * f // t)  # the two [b,T/t,D] above, q, k, v, w1 and w3 outputs
    if remat == "dots_no_batch":
        return no_batch
    if remat == "dots":
        return no_batch + b * seq * d // t + scores
    raise ValueError(f"remat={remat!r} has no memory model; choose one of {', '.join(REMAT_POLICIES)}.")


def memory(cfg: ModelConfig, strategy: str, mesh: Mapping[str, int], batch: int, seq: int,
           dtype_bytes: int = 4, grad_accum: int = 1, microbatches: int = 1,
           optimizer: str = "adamw", remat: str | None = None, schedule: str = "gpipe") -> Memory:
    """Bytes per device; `remat` (default `cfg.remat`) sets the activations, `schedule` (gpipe,
    1f1b) and `microbatches` a pipeline's (module docstring)."""
    mesh_lib.check_strategy(strategy)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not a pipeline schedule; choose one of "
                         f"{', '.join(PIPELINE_SCHEDULES)}.")
    remat = cfg.remat if remat is None else remat
    rules = RULES[strategy]
    params = sum(w.count * w.size * F32 // _shards(w, rules, mesh) for w in weights(cfg))  # f32 masters
    t = mesh["tensor"] if "heads" in rules else 1
    b = (batch // mesh["data"] if "batch" in rules else batch) // grad_accum  # one micro-batch
    d, f, v = cfg.d_model, cfg.d_ff, cfg.padded_vocab_size
    sequence = "seq" in rules  # tp_sp: the residual stream on sequence shards
    layers = cfg.num_layers * saved_per_layer(cfg, remat, b, seq, t, sequence)
    head = b  # rows the lm_head and the loss run on at once
    if "layers" in rules:  # a pipeline stage: its L/S layers on micro-batches of b/M rows
        layers, b = _pipeline_activations(cfg, remat, b, seq, mesh["stage"], microbatches, schedule)
        head = b if schedule == "1f1b" else head  # GPipe: the loss of all M micro-batches at once
    # The backward loop holds one layer's worth of residuals at a time beyond what was saved:
    # rebuilt under remat, their cotangents without (measured with memory_analysis: without
    # this term the model missed 25-30% of tiny's and 15% of small's single-device temporaries).
    backward_layer = (saved_per_layer(cfg, "none", b, seq, t, sequence) * dtype_bytes
                      + attention_backward(cfg, b, seq, t))
    ln_final = head * seq * d // t + head * seq * d if sequence else 2 * head * seq * d  # tp_sp: on shards, gathered
    final = (ln_final + head * seq * v // t) * dtype_bytes + head * seq * v // t * F32  # f32 loss
    if rules.get("seq") == "context":  # T/C tokens per device, ring attention's residuals
        layers, backward_layer, final = _cp_activations(cfg, remat, b, seq, mesh["context"], dtype_bytes)
    acts = layers * dtype_bytes + final
    gathered = 0
    if "embed" in rules:
        layer = 4 * d * cfg.num_heads * cfg.head_dim + 3 * d * f  # q, k, v, o, w1, w2, w3
        gathered = max(layer, v * d) * dtype_bytes // t
        if "layers" in rules:  # pp_fsdp: the stage's L/S layers, embedding and lm_head, gathered for the
            # step; GPipe's tick loop reads them as float32 (manual_parallel/pp.py `_gpipe`), 1F1B in
            # the compute dtype
            stage = cfg.num_layers // mesh["stage"] * layer + 2 * v * d
            gathered = stage * (F32 if schedule == "gpipe" else dtype_bytes)
    opt = _optimizer_bytes(cfg, rules, mesh, optimizer)
    if "layers" in rules and "embed" in rules:  # pp_fsdp: + the float32 gradient of what it gathered
        return Memory(params, params, opt, acts, gathered, stage * F32, backward_layer)
    if grad_accum == 1:
        return Memory(params, params, opt, acts, gathered, 0, backward_layer)
    # the f32 accumulator of the micro-batch scan: param-sized (DP, TP); under FSDP it holds the
    # gradient of the WHOLE matrices (gather_step), so it and the gathered weights are full over data
    accumulator = params
    if "embed" in rules:
        no_data = {a: m for a, m in rules.items() if m != "data"}
        accumulator = sum(w.count * w.size * F32 // _shards(w, no_data, mesh) for w in weights(cfg))
        gathered = sum(w.count * w.size for w in weights(cfg) if w.is_matrix) * dtype_bytes // t
    return Memory(params, params, opt, acts, gathered, accumulator, backward_layer)


# ----------------------------------------------------------------------------- entry point


def _leaf_shape(w: Weight, stages: int = 1) -> str:
    """w's parameter leaf, "[L, D, F]"; on one of `stages` pipeline stages "[L/S, D, F]"."""
    return "[" + ",".join(str(n) for n in (w.shape if w.layers == 1 else (_held(w, stages), *w.shape))) + "]"


def _shape(w: Weight, tensor_shards: int) -> str:
    return "[" + ",".join(str(n) for n in w.shape) + "]" + (f"/{tensor_shards}" if tensor_shards > 1 else "")


def _normalize_mesh(strategy: str, mesh: Mapping[str, int]) -> dict[str, int]:
    """The strategy's mesh axes (twinshard/parallel/mesh.py NEEDS), a missing one as 1, checked."""
    axes = tuple(a for a in AXES if a in mesh_lib.NEEDS[strategy])
    unknown = [a for a in mesh if a not in axes]
    if unknown:
        example = ", ".join(f"'{a}': {a[0]}" for a in axes)
        raise ValueError(f"mesh axis {unknown[0]!r} is not one of {axes}; write the mesh as {{{example}}}.")
    shape = {a: int(mesh.get(a, 1)) for a in axes}
    for a, n in shape.items():
        if n < 1:
            raise ValueError(f"mesh axis {a}={n} must be >= 1.")
    mesh_lib.check_mesh(strategy, shape, math.prod(shape.values()))
    return shape


def cost(cfg: ModelConfig, strategy: str, mesh: Mapping[str, int], batch_size: int,
         seq_len: int | None = None, dtype_bytes: int | None = None, grad_accum: int = 1,
         microbatches: int = 1, optimizer: str = "adamw", remat: str | None = None,
         schedule: str = "gpipe") -> Cost:
    """Collectives, FLOPs and per-device memory of one train step of `strategy` on `mesh`.

    grad_accum: micro-batches per step (TrainConfig.grad_accum); each device's batch must
    split into that many. microbatches: a pipeline's M. optimizer: TrainConfig.optimizer
    (memory only).

    mesh: {'data': d, 'tensor': t} (a missing axis is 1). `remat` (default: `cfg.remat`)
    changes the activation memory only: under every policy the manual twin runs the
    same collectives (FSDP re-gathers each matrix once in the backward pass whatever the
    policy; TP's g outputs are saved, never recomputed: manual_parallel/base.py), except
    tp_sp, which re-gathers its sequence shards under any policy but none (manual_parallel/tp_sp.py). Invalid
    input raises ValueError naming the value and the fix (unknown strategy, wrong axes for
    the strategy, a dimension not divisible by its mesh axis, seq_len > context_length).
    """
    mesh_lib.check_strategy(strategy)
    if cfg.collective_matmul and strategy != "tp_sp":
        raise ValueError(f"collective_matmul decomposes tp_sp's sequence all-gathers; strategy {strategy} has "
                         "none: use strategy tp_sp or collective_matmul=False.")
    if strategy not in STRATEGY_ROWS:
        raise ValueError(f"strategy {strategy!r} has no cost model; choose one of {', '.join(STRATEGY_ROWS)}.")
    shape = _normalize_mesh(strategy, mesh)
    seq = cfg.context_length if seq_len is None else int(seq_len)
    if not 1 <= seq <= cfg.context_length:
        raise ValueError(f"seq_len={seq} must be in [1, context_length={cfg.context_length}]; "
                         "pass a smaller seq_len or a model with a longer context.")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be positive.")
    if dtype_bytes is None:  # the config's compute dtype
        dtype_bytes = DTYPE_BYTES[cfg.dtype]
    if dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes={dtype_bytes} must be 1, 2, 4 or 8 (4 for float32).")
    dims = {"batch": batch_size, "embed": cfg.d_model, "heads": cfg.num_heads,
            "mlp": cfg.d_ff, "vocab": cfg.padded_vocab_size, "seq": seq}
    if strategy in PIPELINES:
        from twinshard.parallel import pipeline

        pipeline.check(cfg.num_layers, batch_size, shape["stage"], microbatches, data=shape["data"])
    mesh_lib.check_divisible(dims, {k: v for k, v in RULES[strategy].items() if k != "layers"}, shape)
    local = batch_size // shape["data"] if "batch" in RULES[strategy] else batch_size
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1 or local % grad_accum:
        raise ValueError(f"grad_accum={grad_accum!r} must be an int >= 1 that divides the per-device batch "
                         f"of {local} sequences; choose one of {[k for k in range(1, local + 1) if local % k == 0]}.")
    if remat is not None:  # tp_sp's collectives depend on it (its re-gathers), the others' do not
        cfg = dataclasses.replace(cfg, remat=remat)
    ctx = _Ctx(cfg, shape, batch_size, seq, dtype_bytes, grad_accum, microbatches, schedule)
    rows = sorted(STRATEGY_ROWS[strategy](ctx), key=lambda r: PHASES.index(r.phase))  # stable
    notes = [n for n in _NOTES.get(strategy, ())]
    return Cost(strategy, shape, batch_size, seq, dtype_bytes, rows,
                flops(cfg, batch_size, seq, math.prod(shape.values())),
                memory(cfg, strategy, shape, batch_size, seq, dtype_bytes, grad_accum, microbatches, optimizer,
                       remat, schedule), notes)


_NOTES = {
    "tp": ["the cross-entropy max is an all-reduce with max (pmax); the ledger does not tell max from sum"],
    "fsdp_tp": ["the cross-entropy max is an all-reduce with max (pmax); the ledger does not tell max from sum"],
    "tp_sp": ["the cross-entropy max is an all-reduce with max (pmax); the ledger does not tell max from sum"],
}


# ----------------------------------------------------------------------------- comparing with a ledger


def summarize(rows: list[Row]) -> dict[tuple[str, tuple[str, ...]], dict[str, Any]]:
    """(op, axes) -> {count, bytes, ring_bytes}; a collective-permute's also `patterns`:
    {pattern: count}, as `Ledger.summary()`."""
    out: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
    for r in rows:
        s = out.setdefault((r.op, r.axes), {"count": 0, "bytes": 0, "ring_bytes": 0.0})
        s["count"] += r.count
        s["bytes"] += r.bytes
        s["ring_bytes"] += r.ring_bytes
        if r.pattern:
            patterns = s.setdefault("patterns", {})
            patterns[r.pattern] = patterns.get(r.pattern, 0) + r.count
    return out


def compare(measured: Mapping[tuple[str, tuple[str, ...]], Mapping[str, float]],
            model: Mapping[tuple[str, tuple[str, ...]], Mapping[str, float]]) -> list[dict[str, Any]]:
    """One row per (op, axes) in either summary: measured and model count/bytes/ring bytes.

    `measured` is `Ledger.summary()`, `model` is `Cost.summary()`; `match` is True when
    count and bytes agree exactly and, where the model says who sends to whom (a
    collective-permute's `patterns`), the measured patterns are those, count for count.
    """
    zero = {"count": 0, "bytes": 0, "ring_bytes": 0.0}
    keys = list(model) + [k for k in measured if k not in model]
    out = []
    for op, axes in keys:
        got, want = measured.get((op, axes), zero), model.get((op, axes), zero)
        out.append({
            "op": op, "axes": list(axes),
            "measured_count": got["count"], "model_count": want["count"],
            "measured_bytes": got["bytes"], "model_bytes": want["bytes"],
            "measured_ring_bytes": got["ring_bytes"], "model_ring_bytes": want["ring_bytes"],
            "match": got["count"] == want["count"] and got["bytes"] == want["bytes"]
            and ("patterns" not in want or got.get("patterns") == want["patterns"]),
            **({"measured_patterns": got.get("patterns", {}), "model_patterns": want["patterns"]}
               if "patterns" in want else {}),
        })
    return out


def compare_table(rows: list[dict[str, Any]]) -> str:
    """`compare` rows as text, with measured/model ratios and per-axis totals."""
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.3f}" if b else ("-" if not a else "inf")

    head = ("op", "axes", "count meas/model", "bytes meas", "bytes model", "meas/model",
            "ring meas", "ring model", "")
    lines = [(r["op"], ",".join(r["axes"]) or "-", f"{r['measured_count']}/{r['model_count']}",
              human(r["measured_bytes"]), human(r["model_bytes"]), ratio(r["measured_bytes"], r["model_bytes"]),
              human(r["measured_ring_bytes"]), human(r["model_ring_bytes"]), "ok" if r["match"] else "DIFFERS"
              + (f" who sends to whom: measured {r['measured_patterns']}, model {r['model_patterns']}"
                 if r.get("measured_patterns", {}) != r.get("model_patterns", {}) else ""))
             for r in rows]
    totals: dict[tuple[str, ...], list[float]] = {}
    for r in rows:
        acc = totals.setdefault(tuple(r["axes"]), [0, 0, 0, 0, 0.0, 0.0])
        for i, k in enumerate(("measured_count", "model_count", "measured_bytes", "model_bytes",
                               "measured_ring_bytes", "model_ring_bytes")):
            acc[i] += r[k]
    for axes, (mc, wc, mb, wb, mr, wr) in totals.items():
        lines.append(("TOTAL", ",".join(axes) or "-", f"{mc}/{wc}", human(mb), human(wb), ratio(mb, wb),
                      human(mr), human(wr), "ok" if (mc, mb) == (wc, wb) else "DIFFERS"))
    return "\n".join(_fmt_table(head, lines) if lines else ["(no collectives)"])


# ----------------------------------------------------------------------------- text


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def _fmt_table(head: tuple[str, ...], lines: list[tuple]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]

    def fmt(r) -> str:
        return "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()

    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines]
