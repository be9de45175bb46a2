"""Megatron tensor parallelism, GSPMD twin: split heads, d_ff and the vocabulary
over `tensor`; every device sees the whole batch.

Q, K, V, W1, W3 are column-parallel ([D, out/tensor]); O and W2 row-parallel
([in/tensor, D]); the embedding and lm_head are vocab-parallel. Placement
only; XLA derives the communication: an all-reduce of activations over
`tensor` after each row-parallel matmul (forward) and for the input gradient of
each column-parallel block (backward), plus small reductions for the
vocab-parallel embedding and softmax statistics. No weight-sized collective.
"""

PARAM_RULES: dict[str, str] = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
ACTIVATION_RULES: dict[str, str] = {"vocab": "tensor"}
