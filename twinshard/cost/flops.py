"""FLOPs of one train step (`flops`, `Flops`), in the notation of twinshard/cost/__init__.py.

forward = 2 B T N_mm + 4 L B T^2 H dh, with N_mm = L(2D H dh + 2D Hkv dh + 3DF) + DV the matmul
parameters; attention is NOT halved for causality (the kernels compute and mask the full T x T,
and XLA's cost_analysis counts it); total = 3 x forward, split evenly over devices.
`model_total` (MFU's FLOPs) counts causal attention half, MaxText's convention. Ring attention
computes (C+1)/(2C) of the scores; a mixture of experts counts its whole capacity buffers and
the dispatch / combine einsums."""

from __future__ import annotations

from dataclasses import dataclass

from twinshard.config import ModelConfig


@dataclass(frozen=True)
class Flops:
    """FLOPs of one train step (module docstring)."""

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
    """(matmul params, forward matmul FLOPs) of one dense layer."""
    active = _attention_matmuls(cfg) + 3 * cfg.d_model * cfg.d_ff
    return active, 2 * tokens * active


def _moe_layer(cfg: ModelConfig, tokens: int) -> tuple[int, int]:
    """(active matmul params per token, forward matmul FLOPs) of one MoE layer, as the program
    computes them: every expert on its whole capacity buffer plus the [G, S, E, C] dispatch and
    combine einsums; dropless (ragged), the experts on the N k assigned rows only."""
    d, e, fe, c = cfg.d_model, cfg.num_experts, cfg.expert_ff, cfg.expert_capacity
    slots = e * (tokens // cfg.moe_group) * c
    attn = _attention_matmuls(cfg)
    active = attn + d * e + cfg.experts_per_token * 3 * d * fe
    moves = 2 * 2 * tokens * e * c * d  # the dispatch and combine einsums
    if cfg.moe_dispatch == "ragged":  # ragged_dot on the A = tokens k real rows; the weighted sum of the k
        slots, moves = tokens * cfg.experts_per_token, 2 * tokens * cfg.experts_per_token * d
    return active, 2 * tokens * (attn + d * e) + 2 * slots * 3 * d * fe + moves
