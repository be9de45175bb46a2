"""FSDP (ZeRO-3), GSPMD twin: shard every weight's d_model dimension over `data`,
split the batch over `data`.

Placement only; XLA derives the communication from the tables below
(runner.GSPMD.weight pins each weight to its use layout: whole).
Forward: an all-gather over `data` of each weight matrix (7L+2).
Backward: with --remat=none GSPMD keeps the gathered weights (no re-gather,
unlike the manual twin, which never saves one); under a remat policy that
recomputes them (full: measured +7L all-gathers in the backward loop) GSPMD
re-gathers what it recomputes. Each weight gradient is reduce-scattered over `data` - which
XLA:CPU writes as an all-reduce + dynamic-slice (GPU/TPU: a reduce-scatter).
Optimizer: one small all-reduce per sharded stacked gradient for the global norm.
Measured (tiny, data=8, XLA:CPU, scanned layers): 16 all-gathers (7 in the
forward layer loop x L, embedding, lm_head), 29 all-reduces (16 weight
gradients - 7 in the backward loop x L -, 5 norm gains, 7 scalar squared-norm
partials of the 7 stacked [L, D/data, ...] gradients, the loss). With the
blocks unrolled (no stack) there were no scalar partials: 22 all-reduces.
Without the weight pin GSPMD gathered the token ids instead of the embedding
table and all-to-all'ed the lookup: 55 collectives instead of 38 (unrolled).
"""
