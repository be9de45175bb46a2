"""Data parallelism, GSPMD twin: replicate every weight, split the batch over `data`.

No hooks: the placement (twinshard/parallel/strategies.py DP) is all there is, and XLA
derives the communication from it.
Forward: no communication.
Backward: an all-reduce over `data` of every gradient (the transpose of the implicit
broadcast of replicated weights to batch shards). GSPMD all-reduces each block gradient
inside the backward layer loop, one layer at a time, where the manual twin means each
stacked [L, ...] gradient once after the loop (the same bytes).
Optimizer: gradients are replicated, so the global norm is local.
tests/test_auto.py (check_dp) asserts the collectives and their bytes.
"""
