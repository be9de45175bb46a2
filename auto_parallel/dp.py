"""Data parallelism, GSPMD twin: replicate every weight, split the batch over `data`.

Placement only; XLA derives the communication. Per step it inserts one
all-reduce of the gradients over `data` (the backward pass of the implicit
broadcast of replicated weights to batch shards), usually combined into a few
large tuple all-reduces. No weight is ever gathered.
"""

# logical axis -> mesh axis for parameters (absent: replicated)
PARAM_RULES: dict[str, str] = {}
# logical axis -> mesh axis for activations and the batch
ACTIVATION_RULES: dict[str, str] = {"batch": "data"}
