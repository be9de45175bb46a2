"""Data parallelism, GSPMD twin: replicate every weight, split the batch over `data`.

Placement only; XLA derives the communication from the tables below.
Forward: no communication.
Backward: an all-reduce over `data` of every gradient (the transpose of the
implicit broadcast of replicated weights to batch shards).
Optimizer: gradients are replicated, so the global norm is local.
Measured (tiny preset, data=8, JAX 0.12.0.1, XLA:CPU): 22 all-reduces over
data - 16 weights, 5 norm gains, the loss - moving exactly the parameter bytes + 4.
GSPMD all-reduces each block gradient inside the backward layer loop, one layer
at a time (9 records of multiplicity L), where the manual twin means each stacked
[L, ...] gradient once after the loop (12 all-reduces, the same bytes).
"""
