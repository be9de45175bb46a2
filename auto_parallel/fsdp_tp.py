"""FSDP + Megatron TP, GSPMD twin: the TP placement over `tensor`, with every
weight's d_model dimension further sliced over `data`; batch over `data`.

Placement only; XLA derives the communication from the tables below
(runner.GSPMD.weight pins each weight to its use layout: TP-split, d_model whole).
Forward: an all-gather over `data` of each weight's TP shard (7L+2); the TP
all-reduces over `tensor` of tp.py on [B/data, T, D] activations.
Backward: the TP all-reduces; each gradient reduce-scattered over `data`
(XLA:CPU: all-reduce + dynamic-slice).
Optimizer: small all-reduces for the global norm.
Measured (tiny, num_heads=8, data:2,tensor:4 and data:4,tensor:2, XLA:CPU,
scanned layers): 73 collectives - 16 all-gathers over data, 28 all-reduces over
tensor, 29 over data (tp.py and fsdp.py say what each is) - and no warning. Without the weight pin: 91-93 collectives and
"[SPMD] Involuntary full rematerialization" warnings; GSPMD moved token ids
to the vocab x data-sharded embedding table (s32 all-gather,
collective-permute, all-to-all of the lookup) instead of gathering the table.
"""
