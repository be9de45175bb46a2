"""The XLA:TPU options a train step is compiled with (`compiler_options`, the `compiler_options=` of
every runner's train-step jit): what ModelConfig asks for, and the options that let the compiler run
collectives beside compute (ModelConfig.async_collectives, on by default; docs/schedule.md shows
what they hide).

By default XLA:TPU (libtpu 0.0.50.1) runs every all-reduce synchronously: the gradient reductions
of FSDP (a reduce-scatter over a whole v5e:4x4 grid compiles to an all-reduce + slice), the
embedding's and the lm_head's. `ASYNC_COLLECTIVES` makes all-reduces asynchronous collective
fusions too, as all-gathers already are, and reduce-scatters; the names are MaxText's
(benchmarks/xla_flags_library.py, CF_FOR_ALL_REDUCE and CF_FOR_ALL_GATHER), the reduce-scatter ones
those of MaxDiffusion's TPU recipes, and the kLoop one and the combiner's found in libtpu's own list
of options. libtpu refuses a compile that names an option it does not know; tests/test_xla_options.py
compiles with all of them. What they hide on v5e:4x4: BENCHMARKS.md, "Exposed communication on v5e:4x4"."""

from __future__ import annotations

from twinshard.config import ModelConfig

# Collectives as asynchronous collective fusions, with the compute scheduled between their start
# and done fused beside them ("continuation fusion"), over several steps, on the one TensorCore.
ASYNC_COLLECTIVES: dict[str, str] = {
    "xla_enable_async_all_gather": "true",
    "xla_enable_async_all_reduce": "true",
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    # Elementwise (kLoop) fusions may run beside a collective too, not only matmul fusions: a layer's
    # last Megatron all-reduce hides partly behind the residual's update-slice and the embedding's
    # behind its neighbours (llama_v5e, fsdp_tp, 2 chunks, v5e:4x4: exposed 13.4% -> 11.9% of the step).
    "xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions": "true",
    # Reduce-scatters as asynchronous collective fusions too: XLA:TPU otherwise compiled FSDP's gradient
    # reduce-scatters over data:8 of a v5e:4x4 as synchronous all-reduces of the full gradient + a slice
    # (llama_v5e, fsdp_tp, 2 chunks: the data axis's exposed time 16.2 -> 5.4 ms (auto), 12.8 -> 12.6 ms
    # (manual), its traffic 28.9 -> 21.0 ms); their fusion needs more than the default 16 MiB of scoped
    # VMEM (16.02 MiB measured, auto twin), so the limit is raised to 32 MiB of the v5e's 128 MiB.
    "xla_enable_async_reduce_scatter_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter": "true",
    "xla_tpu_scoped_vmem_limit_kib": "32768",
    # The all-reduce combiner off: it merged a layer's gradient all-reduces into one, which waits for
    # the layer's last gradient and ran synchronously, async options or not (llama_v5e, fsdp, v5e:4x4).
    "xla_jf_crs_combiner_threshold_in_bytes": "0",
}


def compiler_options(cfg: ModelConfig, platform: str, devices: int) -> dict[str, str] | None:
    """The train step's XLA options on `platform` over `devices` chips: on a TPU, ASYNC_COLLECTIVES
    (cfg.async_collectives) where there is more than one (one chip's step has no collective, and the
    names were checked against libtpu 0.0.50.1 only, not the older libtpu of a chip host's JAX 0.10.2),
    and cfg.xla_tpu_scoped_vmem_limit_kib as the scoped VMEM limit where it is the larger (splash blocks of 2048 at head_dim
    128 need ~20 MiB of the default 16, measured on a v5e AOT compile); None where nothing is set or
    the platform is not a TPU (other backends reject these options)."""
    if platform != "tpu":
        return None
    options = dict(ASYNC_COLLECTIVES) if cfg.async_collectives and devices > 1 else {}
    if cfg.xla_tpu_scoped_vmem_limit_kib:  # the larger of the config's and the async collectives' limit
        vmem = max(cfg.xla_tpu_scoped_vmem_limit_kib, int(options.get("xla_tpu_scoped_vmem_limit_kib", 0)))
        options["xla_tpu_scoped_vmem_limit_kib"] = str(vmem)
    return options or None
