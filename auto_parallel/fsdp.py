"""FSDP (ZeRO-3), GSPMD twin: shard every weight's d_model dimension over `data`,
split the batch over `data`.

Placement only; XLA derives the communication. Each weight is all-gathered over
`data` before its matmul (forward, and again in the backward pass), and each
weight gradient is reduce-scattered over `data` back to its shard. XLA:CPU
writes that reduce-scatter as an all-reduce followed by a dynamic-slice
(measured, JAX 0.12); GPU/TPU emit a real reduce-scatter.
"""

PARAM_RULES: dict[str, str] = {"embed": "data"}
ACTIVATION_RULES: dict[str, str] = {"batch": "data"}
