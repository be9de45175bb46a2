"""FSDP + Megatron TP, GSPMD twin: the TP placement over `tensor`, and each
weight's d_model dimension additionally sharded over `data` (FSDP), with the
batch split over `data`.

Placement only; XLA derives the communication: FSDP all-gathers over `data`
of each weight's TP shard, reduce-scatters of gradients over `data`, and the
TP activation all-reduces over `tensor`.

ACTIVATION_RULES also give the layout each weight is *used* in (runner.GSPMD.weight
pins it): heads/mlp/vocab stay split over `tensor`, `embed` is whole, so GSPMD
must all-gather every weight over `data` before use, as the manual twin does.
Measured (tiny preset with num_heads=8, 8 CPU devices, JAX 0.12.0.1, ledger of
the compiled train step):

  without the pin, data:2,tensor:4: 91 collectives, 1 "[SPMD] Involuntary full
    rematerialization" warning (the embedding output's cotangent
    f32[4,32,64]). GSPMD never gathered the vocab x data-sharded embedding
    table; it gathered the token ids instead (s32 all-gather over tensor + s32
    collective-permute over both axes, layers.py:28 `jnp.take`), looked up
    [B, T, D/data] and all-to-all'ed it over data. 15 f32 all-gathers (the 14
    layer weights + lm_head), 1 all-to-all, 73 all-reduces.
  without the pin, data:4,tensor:2: 93 collectives, 2 warnings; 17 f32
    all-gathers (lm_head twice: two identical gathers whose replica groups
    print in different formats, so CSE kept both; plus an f32[8,32,64]
    all-gather of the rematerialized embedding cotangent), 2 s32 id
    all-gathers, 1 collective-permute, 1 all-to-all, 72 all-reduces.
  with the pin, both meshes: 73 collectives, no warning: 16 all-gathers over
    data (one per FSDP-sharded weight: 7 per layer + embedding + lm_head, in
    the forward pass only: GSPMD keeps them for the backward), 35 all-reduces
    over tensor (16 of [B/data, T, D], 3 softmax statistics, 16 grad-norm
    partial sums), 22 all-reduces over data (every TP-local gradient, which
    XLA:CPU writes instead of a reduce-scatter, plus the loss). No all-to-all,
    no permute, no token ids moved.

The same pin made auto fsdp gather the embedding table too (55 -> 38
collectives: the s32 id all-gather and 2 all-to-alls gone); tp and dp compile
to the same collectives with or without it.
"""

PARAM_RULES: dict[str, str] = {"embed": "data", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
# Activations, and weights where they are used (FSDP's 'embed' -> 'data' gathered away).
ACTIVATION_RULES: dict[str, str] = {"batch": "data", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
