"""The notes launch.collectives prints beside a twin's ledger: where GSPMD (the auto twin) and the
explicit twin differ from the manual twin the cost model describes, each naming the docs section
that explains it (tests/test_collectives_cli.py holds every link to a heading)."""

CPU_REDUCE_SCATTER_NOTE = (
    "XLA:CPU never emits reduce-scatter for the partitioner (GSPMD, and the explicit twin's reshards): "
    "a gradient reduce-scatter over data is an all-reduce of the FULL gradient followed by a "
    "dynamic-slice. So on CPU the auto and explicit ledgers show no reduce-scatter rows and extra "
    "all-reduce bytes over data (each model "
    "reduce-scatter of r bytes appears as an all-reduce of r x |data| bytes). The manual twin "
    "(psum_scatter) shows a real reduce-scatter on every backend (docs/memory.md#auto_parallelfsdppy).")

MODEL_NOTE = "The model describes the manual (shard_map) twin; GSPMD chooses its own plan. "
MEASURED = "Measured on XLA:CPU (JAX 0.12), "
_TP_GRADS = (MEASURED + "it all-reduces the tensor-parallel input gradients of q, k, v (and w1, w3) "
             "separately instead of summing them first, and reduces the squared gradient norm leaf by leaf")
_CP = (MEASURED + "GSPMD runs no ring: it all-gathers K (after RoPE) and V, [B, hk, T, dh], over context "
       "in the forward layer loop and again in the backward loop, and all-reduces their full-size "
       "gradients, where the manual twin passes the same blocks around the ring in collective-permutes "
       "(tiny on context:4: 8 all-gathers and 26 all-reduces against 24 collective-permutes and 13 "
       "all-reduces)")
_ULYSSES = (MEASURED + "per layer GSPMD runs 9 all-to-alls to the manual twin's 8, one more in the "
            "backward: the recomputed attention output times its cotangent (the `mul` of "
            "recompute_attention's backward) is moved to head shards once more (tiny, --num_heads=8 on "
            "context:4: 18 against 16 all-to-alls, 288 KiB against 256 KiB)")
_PP = (MEASURED + "the stage buffer shifts as a cyclic collective-permute: S hops per tick where the "
       "manual twin sends S-1 (the wrap-around carries a value nobody uses)")
_EP = ("XLA derives the reshard of the capacity buffers [E, G, C, D] between the token layout and the "
       "expert layout, so its collectives need not be the manual twin's two all-to-alls")
# strategy -> (what GSPMD does differently from the manual twin, the docs section that explains it)
AUTO_NOTES = {
    "dp": (MEASURED + "it all-reduces each block gradient inside the backward layer loop, once per layer "
           "and leaf, where the manual twin reduces each stacked [L, ...] gradient once: more "
           "all-reduces, the same bytes", "docs/design.md#auto_paralleldppy"),
    "fsdp": (MEASURED + "it keeps the gathered weights for the backward pass instead of re-gathering them",
             "docs/memory.md#auto_parallelfsdppy"),
    "tp": (_TP_GRADS, "docs/design.md#auto_paralleltppy"),
    "fsdp_tp": (_TP_GRADS + "; it also keeps the FSDP-gathered weights for the backward pass",
                "docs/design.md#auto_parallelfsdp_tppy"),
    "tp_sp": (_TP_GRADS, "docs/design.md#auto_paralleltp_sppy"),
    "fsdp_tp_sp": (_TP_GRADS + "; it also keeps the FSDP-gathered weights for the backward pass",
                   "docs/design.md#auto_parallelfsdp_tp_sppy"),
    "hsdp": (MEASURED + "it keeps the weights gathered over fsdp for the backward pass instead of re-gathering "
             "them, as fsdp's; across slices it means one gradient per slice (a vmap over data), as the manual twin",
             "docs/slices.md#hsdp"),
    "cp": (_CP, "docs/long-context.md#auto_parallelcppy"),
    "fsdp_cp": (_CP, "docs/long-context.md#auto_parallelfsdp_cppy"),
    "ulysses": (_ULYSSES, "docs/long-context.md#auto_parallelulyssespy"),
    "fsdp_ulysses": (_ULYSSES, "docs/long-context.md#auto_parallelulyssespy"),
    "pp": (_PP, "docs/pipelines.md#auto_parallelpppy"),
    "pp_fsdp": (_PP + ", and each stage gathers its layers' weights over data as fsdp's",
                "docs/pipelines.md#auto_parallelpp_fsdppy"),
    "ep": (_EP, "docs/experts.md#auto_paralleleppy"),
    "fsdp_ep": (_EP, "docs/experts.md#auto_parallelfsdp_eppy"),
}
# strategy -> where the docs explain its explicit twin (the note itself is shared: EXPLICIT_NOTE)
EXPLICIT_DOCS = {"dp": "docs/design.md#explicit_paralleldppy", "fsdp": "docs/memory.md#explicit_parallelfsdppy",
                 "tp": "docs/explicit.md#explicit_paralleltppy",
                 "fsdp_tp": "docs/design.md#explicit_parallelfsdp_tppy",
                 "tp_sp": "docs/design.md#explicit_paralleltp_sppy",
                 "ulysses": "docs/explicit.md#collectives-of-the-three-twins"}

EXPLICIT_NOTE = (
    "The explicit twin (sharding in types) differs "
    "where the types place a reduction elsewhere: measured on XLA:CPU (JAX 0.12), the RMSNorm gains' "
    "gradients are all-reduced inside the backward layer loop, one [D] per layer and gain (a gain "
    "multiplies data-split activations elementwise, which JAX refuses for a `reduced` operand), and an "
    "unreduced gradient resharded to its data-split parameter compiles to an all-reduce + dynamic-slice")


def twin_notes(strategy: str, impl: str, platform: str, has_reduce_scatter: bool) -> list[str]:
    """The notes of one twin of one strategy, each ending with the docs section that explains it."""
    if impl == "manual":
        return []
    if impl == "auto":
        what, doc = AUTO_NOTES[strategy]
        notes = [f"{MODEL_NOTE}{what} ({doc})."]
    else:
        notes = [f"{MODEL_NOTE}{EXPLICIT_NOTE} ({EXPLICIT_DOCS[strategy]})."]
    return notes + ([CPU_REDUCE_SCATTER_NOTE] if platform == "cpu" and has_reduce_scatter else [])
