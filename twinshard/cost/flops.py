"""FLOPs of one train step (`flops`, `Flops`), in the notation of twinshard/cost/__init__.py.

A matmul [m,k]x[k,n] costs 2mkn.
    forward  = 2 * B*T * N_mm + L * 2 * 2 * B * T^2 * D
    with N_mm = L(2D*H*dh + 2D*Hkv*dh + 3DF) + DV the matmul parameters (q and output_proj,
    k and v with Hkv key/value heads: Hkv = H without grouped-query attention; the embedding is
    a lookup: 0 FLOPs; norms, RoPE, softmax, SiLU are elementwise and ignored). So a train step
    costs 6 N_mm per token (N_mm = N minus the embedding table and the norm gains) plus
    attention's 12 L T H*dh per token: the scores and AV products run on every query head,
    whatever Hkv.
    The attention term is QK^T and AV, 2*B*T*T*D each per layer; it is NOT
    halved for causality (our attention computes the full T x T scores and
    masks them, and XLA's cost_analysis counts them). backward = 2 x forward (grad wrt
    inputs + grad wrt weights).
    MFU's FLOPs (`model_total`, `model_per_device`) count causal attention HALF, MaxText's
    convention since mid-2025: flash and splash kernels do not compute the masked half, so a
    step's useful work is 3 (forward_matmul + forward_attention / 2). The launchers' MFU and
    model FLOP/s and launch.plan's compute time use them.
    total = 3 x forward; per device = total / (d*t) (every strategy splits all
    matmuls evenly: batch over data, heads / d_ff / vocab over tensor; a tensor axis larger
    than Hkv makes each device compute its kv head's k and v in full, t/Hkv copies of the
    4 B T D Hkv dh forward FLOPs of k and v, not counted).
The formula counts every score; ring attention (cp, fsdp_cp) computes only the visible
blocks after its own, (C+1)/(2C) of the attention scores in total (zig-zag: half a block
per device per step, balanced; contiguous: the same total, device c doing c + 1 blocks).
Gradient accumulation does not change the FLOPs. A mixture of experts (`_moe_layer`) counts
the expert matmuls on the capacity buffers and the dispatch / combine einsums in its MoE
layers; its first dense layers (ModelConfig.first_dense_layers) count as a dense model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from twinshard.config import ModelConfig


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
    model_total: int  # 3 x (forward_matmul + forward_attention / 2): MFU's FLOPs, causal attention half
    model_per_device: float  # model_total / number of devices


def flops(cfg: ModelConfig, batch: int, seq: int, n_devices: int = 1) -> Flops:
    tokens, d, v = batch * seq, cfg.d_model, cfg.padded_vocab_size
    n_mm, fwd_mm = d * v, 2 * tokens * d * v  # the lm_head
    for _, stack in cfg.stacks:  # the first dense layers, then the MoE layers (or the one stack)
        active, per_layer = (_moe_layer if stack.num_experts else _dense_layer)(stack, tokens)
        n_mm, fwd_mm = n_mm + stack.num_layers * active, fwd_mm + stack.num_layers * per_layer
    fwd_attn = cfg.num_layers * 2 * 2 * batch * seq * seq * cfg.num_heads * cfg.head_dim  # QK^T, AV; causal half too
    fwd = fwd_mm + fwd_attn
    useful = 3 * (fwd_mm + fwd_attn // 2)
    return Flops(n_mm, fwd_mm, fwd_attn, fwd, 2 * fwd, 3 * fwd, 3 * fwd / n_devices, useful, useful / n_devices)


def _attention_matmuls(cfg: ModelConfig) -> int:
    return 2 * cfg.d_model * cfg.num_heads * cfg.head_dim + 2 * cfg.d_model * cfg.kv_dim  # q, o; k, v


def _dense_layer(cfg: ModelConfig, tokens: int) -> tuple[int, int]:
    """(matmul params, forward matmul FLOPs) of one dense layer: attention's four projections and
    SwiGLU's three, each 2 FLOPs per parameter and token."""
    active = _attention_matmuls(cfg) + 3 * cfg.d_model * cfg.d_ff
    return active, 2 * tokens * active


def _moe_layer(cfg: ModelConfig, tokens: int) -> tuple[int, int]:
    """(active matmul params per token, forward matmul FLOPs) of one mixture-of-experts layer:
    attention, the router [D, E] and k experts' SwiGLU per token; the FLOPs are what the program
    computes: every expert on its whole capacity buffer (E G C rows, full or not) and the dispatch
    and combine einsums of the [G, S, E, C] masks (2 G S E C D each, GShard's dense dispatch); dropless
    (moe_dispatch='ragged'), the experts on the N k assigned rows only and the k-weighted sum."""
    d, e, fe, c = cfg.d_model, cfg.num_experts, cfg.expert_ff, cfg.expert_capacity
    slots = e * (tokens // cfg.moe_group) * c
    attn = _attention_matmuls(cfg)
    active = attn + d * e + cfg.experts_per_token * 3 * d * fe
    moves = 2 * 2 * tokens * e * c * d  # the dispatch and combine einsums
    if cfg.moe_dispatch == "ragged":  # ragged_dot on the A = tokens k real rows; the weighted sum of the k
        slots, moves = tokens * cfg.experts_per_token, 2 * tokens * cfg.experts_per_token * d
    return active, 2 * tokens * (attn + d * e) + 2 * slots * 3 * d * fe + moves
