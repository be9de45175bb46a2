"""Megatron tensor parallelism, GSPMD twin: split heads, d_ff and the vocabulary
over `tensor`; every device sees the whole batch.

Q, K, V, W1, W3 are column-parallel ([D, out/tensor]); O and W2 row-parallel
([in/tensor, D]); the embedding and lm_head are vocab-parallel. Placement
only; XLA derives the communication, all of it all-reduces over `tensor` and
none weight-sized. Measured (tiny preset, num_heads=8, tensor=8, JAX 0.12.0.1):
35 all-reduces per step:
  forward, [B, T, D]: 1 after the vocab-parallel embedding lookup (masked local
    lookup + sum), 1 after each row-parallel O and W2 (2 per layer);
  forward, [B, T]: 3 for the vocab-parallel softmax (max, sum of exp, target
    logit), never the logits;
  backward, [B, T, D]: 1 for the lm_head's input gradient and 5 per layer:
    GSPMD all-reduces the input gradient of each column-parallel matmul (q, k,
    v, w1, w3) separately, where Megatron's f (the manual twin) sums them first
    and all-reduces twice per layer;
  16 scalars: the global gradient norm's partial sums of the 16 tensor-sharded weights.
Pinning the weights' use layout (runner.GSPMD.weight) changes none of these.
"""

PARAM_RULES: dict[str, str] = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
# Activations, and weights where they are used (the same TP splits: no weight moves).
ACTIVATION_RULES: dict[str, str] = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
