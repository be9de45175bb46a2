"""From a strategy's name, a mesh string, the config and a device count to a validated mesh.

Both twins and the launchers call `resolve_mesh` and `check_options`, so an invalid
(strategy, mesh, model, batch, option) combination fails the same way whichever twin runs,
with a ValueError naming the value and the fix, before anything is compiled.
"""

from __future__ import annotations

import jax

from twinshard.parallel import context, mesh as mesh_lib, pipeline, strategies
from twinshard.config import Config, ModelConfig
from twinshard.parallel.placement import logical_dims


def resolve_mesh(strategy: str, mesh_spec: str | None, cfg: Config, n_devices: int,
                 advise: bool = True, flat_weights: bool = False) -> dict[str, int]:
    """Parse (or default) and validate the mesh of `strategy` against the devices and the model
    (a pipeline also against L, M and the batch; context parallelism against T and its layout).
    advise=False: a dimension that does not divide is named without a mesh that fits
    (mesh.check_divisible). flat_weights: FSDP's weights split flat, so d_model need not divide by
    data (launch.plan's flat plans, twinshard/hardware/plan.py; the twins split d_model)."""
    decl = strategies.get(strategy)
    check_experts(strategy, cfg.model)  # first: no mesh fixes a model the strategy cannot run
    shape = mesh_lib.parse_mesh(mesh_spec, strategy) if mesh_spec else mesh_lib.default_mesh(strategy, n_devices)
    mesh_lib.check_mesh(strategy, shape, n_devices)
    # the family's own checks first: their messages name the fix in its terms (stages, zig-zag chunks)
    if decl.family == "pipeline":
        pipeline.check(cfg.model.num_layers, cfg.train.batch_size, shape[pipeline.STAGE], cfg.train.microbatches,
                       cfg.train.grad_accum, shape.get("data", 1))
    if decl.family == "context":
        context.check(cfg.model.context_length, shape[context.CONTEXT], context.layout_of(strategy, cfg.train.cp_layout))
        if strategy in strategies.ALL_TO_ALL_CONTEXT:
            context.check_heads(cfg.model.num_heads, shape[context.CONTEXT])
    rules = {k: v for k, v in decl.split_rules.items() if not (flat_weights and k == "embed")}
    mesh_lib.check_divisible(logical_dims(cfg), rules, shape, advise)
    return shape


# The strategies whose twins run ModelConfig.loss_chunks, held to single-device gradients and their
# ledgers by tests/test_loss_chunks.py (sequence-split and pipelined layouts, the explicit twins: not yet).
LOSS_CHUNK_STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")


def check_options(strategy: str, impl: str, cfg: Config) -> None:
    """The options written in one twin only: the collective matmul (manual tp_sp), the 1F1B
    schedule (the manual pipelines) and ragged experts with micro-batches (manual); a ValueError
    naming the fix otherwise."""
    if cfg.model.collective_matmul:
        if strategy != "tp_sp":
            raise ValueError(f"--collective_matmul decomposes tp_sp's sequence all-gathers, and --strategy={strategy} "
                             "has none: use --strategy=tp_sp --impl=manual, or drop --collective_matmul.")
        if impl != "manual":
            raise ValueError(f"--collective_matmul is written by hand in the manual twin only (--impl={impl}): "
                             "use --impl=manual, or drop --collective_matmul (GSPMD chooses its own collectives).")
    if impl == "auto" and cfg.model.num_experts and cfg.model.moe_dispatch == "ragged" and cfg.train.grad_accum > 1:
        raise ValueError(f"--moe_dispatch=ragged with --grad_accum={cfg.train.grad_accum} under --impl=auto: the GSPMD "
                         "twin accumulates each data shard's micro-batches under jax.vmap, and JAX 0.12 cannot vmap "
                         "jax.lax.ragged_dot over weights it does not batch: use --grad_accum=1, --impl=manual "
                         "or --moe_dispatch=dense.")
    if cfg.model.loss_chunks and strategy != "single" and (impl not in ("manual", "auto") or strategy not in LOSS_CHUNK_STRATEGIES):
        raise ValueError(f"--loss_chunks={cfg.model.loss_chunks} (vocabulary tiling) is written and tested for "
                         f"--strategy={'/'.join(LOSS_CHUNK_STRATEGIES)} with --impl=manual or auto, not --strategy="
                         f"{strategy} --impl={impl}: use one of those, or --loss_chunks=0.")
    if (impl == "manual" and cfg.model.attention == "splash" and jax.default_backend() != "tpu"
            and "tensor" in strategies.get(strategy).split_axes):
        raise ValueError(f"--attention=splash under --strategy={strategy} --impl=manual runs Pallas' interpret mode off "
                         "a TPU, which fails inside the manual twin's checked shard_map over `tensor` (a loop carry typed "
                         "varying over it; docs/speed.md): use --impl=auto, or --attention=recompute here.")
    if impl == "auto" and strategy in strategies.of_family("pipeline") and cfg.train.schedule != "gpipe":
        raise ValueError(f"--schedule={cfg.train.schedule} is written by hand in the manual twin only "
                         "(--impl=manual); the GSPMD twin's pipeline is GPipe (--schedule=gpipe).")


# The strategies a mixture-of-experts model runs under: its expert block has the dispatch /
# combine hooks and FSDP's gather, not Megatron's regions, a sequence layout or pipeline stages.
MOE_STRATEGIES = ("dp", "fsdp", *strategies.of_family("experts"))


def check_experts(strategy: str, model: ModelConfig) -> None:
    """ep and fsdp_ep need a mixture of experts; a mixture of experts runs only under
    MOE_STRATEGIES (and single): a ValueError naming the fix otherwise."""
    experts = model.num_experts
    if strategy in strategies.of_family("experts") and experts == 0:
        raise ValueError(f"--strategy={strategy} splits the experts over the `expert` axis, and this model is dense "
                         "(--num_experts=0): add experts (--preset=tiny_moe, or --num_experts=4), or use dp/fsdp.")
    if experts and strategy not in MOE_STRATEGIES:
        raise ValueError(f"--num_experts={experts}: a mixture of experts runs under {', '.join(MOE_STRATEGIES)} "
                         f"(or single), not --strategy={strategy}: pick one of those, or --num_experts=0.")
