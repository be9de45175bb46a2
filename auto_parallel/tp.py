"""Megatron tensor parallelism, GSPMD twin: split heads, d_ff and the vocabulary
over `tensor`; every device sees the whole batch.

Placement only; XLA derives the communication from the tables below: Q, K,
V, W1, W3 column-parallel [D, out/tensor], O and W2 row-parallel
[in/tensor, D], embedding and lm_head vocab-parallel.
Forward: an all-reduce of [B, T, D] after the embedding lookup and after each
O and W2 (2 per layer); 3 all-reduces of [B, T] softmax statistics (never the logits).
Backward: an all-reduce of [B, T, D] for the lm_head input gradient and 5 per
layer - GSPMD all-reduces the input gradient of q, k, v, w1 and w3 separately,
where Megatron's f (the manual twin) sums them first and all-reduces twice.
Optimizer: one scalar all-reduce per tensor-sharded gradient (global norm).
Measured (tiny, num_heads=8, tensor=8, XLA:CPU): 35 all-reduces over tensor,
none larger than [B, T, D]; no weight-sized collective.
"""

PARAM_RULES: dict[str, str] = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
# Activations, and weights where they are used (the same TP splits: no weight moves).
ACTIVATION_RULES: dict[str, str] = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
