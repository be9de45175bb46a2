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
Optimizer: one scalar all-reduce per tensor-sharded gradient leaf (global norm).
Measured (tiny, num_heads=8, tensor=8, XLA:CPU, scanned layers): 28 all-reduces
over tensor - 16 of [B, T, D] (7 in the layer loops x L, 2 outside), 3 of token
statistics, 9 scalar squared norms (7 stacked block leaves, embedding, lm_head;
35 - 16 of them - when the blocks were unrolled) - none larger than [B, T, D];
no weight-sized collective.
"""
