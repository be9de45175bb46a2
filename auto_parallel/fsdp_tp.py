"""FSDP + Megatron TP, GSPMD twin: the TP placement over `tensor`, with every
weight's d_model dimension further sliced over `data`; batch over `data`.

No hooks beyond the generic ones: the placement (twinshard/parallel/strategies.py FSDP_TP)
plus `runner.GSPMD.weight`, which pins each weight to its use layout (TP-split, d_model whole).
Forward: an all-gather over `data` of each weight's TP shard; tp.py's all-reduces over
`tensor` on [B/data, T, D] activations.
Backward: the TP all-reduces; each gradient reduce-scattered over `data`
(XLA:CPU: all-reduce + dynamic-slice).
Optimizer: small all-reduces for the global norm.
Without the weight pin GSPMD moved the token ids to the vocab x data-sharded embedding table
(all-gather, collective-permute, all-to-all of the lookup) and warned of an involuntary full
rematerialization (measured, JAX 0.12); tests/test_auto.py (check_fsdp_tp,
test_no_involuntary_rematerialization) asserts the collectives and the absence of both.
"""
