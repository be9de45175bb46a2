"""FSDP (ZeRO-3), GSPMD twin: shard every weight's d_model dimension over `data`,
split the batch over `data`.

Placement only; XLA derives the communication from the tables below
(runner.GSPMD.weight pins each weight to its use layout: whole).
Forward: an all-gather over `data` of each weight matrix (7L+2).
Backward: GSPMD keeps the gathered weights (no re-gather, unlike the manual
twin's remat); each weight gradient is reduce-scattered over `data` - which
XLA:CPU writes as an all-reduce + dynamic-slice (GPU/TPU: a reduce-scatter).
Optimizer: one small all-reduce per sharded gradient for the global norm.
Measured (tiny, data=8, XLA:CPU): 16 all-gathers, 22 all-reduces (16 weight
gradients, 5 norm gains, the loss). Without the weight pin GSPMD gathered the
token ids instead of the embedding table and all-to-all'ed the lookup: 55
collectives instead of 38.
"""

PARAM_RULES: dict[str, str] = {"embed": "data"}
# Activations, and weights where they are used (whole: FSDP gathers them).
ACTIVATION_RULES: dict[str, str] = {"batch": "data"}
