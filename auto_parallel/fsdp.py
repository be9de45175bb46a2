"""FSDP (ZeRO-3), GSPMD twin: shard every weight's d_model dimension over `data`,
split the batch over `data`.

No hooks beyond the generic ones: the placement (twinshard/parallel/strategies.py FSDP)
plus `runner.GSPMD.weight`, which pins each weight to its use layout (whole).
Forward: an all-gather over `data` of each weight matrix, one layer at a time.
Backward: with --remat=none GSPMD keeps the gathered weights (no re-gather, unlike the
manual twin, which never saves one); under a remat policy that recomputes them GSPMD
re-gathers what it recomputes. Each weight gradient is reduce-scattered over `data`, which
XLA:CPU writes as an all-reduce + dynamic-slice (GPU/TPU: a reduce-scatter).
Optimizer: one small all-reduce per sharded stacked gradient for the global norm.
Without the weight pin GSPMD gathered the token ids instead of the embedding table and
all-to-all'ed the lookup (measured, JAX 0.12). tests/test_auto.py (check_fsdp) asserts the
collectives.
"""
