"""FSDP (ZeRO-3), GSPMD twin: shard every weight's d_model dimension over `data`,
split the batch over `data`.

Placement only; XLA derives the communication. runner.GSPMD.weight pins each
weight to its use layout (ACTIVATION_RULES: nothing split but the batch), so
each weight is all-gathered over `data` before its matmul or lookup, and each
weight gradient is reduce-scattered over `data` back to its shard. Measured
(tiny preset, data=8, JAX 0.12.0.1): 16 all-gathers (7 per layer + embedding +
lm_head), each once, in the forward pass: GSPMD keeps the gathered weights for
the backward pass instead of re-gathering them as the manual twin does. XLA:CPU
writes the reduce-scatter as an all-reduce followed by a dynamic-slice (22
all-reduces: 16 weights, 5 norms, the loss); GPU/TPU emit a real
reduce-scatter. Without the pin GSPMD did not gather the embedding table: it
all-gathered the token ids and all-to-all'ed the [B, T, D/data] lookup result
forward and backward (55 collectives instead of 38).
"""

PARAM_RULES: dict[str, str] = {"embed": "data"}
# Activations, and weights where they are used (whole: FSDP gathers them).
ACTIVATION_RULES: dict[str, str] = {"batch": "data"}
