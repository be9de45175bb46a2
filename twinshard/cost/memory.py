"""Bytes per device of one train step (`memory`, `Memory`): params, gradients, optimizer
state, the activations saved for the backward pass and the transient working sets, in the
notation of twinshard/cost/__init__.py.

Memory per device (`Memory`, bytes):
    params     sum over leaves of leaf bytes / (its data shards x tensor shards), float32 as
               this project trains (`param_bytes` = 4; 2 models bf16 weights)
    grads      = params (same sharding and dtype)
    master     a float32 copy of params stored narrower (`master`; 0 by default)
    optimizer  by `optimizer`, `state_bytes` per element (4; O(1) counters and placeholders
               ignored): adamw 2 x the params' elements (mu, nu); lion, sgd 1 x (mu;
               momentum trace); adafactor, per leaf with two dims >= 128
               (optimizer_state.factored_dims) a row and a column statistic (the leaf without its
               largest / second-largest dim, each split over the mesh axes of the dims
               it keeps), else a full v
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
                   [T, T] array: layers.recompute_attention (the default off-GPU) recomputes
                   the probabilities in the backward pass, which `attention_backward` counts;
                   cuDNN flash attention (the default on a GPU in bf16: `gpu`) keeps none at all.
                   (Autodiff of the reference or of jax.nn's XLA attention would save the
                   scores and the probabilities, 2 x [b,H/t,T,T] f32 per layer, instead of o.)
                   Grouped-query attention: k and v are kv_local = Hkv*dh/min(t, Hkv) wide,
                   not D/t (3D/t + 2 kv_local in place of 5D/t, also in the policies below),
                   and where t > Hkv the layer keeps its two kv head slices [D, dh].
        full       b*T*D: the layer input (the checkpoint's argument); + b*T*D under
                   tensor parallelism, the attention block's g output (the manual twin
                   saves Megatron g's psum outputs so no all-reduce is recomputed, and
                   needs the first one to rebuild the residual stream)
        dots_no_batch  b*T*(2D + 3D/t + 2F/t): the input, q, k, v, output_proj's
                   output (TP: g's psum of it), w1 and w3 outputs. w2's output is a dot
                   too, but the backward pass never reads it: JAX saves what is read.
        dots       dots_no_batch + b*T*D/t (the AV product) + b*(H/t)*T^2 (the QK^T scores)
        save_qkv_proj  b*T*(D + D/t + 2 kv_local): the input and the named q, k, v; + b*T*D under
                   tensor parallelism (Megatron g's output, as full)
        minimal    b*T*(2D + 3D/t + 2 kv_local + H/t + 2F/t): the input, the named q, k, v, the
                   attention kernel's o and lse (layers.ATTENTION_RESIDUALS), the merged context,
                   out_proj's output (TP: g's psum of it) and w1, w3 outputs; w2's output is named
                   but never read by the backward pass (tp_sp: no model for the name policies)
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
        cp, fsdp_cp  those of T/C tokens, plus the C-1 received K and V blocks and each ring
                   step's statistics (its probabilities are recomputed: `_cp_activations`)
        final      2*b*T*D (ln_final in/out; tp_sp: b*T*D/t in, b*T*D gathered out) + b*T*V/t (logits) x s, and b*T*V/t x 4
        (exp(z - max) in the f32 loss); the rest x s bytes. With ModelConfig.loss_chunks = n
        (vocabulary tiling, twinshard/model/loss.py) the logits terms are one chunk's, b*T/n*V/t
        x (s + 4), plus each token's log-sum-exp b*T x 4 and the f32 lm_head gradient
        accumulator D*V/t x 4 of the chunk loop. Not rematerialized by any
        policy (the manual FSDP twin checkpoints the lm_head matmul alone, which keeps
        its input and output). An estimate: XLA fuses, recomputes and frees buffers
        (compare with `compiled.memory_analysis()`; tests/test_remat.py states the factor).
    gathered_weights (fsdp, fsdp_tp, fsdp_cp, fsdp_ep: transient) one layer's gathered
        matrices (of the stack whose layer is largest: ModelConfig.stacks) or the gathered
        embedding / lm_head V*D/t, whichever is larger, x s bytes (gathered in the compute
        dtype). Each matrix is the piece one device uses (weights.local_bytes): full/t
        elements (Megatron's column pieces under fsdp_tp), grouped-query attention's k and v
        full/min(t, Hkv), the experts E/ep of E (a MoE layer's 8 matrices with the router,
        which stays float32). pp_fsdp: the stage's L/S layers, embedding and lm_head, for the
        whole step (GPipe in float32), + their float32 gradient as `accumulator`.

Gradient accumulation (`grad_accum` = K > 1, micro-batches of b/K sequences):
activations of one micro-batch, plus `accumulator`, the float32 gradient accumulator
(dp, tp: the local params' size; under FSDP the whole matrices over data, each the piece
a device uses as above, and the norm gains), and under FSDP `gathered_weights` becomes every
matrix, those same pieces gathered in the compute dtype: both are resident for the whole step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from twinshard.config import PIPELINE_SCHEDULES, REMAT_POLICIES, ModelConfig
from twinshard.cost.weights import F32, kv_replicated, local_bytes, rules as placed_rules, shard_count, weights
from twinshard.optimizer_state import factored_dims
from twinshard.parallel import context, mesh as mesh_lib, strategies


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
    master: int = 0  # float32 master copy of params stored narrower (`master=True`; 0 otherwise)

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations + self.gathered_weights
                + self.accumulator + self.backward_layer + self.master)

    @property
    def temporaries(self) -> int:
        """What XLA's memory_analysis() counts as temporaries (not arguments): all but the
        params, the master copy and the optimizer state, the (donated) step's arguments."""
        return self.total - self.params - self.optimizer - self.master


def _optimizer_bytes(cfg: ModelConfig, rules: Mapping[str, str], mesh: Mapping[str, int],
                     optimizer: str, state_bytes: int = F32) -> int:
    """Optimizer-state bytes per device, `state_bytes` per element (see the module docstring)."""
    def kept(shape, axes, dims) -> int:  # elements per device of a statistic keeping `dims`
        split = math.prod(mesh_lib.axis_size(mesh, rules[axes[k]]) for k in dims if axes[k] in rules)
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
    return total * state_bytes


def kv_local(cfg: ModelConfig, t: int) -> int:
    """The key/value width one device computes over t tensor shards: Hkv*dh / min(t, Hkv) (D/t
    without grouped-query attention; one kv head's dh where t > Hkv)."""
    return cfg.kv_dim // min(t, cfg.kv_heads)


def _kv_slices(cfg: ModelConfig, remat: str, t: int) -> int:
    """Elements of the two kv head slices [D, dh] (k, v) a layer of the manual tp twins keeps for
    its backward pass under remat=none where t > Hkv (the matmuls' weights are the slices,
    manual_parallel/tp.py); a remat policy recomputes them. Not batch-sized."""
    return 2 * cfg.d_model * cfg.head_dim if remat == "none" and kv_replicated(cfg, {"tensor": t}) else 0


def saved_per_layer(cfg: ModelConfig, remat: str, b: int, seq: int, t: int, sequence: bool = False,
                    exchange: int = 0) -> int:
    """Elements one layer saves for the backward pass under `remat` (module docstring);
    b sequences per device, t tensor shards (1 without tensor parallelism); `sequence`:
    Megatron sequence parallelism (tp_sp), the residual stream on sequence shards; `exchange`:
    the expert axis a dropless mixture of experts exchanges its rows over (0: none, `moe_saved`).
    Grouped-query attention's k and v are `kv_local` wide (D/t without it)."""
    d, f, h = cfg.d_model, cfg.d_ff, cfg.num_heads
    kv = kv_local(cfg, t)
    scores = b * (h // t) * seq * seq  # [b, H/t, T, T]
    if sequence:
        return _saved_per_layer_sequence(cfg, remat, b, seq, t, scores)
    if remat == "none":  # what autodiff saves: JAX's print_saved_residuals, listed in the docstring
        ffn = moe_saved(cfg, b * seq, exchange) if cfg.num_experts else b * seq * 3 * f // t
        return b * seq * (6 * d + 3 * d // t + 2 * kv + 4 + h // t) + ffn + _kv_slices(cfg, remat, t)
    if cfg.num_experts and remat != "full":
        raise ValueError(f"remat={remat!r} has no memory model for a mixture of experts; the model covers "
                         "remat=none and remat=full.")
    if remat == "full":
        return b * seq * d * (2 if t > 1 else 1)  # + Megatron g's output under tp
    if remat == "save_qkv_proj":  # the input, q, k, v (+ Megatron g's output under tp, as full)
        return b * seq * (d + d // t + 2 * kv + (d if t > 1 else 0))
    if remat == "minimal":  # the input, q, k, v, the kernel's o and lse, context, out_proj, w1 and w3 outputs
        return b * seq * (2 * d + 3 * d // t + 2 * kv + h // t + 2 * f // t)
    no_batch = b * seq * (2 * d + d // t + 2 * kv + 2 * f // t)
    if remat == "dots_no_batch":
        return no_batch
    if remat == "dots":
        return no_batch + b * seq * d // t + scores
    raise ValueError(f"remat={remat!r} has no memory model; choose one of {', '.join(REMAT_POLICIES)}.")


def saved_by_stacks(cfg: ModelConfig, remat: str, b: int, seq: int, t: int, sequence: bool = False,
                    exchange: int = 0) -> int:
    """Elements all L layers save: each stack of ModelConfig.stacks (the first dense layers, then
    the MoE layers) n x `saved_per_layer` of its own layers."""
    return sum(stack.num_layers * saved_per_layer(stack, remat, b, seq, t, sequence, exchange)
               for _, stack in cfg.stacks)


def moe_saved(cfg: ModelConfig, tokens: int, exchange: int = 0) -> int:
    """Elements a mixture-of-experts feed-forward saves for its backward pass (remat=none) on
    `tokens` local tokens in G = tokens/S groups, whichever devices its experts run on (the
    buffers have E G C rows in all): per expert buffer [E, G, C, .] its input and output (D) and
    SwiGLU's w1 and w3 outputs and gate (F_e); per token the router's probabilities (E), the
    chosen experts' one-hots (k E) and buffer slots (k C), the dispatch and combine masks (2 E C),
    the chosen weights and ids (2k) and 4 softmax / top-k statistics; per group the mean
    probabilities (E). Exact against JAX's print_saved_residuals (tests/test_experts.py)."""
    if cfg.moe_dispatch == "ragged":
        return _ragged_saved(cfg, tokens, exchange)
    e, k, c, s = cfg.num_experts, cfg.experts_per_token, cfg.expert_capacity, cfg.moe_group
    groups = tokens // s
    buffers = e * groups * c * (2 * cfg.d_model + 3 * cfg.expert_ff)
    return buffers + tokens * (4 + 2 * k + e + k * e + k * c + 2 * e * c) + groups * e


def _ragged_saved(cfg: ModelConfig, tokens: int, exchange: int) -> int:
    """`moe_saved` of the dropless rows (moe_dispatch='ragged') on A = tokens k assignments: the
    router's as the dense path's (probabilities E, 4 + 2k statistics per token, the group means),
    the sort's order and inverse [A] and the chosen weights [A], the combined outputs [A, D], and
    where the experts run, their input rows [R, D] and SwiGLU's w1 and w3 outputs and gate
    [R, F_e]. One device (and the GSPMD twin, which runs the same math): R = A, plus the
    assignments per expert [E]. Manual ep over `exchange` devices: R = exchange x A (the static
    bound of ragged_dispatch's result) with each row's local expert and receive slot [R], the
    route's four [exchange] offsets and sizes and one scalar. Exact against JAX's
    print_saved_residuals on both (tests/test_ragged.py)."""
    e, k, d, f = cfg.num_experts, cfg.experts_per_token, cfg.d_model, cfg.expert_ff
    a = tokens * k
    router = tokens * (4 + 2 * k + e) + tokens // cfg.moe_group * e
    if not exchange:
        return router + 3 * a + 2 * a * d + 3 * a * f + e
    r = exchange * a
    return router + 3 * a + a * d + r * (2 + d + 3 * f) + 4 * exchange + 1


def attention_kernel(cfg: ModelConfig, gpu: bool = False) -> str:
    """The kernel layers.causal_attention runs for `cfg.attention` on a GPU (`gpu`) or off it:
    "auto" is cuDNN flash attention on a GPU in bfloat16 and the recompute kernel elsewhere."""
    if cfg.attention == "auto":
        return "cudnn" if gpu and cfg.dtype == "bfloat16" else "recompute"
    return cfg.attention


def attention_backward(cfg: ModelConfig, b: int, seq: int, t: int, kernel: str = "recompute") -> int:
    """Bytes of the [T, T] arrays one layer's attention backward holds at once under `kernel`
    (`attention_kernel`).

    recompute (layers.recompute_attention, the default off-GPU): the recomputed probabilities
    and d(q k^T), 2 x [b, H/t, T, T] float32 (XLA writes ds over dp). No layer saves a [T, T]
    array for the backward, so at long context this working set, not the residuals, is what
    grows with T^2. Measured (tiny, batch 4, one CPU device, temp_size_in_bytes against the
    model): T = 1024, 194.8 MiB against 75.0 without this term, 203.0 with it; T = 256, 25.8
    against 19.2 / 27.2.
    cudnn (flash attention, the default on a GPU in bf16): 0. Its forward and backward tile q k^T
    through on-chip memory and keep only o and the rows' softmax statistics, which the layer
    saves under any kernel (`saved_per_layer`): no [T, T] array is ever in HBM.
    splash (Pallas flash attention, layers.splash_attention; "auto" on a TPU in bf16, which this
    model, told only `gpu`, counts as recompute): 0, for the same reason. Its saved residuals are
    recompute's: q (scaled), k, v, o and the rows' logsumexp [b, H/t, T] f32 (print_saved_residuals,
    JAX 0.12), at T rounded up to 128.
    Not modelled: `--attention=xla` / `reference` save the scores and the probabilities in every
    layer (2 x [b,H/t,T,T] f32 per layer, uncounted; charged here as recompute's working set);
    under remat=dots in bf16 the saved q k^T is f32, counted at the compute dtype's bytes."""
    if kernel in ("cudnn", "splash"):
        return 0
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
    d, f, h, kv = cfg.d_model, cfg.d_ff, cfg.num_heads, kv_local(cfg, t)
    if remat == "none":  # 4 [b,T/t,D] + 4 [b,T/t,1] + 2 gathered [b,T,D] + q, k, v, o, lse + ...
        return (b * seq * (7 * d // t + 2 * kv + 2 * d + 3 * f // t + h // t) + 4 * b * seq // t
                + _kv_slices(cfg, remat, t))
    if remat == "full":  # the layer input and the attention block's reduce-scatter output, [b,T/t,D]
        return 2 * b * seq * d // t
    no_batch = b * seq * (3 * d // t + 2 * kv + 2 * f // t)  # the two [b,T/t,D] above, q, k, v, w1 and w3 outputs
    if remat == "dots_no_batch":
        return no_batch
    if remat == "dots":
        return no_batch + b * seq * d // t + scores
    raise ValueError(f"remat={remat!r} has no memory model; choose one of {', '.join(REMAT_POLICIES)}.")


def _cp_activations(cfg: ModelConfig, remat: str, b: int, seq: int, c: int, s: int) -> tuple[int, int, int]:
    """(saved elements of all layers, backward working set bytes, final bytes) of a device holding
    T/C tokens under ring attention: the position-wise residuals of T/C tokens (`saved_per_layer`
    with t = 1), plus what the ring's checkpointed merges keep: the C-1 received K and V blocks
    (saved under every policy: cp.py's layer_policy) and each step's running statistics (acc
    [b, H, T/C, dh], max and sum [b, H, T/C, 1]); the backward loop also rebuilds one block's
    scores and probabilities [b, H, T/C, T/C]. An estimate, like the rest of the activation model:
    measured totals (tools/long_context.py, d_model 64, 8 heads, L = 2, B = 1, context:8, T = 512,
    2048, 4096, 8192: 4.8, 15.5, 40.9, 131.5 MiB per device) against 4.9, 15.5, 36.7,
    103.0."""
    tc, d, v = seq // c, cfg.d_model, cfg.padded_vocab_size
    ring, block = ring_attention_memory(b, cfg.num_heads, tc, cfg.head_dim, c, cfg.kv_heads)
    layers = cfg.num_layers * (saved_per_layer(cfg, remat, b, tc, 1) + ring)
    backward_layer = (saved_per_layer(cfg, "none", b, tc, 1) + ring + block) * s
    final = (2 * b * tc * d + b * tc * v) * s + b * tc * v * F32
    return layers, backward_layer, final


def _ulysses_activations(cfg: ModelConfig, remat: str, b: int, seq: int, c: int, s: int,
                         kernel: str) -> tuple[int, int, int]:
    """cp's position-wise residuals of T/C tokens, with ulysses's attention (manual_parallel/ulysses.py)
    in place of the ring: under a remat policy each layer also keeps its 4 all-to-all outputs (q, k,
    v on head shards, the output back: T/C tokens' worth each); the backward loop rebuilds one
    layer's attention on [b, H/C, T, T] (`attention_backward` with C head shards)."""
    tc, d, v = seq // c, cfg.d_model, cfg.padded_vocab_size
    exchanged = b * tc * (2 * d + 2 * cfg.kv_heads * context.kv_repeats(cfg.num_heads, cfg.kv_heads, c) * cfg.head_dim)
    layers = cfg.num_layers * (saved_per_layer(cfg, remat, b, tc, 1) + (exchanged if remat != "none" else 0))
    backward_layer = (saved_per_layer(cfg, "none", b, tc, 1) + exchanged) * s + attention_backward(cfg, b, seq, c, kernel)
    final = (2 * b * tc * d + b * tc * v) * s + b * tc * v * F32
    return layers, backward_layer, final


def ring_attention_memory(b: int, h: int, tc: int, dh: int, c: int, kv_heads: int | None = None) -> tuple[int, int]:
    """(elements one layer's ring attention saves, elements its backward rebuilds at once) on a
    device holding q [b, h, T/C, dh] and k, v [b, hk, T/C, dh] (hk = kv_heads, h by default) of C
    shards (manual_parallel/ring_attention.py): the C-1 received K and V blocks and each of the C
    steps' running statistics (acc [b, h, T/C, dh], max and sum [b, h, T/C, 1]: a checkpointed
    merge saves its inputs only); the backward pass rebuilds one block's scores and probabilities
    [b, h, T/C, T/C] at a time."""
    kv = 2 * (c - 1) * b * (h if kv_heads is None else kv_heads) * tc * dh
    stats = c * (b * h * tc * dh + 2 * b * h * tc)
    return kv + stats, 2 * b * h * tc * tc


def memory(cfg: ModelConfig, strategy: str, mesh: Mapping[str, int], batch: int, seq: int,
           dtype_bytes: int = 4, grad_accum: int = 1, microbatches: int = 1,
           optimizer: str = "adamw", remat: str | None = None, schedule: str = "gpipe", gpu: bool = False,
           param_bytes: int = F32, state_bytes: int = F32, master: bool = False) -> Memory:
    """Bytes per device; `remat` (default `cfg.remat`) sets the activations, `schedule` (gpipe,
    1f1b) and `microbatches` a pipeline's, `gpu` the attention kernel "auto" runs
    (`attention_kernel`: cuDNN's keeps no [T, T] array) (module docstring). `param_bytes` per
    parameter and gradient element (4: the float32 params this project trains), `state_bytes` per
    optimizer-state element (4), `master`: a float32 copy of the params besides (mixed precision's
    master weights)."""
    mesh_lib.check_strategy(strategy)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not a pipeline schedule; choose one of "
                         f"{', '.join(PIPELINE_SCHEDULES)}.")
    remat = cfg.remat if remat is None else remat
    rules = placed_rules(strategy, cfg, mesh)
    masters = sum(w.count * w.size * F32 // shard_count(w, rules, mesh) for w in weights(cfg))  # as float32
    params = sum(w.count * w.size * param_bytes // shard_count(w, rules, mesh) for w in weights(cfg))
    t = mesh["tensor"] if "heads" in rules else 1
    b = (batch // mesh_lib.axis_size(mesh, rules["batch"]) if "batch" in rules else batch) // grad_accum  # one micro-batch
    d, v = cfg.d_model, cfg.padded_vocab_size
    sequence = "seq" in rules  # tp_sp: the residual stream on sequence shards
    # a dropless mixture of experts under ep: its rows exchanged over `expert` (the manual twin's)
    exchange = mesh.get("expert", 1) if "experts" in rules and cfg.moe_dispatch == "ragged" else 0
    layers = saved_by_stacks(cfg, remat, b, seq, t, sequence, exchange)
    head = b  # rows the lm_head and the loss run on at once
    if "layers" in rules:  # a pipeline stage: its L/S layers on micro-batches of b/M rows
        layers, b = _pipeline_activations(cfg, remat, b, seq, mesh["stage"], microbatches, schedule)
        head = b if schedule == "1f1b" else head  # GPipe: the loss of all M micro-batches at once
    # The backward loop holds one layer's worth of residuals at a time beyond what was saved:
    # rebuilt under remat, their cotangents without (measured with memory_analysis: without
    # this term the model missed 25-30% of tiny's and 15% of small's single-device temporaries).
    backward_layer = (max(saved_per_layer(stack, "none", b, seq, t, sequence, exchange) for _, stack in cfg.stacks)
                      * dtype_bytes + attention_backward(cfg, b, seq, t, attention_kernel(cfg, gpu)))
    ln_final = head * seq * d // t + head * seq * d if sequence else 2 * head * seq * d  # tp_sp: on shards, gathered
    final = (ln_final + head * seq * v // t) * dtype_bytes + head * seq * v // t * F32  # f32 loss
    if cfg.loss_chunks:  # vocabulary tiling: one chunk's logits, each token's lse, the f32 dW accumulator
        final = (ln_final * dtype_bytes + head * seq // cfg.loss_chunks * v // t * (dtype_bytes + F32)
                 + head * seq * F32 + d * v // t * F32)
    if rules.get("seq") == "context":  # T/C tokens per device, ring attention's residuals
        layers, backward_layer, final = (
            _ulysses_activations(cfg, remat, b, seq, mesh["context"], dtype_bytes, attention_kernel(cfg, gpu))
            if strategy in strategies.ALL_TO_ALL_CONTEXT else _cp_activations(cfg, remat, b, seq, mesh["context"], dtype_bytes))
    acts = layers * dtype_bytes + final
    def layer(s: int) -> int:  # one layer's gathered matrices in s bytes (E/ep experts, the router in
        # float32), the largest stack's
        return max(sum(w.count // w.layers * local_bytes(cfg, w, mesh, t, s)
                       for w in weights(stack) if w.is_matrix and w.stacked) for _, stack in cfg.stacks)

    def stage(s: int) -> int:  # pp_fsdp: the stage's L/S layers, embedding and lm_head in s bytes
        return cfg.num_layers // mesh["stage"] * layer(s) + 2 * v * d * s

    gathered = max(layer(dtype_bytes), v * d // t * dtype_bytes) if "embed" in rules else 0
    opt = _optimizer_bytes(cfg, rules, mesh, optimizer, state_bytes)
    copy = masters if master else 0
    if "layers" in rules and "embed" in rules:  # pp_fsdp: the stage gathered for the step, GPipe's tick loop
        # reading it as float32 (manual_parallel/pp.py `_gpipe`), 1F1B in the compute dtype; + the float32
        # gradient of what it gathered
        gathered = stage(F32 if schedule == "gpipe" else dtype_bytes)
        return Memory(params, params, opt, acts, gathered, stage(F32), backward_layer, copy)
    if grad_accum == 1:
        return Memory(params, params, opt, acts, gathered, 0, backward_layer, copy)
    # the f32 accumulator of the micro-batch scan: param-sized (DP, TP); under FSDP it holds the
    # gradient of the WHOLE matrices (gather_step), so it and the gathered weights are full over data
    # (the piece a device uses: its E/ep experts, a replicated kv weight's 1/Hkv slice, the norm gains whole)
    accumulator = masters
    if "embed" in rules:
        accumulator = sum(w.count * local_bytes(cfg, w, mesh, t, F32) for w in weights(cfg))
        gathered = sum(w.count * local_bytes(cfg, w, mesh, t, dtype_bytes) for w in weights(cfg) if w.is_matrix)
    return Memory(params, params, opt, acts, gathered, accumulator, backward_layer, copy)
