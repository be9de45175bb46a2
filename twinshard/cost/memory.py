"""Bytes per device of one train step (`memory`, `Memory`): params, gradients, optimizer state,
the activations saved for the backward pass and the transient working sets. The formulas, per
part and per remat policy, are in docs/memory.md ("The memory model")."""

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
    """Bytes per device (docs/memory.md has the formula)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    gathered_weights: int  # transient FSDP working set (0 without FSDP)
    accumulator: int = 0  # the gradient sum of grad_accum > 1, float32 or the weight dtype (0 without accumulation)
    # one layer's residuals (rebuilt under remat) or their cotangents: saved_per_layer(..., "none")
    backward_layer: int = 0
    master: int = 0  # float32 master copy of params stored narrower (`master=True`; 0 otherwise)

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations + self.gathered_weights
                + self.accumulator + self.backward_layer + self.master)

    @property
    def temporaries(self) -> int:
        """What memory_analysis() counts as temporaries: all but params, master copy and optimizer state."""
        return self.total - self.params - self.optimizer - self.master


def _optimizer_bytes(cfg: ModelConfig, rules: Mapping[str, str], mesh: Mapping[str, int],
                     optimizer: str, state_bytes: int = F32) -> int:
    """Optimizer-state bytes per device, `state_bytes` per element."""
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
    """Key/value width one device computes over t tensor shards: Hkv*dh / min(t, Hkv)."""
    return cfg.kv_dim // min(t, cfg.kv_heads)


def _kv_slices(cfg: ModelConfig, remat: str, t: int) -> int:
    """Elements of the two kv head slices [D, dh] a manual tp layer keeps under remat=none where t > Hkv."""
    return 2 * cfg.d_model * cfg.head_dim if remat == "none" and kv_replicated(cfg, {"tensor": t}) else 0


def saved_per_layer(cfg: ModelConfig, remat: str, b: int, seq: int, t: int, sequence: bool = False,
                    exchange: int = 0) -> int:
    """Elements one layer saves for the backward pass under `remat`; t tensor shards, `sequence`:
    tp_sp, `exchange`: the expert axis a dropless MoE exchanges rows over (0: none)."""
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
    if remat == "save_dot_except_mlp":  # minimal without the MLP's w1 and w3 outputs
        return b * seq * (2 * d + 3 * d // t + 2 * kv + h // t)
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
    """Elements all L layers save: `saved_per_layer` summed over ModelConfig.stacks."""
    return sum(stack.num_layers * saved_per_layer(stack, remat, b, seq, t, sequence, exchange)
               for _, stack in cfg.stacks)


def moe_saved(cfg: ModelConfig, tokens: int, exchange: int = 0) -> int:
    """Elements a mixture-of-experts feed-forward saves (remat=none) on `tokens` local tokens in
    tokens/S groups: expert buffers [E, G, C, .] (input, output, w1/w3 outputs, gate), per-token
    router state and per-group mean probabilities. Exact against print_saved_residuals (tests/test_experts.py)."""
    if cfg.moe_dispatch == "ragged":
        return _ragged_saved(cfg, tokens, exchange)
    e, k, c, s = cfg.num_experts, cfg.experts_per_token, cfg.expert_capacity, cfg.moe_group
    groups = tokens // s
    buffers = e * groups * c * (2 * cfg.d_model + 3 * cfg.expert_ff)
    return buffers + tokens * (4 + 2 * k + e + k * e + k * c + 2 * e * c) + groups * e


def _ragged_saved(cfg: ModelConfig, tokens: int, exchange: int) -> int:
    """`moe_saved` of the dropless rows (moe_dispatch='ragged') on A = tokens*k assignments; under
    manual ep over `exchange` devices the expert rows are R = exchange*A (ragged_dispatch's static
    bound). Exact against print_saved_residuals (tests/test_ragged.py)."""
    e, k, d, f = cfg.num_experts, cfg.experts_per_token, cfg.d_model, cfg.expert_ff
    a = tokens * k
    router = tokens * (4 + 2 * k + e) + tokens // cfg.moe_group * e
    if not exchange:
        return router + 3 * a + 2 * a * d + 3 * a * f + e
    r = exchange * a
    return router + 3 * a + a * d + r * (2 + d + 3 * f) + 4 * exchange + 1


def attention_kernel(cfg: ModelConfig, gpu: bool = False, tpu: bool = False) -> str:
    """The kernel layers.causal_attention runs: "auto" is cuDNN on a GPU and splash on a TPU in bfloat16,
    else recompute."""
    if cfg.attention == "auto":
        half = cfg.dtype == "bfloat16"
        return "cudnn" if gpu and half else "splash" if tpu and half else "recompute"
    return cfg.attention


def attention_backward(cfg: ModelConfig, b: int, seq: int, t: int, kernel: str = "recompute") -> int:
    """Bytes of the [T, T] arrays one layer's attention backward holds at once under `kernel`.

    recompute: the recomputed probabilities and d(q k^T), 2 x [b, H/t, T, T] f32; at long context
    this, not the residuals, grows with T^2 (measured, tiny, batch 4, one CPU device: T = 1024
    temp 194.8 MiB against 75.0 without this term, 203.0 with it). cudnn and splash: 0 (flash
    attention tiles q k^T on chip). Not modelled: attention=xla/reference save 2 x [b,H/t,T,T] per layer."""
    if kernel in ("cudnn", "splash"):
        return 0
    return 2 * b * (cfg.num_heads // t) * seq * seq * F32


def _pipeline_activations(cfg: ModelConfig, remat: str, b: int, seq: int, stages: int, microbatches: int,
                          schedule: str, virtual: int, dtype_bytes: int) -> tuple[int, int, int]:
    """(saved elements, rows of one micro-batch, kept bytes) of a pipeline stage: gpipe saves the L/S
    layers' residuals of all M + S - 1 ticks; a schedule run by hand one backward's residuals (a chunk
    of L/(S V) layers) and its rings of [b/M, T, D] inputs and gradients (pipeline.buffers' slots and a
    spare each, manual_parallel/pp.py); zb_h1 also a ring of stashes kept from each B to its W
    (`split_stash`; pipeline.buffers' res slots and the spare)."""
    from twinshard.parallel import pipeline

    rows, held = b // microbatches, cfg.num_layers // stages
    if schedule == "gpipe":
        return held * saved_per_layer(cfg, remat, rows, seq, 1) * pipeline.ticks(microbatches, stages), rows, 0
    sizes = pipeline.buffers(pipeline.build(schedule, stages, microbatches, virtual)).sizes
    backward = held // virtual * saved_per_layer(cfg, remat, rows, seq, 1)
    rings = (sizes["act"] + sizes["grad"] + 2) * rows * seq * cfg.d_model
    if schedule not in pipeline.SPLIT:
        return backward + rings, rows, 0
    return backward + rings, rows, (sizes["res"] + 1) * split_stash(cfg, rows * seq, stages, dtype_bytes)


def split_stash(cfg: ModelConfig, tokens: int, stages: int, dtype_bytes: int) -> int:
    """Bytes one zb_h1 B keeps for its W (manual_parallel/pp_split.py) on a micro-batch's `tokens`: per
    block the operands of its tapped ops (the two norms' x^ in float32; in the compute dtype the normed
    inputs of q/k/v and of w1/w3, the attention output, the SwiGLU gate) and their outputs' gradients
    (the 2 norms, q, k, v, wo, w1, w3, w2). Only the blocks are split: the head's whole backward runs in
    B and the embedding's gradient is added there, so neither keeps anything for W."""
    d, f = cfg.d_model, cfg.d_ff
    hd, kv = cfg.num_heads * cfg.head_dim, cfg.kv_dim
    block = 2 * d * F32 + (2 * d + hd + f + 4 * d + hd + 2 * kv + 2 * f) * dtype_bytes  # operands, then dy's
    return tokens * cfg.num_layers // stages * block


def _saved_per_layer_sequence(cfg: ModelConfig, remat: str, b: int, seq: int, t: int, scores: int) -> int:
    """tp_sp's saved residuals per layer, exact against print_saved_residuals (tests/test_sequence.py):
    outside the tensor-parallel regions TP's / t; under `none` also the two gathered [b, T, D] inputs."""
    d, f, h, kv = cfg.d_model, cfg.d_ff, cfg.num_heads, kv_local(cfg, t)
    if remat == "none":  # 4 [b,T/t,D] + 4 [b,T/t,1] + 2 gathered [b,T,D] + q, k, v, o, lse + ...
        return (b * seq * (7 * d // t + 2 * kv + 2 * d + 3 * f // t + h // t) + 4 * b * seq // t
                + _kv_slices(cfg, remat, t))
    if remat == "full":  # the layer input [b,T/t,D] alone (manual_parallel/tp_sp.py's layer_policy)
        return b * seq * d // t
    no_batch = b * seq * (3 * d // t + 2 * kv + 2 * f // t)  # the two [b,T/t,D] above, q, k, v, w1 and w3 outputs
    if remat == "dots_no_batch":
        return no_batch
    if remat == "dots":
        return no_batch + b * seq * d // t + scores
    raise ValueError(f"remat={remat!r} has no memory model; choose one of {', '.join(REMAT_POLICIES)}.")


def _cp_activations(cfg: ModelConfig, remat: str, b: int, seq: int, c: int, s: int) -> tuple[int, int, int]:
    """(saved elements, backward working set bytes, final bytes) of T/C tokens under ring attention.
    Measured (tools/long_context.py, d_model 64, 8 heads, L = 2, context:8, T = 512..8192): 4.8,
    15.5, 40.9, 131.5 MiB per device against 4.9, 15.5, 36.7, 103.0 modelled."""
    tc, d, v = seq // c, cfg.d_model, cfg.padded_vocab_size
    ring, block = ring_attention_memory(b, cfg.num_heads, tc, cfg.head_dim, c, cfg.kv_heads)
    layers = cfg.num_layers * (saved_per_layer(cfg, remat, b, tc, 1) + ring)
    backward_layer = (saved_per_layer(cfg, "none", b, tc, 1) + ring + block) * s
    final = (2 * b * tc * d + b * tc * v) * s + b * tc * v * F32
    return layers, backward_layer, final


def _ulysses_activations(cfg: ModelConfig, remat: str, b: int, seq: int, c: int, s: int,
                         kernel: str) -> tuple[int, int, int]:
    """cp's residuals of T/C tokens with ulysses attention: + 4 all-to-all outputs per layer under a
    remat policy; the backward rebuilds one layer's attention on [b, H/C, T, T]."""
    tc, d, v = seq // c, cfg.d_model, cfg.padded_vocab_size
    kv = 2 * cfg.kv_heads * context.kv_repeats(cfg.num_heads, cfg.kv_heads, c) * cfg.head_dim  # k, v as exchanged
    exchanged = b * tc * (2 * d + kv)
    # remat=none saves k and v as exchanged: with GQA repeated to a multiple of C, wider than saved_per_layer's
    extra = exchanged if remat != "none" else b * tc * (kv - 2 * cfg.kv_dim)
    layers = cfg.num_layers * (saved_per_layer(cfg, remat, b, tc, 1) + extra)
    backward_layer = (saved_per_layer(cfg, "none", b, tc, 1) + exchanged) * s + attention_backward(cfg, b, seq, c, kernel)
    final = (2 * b * tc * d + b * tc * v) * s + b * tc * v * F32
    return layers, backward_layer, final


def ring_attention_memory(b: int, h: int, tc: int, dh: int, c: int, kv_heads: int | None = None) -> tuple[int, int]:
    """(elements one layer's ring attention saves, elements its backward rebuilds at once): the C-1
    received K/V blocks and C steps' statistics; one block's [b, h, T/C, T/C] scores in the backward."""
    kv = 2 * (c - 1) * b * (h if kv_heads is None else kv_heads) * tc * dh
    stats = c * (b * h * tc * dh + 2 * b * h * tc)
    return kv + stats, 2 * b * h * tc * tc


def memory(cfg: ModelConfig, strategy: str, mesh: Mapping[str, int], batch: int, seq: int,
           dtype_bytes: int = 4, grad_accum: int = 1, microbatches: int = 1,
           optimizer: str = "adamw", remat: str | None = None, schedule: str = "gpipe", gpu: bool = False,
           param_bytes: int = F32, state_bytes: int = F32, master: bool = False, virtual: int = 1, tpu: bool = False,
           accum_bytes: int = F32) -> Memory:
    """Bytes per device; `remat` defaults to cfg.remat, `gpu` or `tpu` picks the "auto" attention kernel,
    `param_bytes` / `state_bytes` per param / optimizer-state element, `accum_bytes` per element of the
    micro-batch gradient sum (--grad_accum_dtype), `master` a float32 copy,
    `virtual` a pipeline stage's chunks (interleaved)."""
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
    head, kept = b, 0  # rows the lm_head and the loss run on at once; zb_h1's stashes (bytes)
    if "layers" in rules:  # a pipeline stage: its L/S layers on micro-batches of b/M rows
        layers, b, kept = _pipeline_activations(cfg, remat, b, seq, mesh["stage"], microbatches, schedule, virtual,
                                                dtype_bytes)
        head = b if schedule != "gpipe" else head  # GPipe: the loss of all M micro-batches at once
    # one layer's residuals beyond what was saved (without this term the model missed 25-30% of
    # tiny's single-device temporaries, measured with memory_analysis)
    backward_layer = (max(saved_per_layer(stack, "none", b, seq, t, sequence, exchange) for _, stack in cfg.stacks)
                      * dtype_bytes + attention_backward(cfg, b, seq, t, attention_kernel(cfg, gpu, tpu)))
    ln_final = head * seq * d // t + head * seq * d if sequence else 2 * head * seq * d  # tp_sp: on shards, gathered
    # the logits, and the loss's float32 [tokens, V]; with logits_dtype="compute" none: the logits, saved in the
    # compute dtype, give way to their gradient (AOT for a v5e, gpt2_125m 16x1024: 8,792 MiB modelled against
    # XLA's 8,404 with it, 10,364 with a second [tokens, V] in bf16)
    loss_bytes = 0 if cfg.logits_dtype == "compute" else F32
    if "layers" in rules and schedule != "gpipe":
        # a table's backward runs the head's alone, in its own lax.cond before the layers' (manual_parallel/pp.py
        # `_output_grad`): the loss's float32 [tokens, V] is not kept beside the logits (tiny, S = 4, M = 4:
        # XLA:CPU's temporaries 0.90 x the model with it, 0.97 without)
        loss_bytes = 0
    final = (ln_final + head * seq * v // t) * dtype_bytes + head * seq * v // t * loss_bytes
    if cfg.loss_chunks:  # vocabulary tiling: one chunk's logits, each token's lse, the f32 dW accumulator
        chunk_bytes = dtype_bytes if cfg.logits_dtype == "compute" else F32  # a chunk's logits and loss
        final = (ln_final * dtype_bytes + head * seq // cfg.loss_chunks * v // t * (dtype_bytes + chunk_bytes)
                 + head * seq * F32 + d * v // t * F32)
    if rules.get("seq") == "context":  # T/C tokens per device, ring attention's residuals
        layers, backward_layer, final = (
            _ulysses_activations(cfg, remat, b, seq, mesh["context"], dtype_bytes, attention_kernel(cfg, gpu, tpu))
            if strategy in strategies.ALL_TO_ALL_CONTEXT else _cp_activations(cfg, remat, b, seq, mesh["context"], dtype_bytes))
    acts = layers * dtype_bytes + final + kept
    def layer(s: int) -> int:  # one layer's gathered matrices in s bytes, the largest stack's
        return max(sum(w.count // w.layers * local_bytes(cfg, w, mesh, t, s)
                       for w in weights(stack) if w.is_matrix and w.stacked) for _, stack in cfg.stacks)

    def stage(s: int) -> int:  # pp_fsdp: the stage's L/S layers, embedding and lm_head in s bytes
        return cfg.num_layers // mesh["stage"] * layer(s) + 2 * v * d * s

    gathered = max(layer(dtype_bytes), v * d // t * dtype_bytes) if "embed" in rules else 0
    opt = _optimizer_bytes(cfg, rules, mesh, optimizer, state_bytes)
    copy = masters if master else 0
    if "layers" in rules and "embed" in rules:  # pp_fsdp: GPipe reads the gathered stage as float32
        gathered = stage(F32 if schedule == "gpipe" else dtype_bytes)
        return Memory(params, params, opt, acts, gathered, stage(F32), backward_layer, copy)
    if grad_accum == 1:
        return Memory(params, params, opt, acts, gathered, 0, backward_layer, copy)
    # under FSDP the accumulator holds the WHOLE matrices' gradient (gather_step): full over data
    accumulator = masters * accum_bytes // F32
    if "embed" in rules:
        accumulator = sum(w.count * local_bytes(cfg, w, mesh, t, accum_bytes) for w in weights(cfg))
        gathered = sum(w.count * local_bytes(cfg, w, mesh, t, dtype_bytes) for w in weights(cfg) if w.is_matrix)
    return Memory(params, params, opt, acts, gathered, accumulator, backward_layer, copy)
