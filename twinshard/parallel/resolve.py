"""From a strategy's name, a twin, a mesh string, the config and the devices to a resolved run.

`resolve_run` is the one place a run is validated (every launcher and each twin's `make_runner`), so an
invalid combination fails the same way everywhere, with a ValueError naming the value and the fix. A
twin's package builds the runner of a resolved run (`<twin>_parallel.runner_of`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import jax

from twinshard.parallel import context, mesh as mesh_lib, pipeline, strategies, support
from twinshard.config import Config, ModelConfig
from twinshard.parallel.placement import logical_dims
from twinshard.parallel.strategies import Strategy


@dataclass(frozen=True)
class Run:
    """A validated run: `declared` placed for the model on `mesh` (axis -> size, in mesh order);
    the single-device run (strategies.SINGLE) has an empty mesh, and `twin` "single" or, as the
    reference of a twin's comparison (launch.compare), that twin's name."""

    strategy: str
    twin: str
    declared: Strategy
    placed: Strategy
    mesh: Mapping[str, int]
    cfg: Config
    devices: tuple | None = None  # None: every device, ordered by jax.make_mesh
    # the axes across slices (--dcn_mesh), sized in slices; a factory, as Python 3.11's dataclasses refuse an
    # unhashable default (a MappingProxyType is hashable from 3.12 only: the TPU machine runs 3.11)
    dcn: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


def across_slices(run: Run) -> bool:
    """True when some axis of the run's mesh crosses slices over DCN (--dcn_mesh of more than one slice)."""
    return math.prod(run.dcn.values()) > 1


def resolve_run(strategy: str, twin: str, mesh_spec: str | None, cfg: Config, devices=None,
                first_devices: bool = False, dcn_spec: str | None = None) -> Run:
    """Every check of (strategy, twin, mesh, model, options, devices), each once, and the run they
    allow; `first_devices`: a `mesh_spec` of fewer devices than there are runs on the first ones;
    `dcn_spec` (--dcn_mesh): the axes across slices, the devices then ordered by mesh.hybrid_mesh."""
    declared = strategies.get(strategy)
    if not declared.split_axes:
        if dcn_spec:
            mesh_lib.parse_dcn_mesh(dcn_spec, strategy)  # single cannot cross slices: its one line
        return one_device_run(declared, twin, mesh_spec, cfg)
    dcn = mesh_lib.parse_dcn_mesh(dcn_spec, strategy, mesh_spec)
    check_twin(declared, twin, cfg)
    check_options(declared, twin, cfg)
    check_experts(declared, cfg.model)  # no mesh fixes a model the strategy cannot run
    found = jax.devices() if devices is None else devices
    if dcn:
        mesh_lib.check_slices(dcn, found)  # before the mesh: its message names the slice count
        mesh_spec = mesh_lib.hybrid_spec(strategy, dcn, mesh_spec, len(found))
    asked = None if mesh_spec is None else mesh_lib.parse_mesh(mesh_spec, strategy)  # the one parse
    if first_devices and asked is not None and (n := math.prod(asked.values())) < len(found):
        devices = found = found[:n]
    dims = logical_dims(cfg)
    shape = mesh_lib.resolve_axes(strategy, asked, dims, declared.split_rules, len(found))
    check_family(declared, shape, cfg)  # their messages name the fix in its terms (stages, zig-zag chunks)
    mesh_lib.check_split(strategy, shape, dims, declared.split_rules)
    check_kv_heads(declared, twin, shape, cfg)
    check_overlap_chunks(shape, cfg)
    check_dispatch(declared, twin, found, cfg)
    if dcn:  # the devices in the hybrid mesh's order: make_mesh reshapes them row-major
        devices = tuple(mesh_lib.hybrid_mesh(shape, dcn, found).flat)
    return Run(strategy, twin, declared, declared.placed(cfg.model.kv_heads, shape), MappingProxyType(shape), cfg,
               None if devices is None else tuple(devices), MappingProxyType(dcn))


def one_device_run(declared: Strategy, twin: str, mesh_spec: str | None, cfg: Config) -> Run:
    """The run of a strategy that splits nothing (single); `twin` other than "single": the reference
    of that twin's comparison (launch.compare), whose options are checked as the twin's."""
    if mesh_spec:
        raise ValueError(f"--mesh={mesh_spec} needs a parallel --strategy ({', '.join(strategies.NAMES)}); "
                         f"drop it for --strategy={declared.name}.")
    if twin != declared.name:
        check_options(declared, twin, cfg)
    return Run(declared.name, twin, declared, declared, MappingProxyType({}), cfg)


def single_run(cfg: Config, twin: str = "single") -> Run:
    """The single-device reference run of `cfg` (`one_device_run` of strategies.SINGLE)."""
    return one_device_run(strategies.SINGLE, twin, None, cfg)


def check_twin(declared: Strategy, twin: str, cfg: Config) -> None:
    """The strategies `twin` writes, and the models: a ValueError naming the fix otherwise."""
    strategy = declared.name
    if twin not in support.TWINS:
        raise ValueError(f"--impl={twin} is not a twin; choose one of {', '.join(support.TWINS)}.")
    if twin not in support.get(strategy).twins:
        others = support.get(strategy).twins
        raise ValueError(f"--impl={twin} runs {', '.join(support.written_by(twin))}, not --strategy={strategy}, "
                         f"which the {' and '.join(others)} twins write (docs/explicit.md says why): use "
                         f"{' or '.join(f'--impl={t}' for t in others)}.")
    if cfg.model.num_experts and not support.with_option("moe", twin):
        raise ValueError(f"--impl={twin} runs dense models (--num_experts={cfg.model.num_experts}): "
                         "use --impl=auto or --impl=manual, or --num_experts=0.")


def check_family(declared: Strategy, shape: Mapping[str, int], cfg: Config) -> None:
    """A pipeline's L, M and batch over `stage`; context parallelism's T over `context` in its layout."""
    if declared.family == "pipeline":
        pipeline.check(cfg.model.num_layers, cfg.train.batch_size, shape[pipeline.STAGE], cfg.train.microbatches,
                       cfg.train.grad_accum, shape.get("data", 1), cfg.train.schedule, cfg.train.virtual_stages)
        pipeline.check_split(cfg.model, cfg.train.schedule)
    if declared.family == "context":
        context.check(cfg.model.context_length, shape[context.CONTEXT], context.layout_of(declared.name, cfg.train.cp_layout))
        if declared.name in strategies.ALL_TO_ALL_CONTEXT:
            context.check_heads(cfg.model.num_heads, shape[context.CONTEXT])


def resolve_mesh(strategy: str, mesh_spec: str | None, cfg: Config, n_devices: int,
                 advise: bool = True, flat_weights: bool = False) -> dict[str, int]:
    """`resolve_run`'s mesh checks on a device count, for launch.plan; flat_weights: FSDP split flat,
    so d_model need not divide by data."""
    decl = strategies.get(strategy)
    check_experts(decl, cfg.model)  # first: no mesh fixes a model the strategy cannot run
    shape = mesh_lib.parse_mesh(mesh_spec, strategy) if mesh_spec else mesh_lib.default_mesh(strategy, n_devices)
    mesh_lib.check_mesh(strategy, shape, n_devices)
    check_family(decl, shape, cfg)  # first: their messages name the fix in its terms
    rules = {k: v for k, v in decl.split_rules.items() if not (flat_weights and k == "embed")}
    mesh_lib.check_divisible(logical_dims(cfg), rules, shape, advise)
    return shape


# The strategies whose twins run ModelConfig.loss_chunks (tests/test_loss_chunks.py)
LOSS_CHUNK_STRATEGIES = support.with_option("loss_chunks")


def check_options(declared: Strategy, impl: str, cfg: Config) -> None:
    """The options written in some twins only (twinshard/parallel/support.py), or a ValueError."""
    model, train, strategy = cfg.model, cfg.train, declared.name
    if model.collective_matmul:
        if strategy not in support.with_option("collective_matmul"):
            raise ValueError(f"--collective_matmul decomposes tp_sp's sequence all-gathers, and --strategy={strategy} "
                             "has none: use --strategy=tp_sp --impl=manual, or drop --collective_matmul.")
        if impl not in support.SUPPORT[strategy].collective_matmul:
            raise ValueError(f"--collective_matmul is written by hand in the manual twin only (--impl={impl}): "
                             "use --impl=manual, or drop --collective_matmul (GSPMD chooses its own collectives).")
    if model.quantization != "none" and "tensor" in declared.split_axes:
        raise ValueError(f"--quantization={model.quantization} with --strategy={strategy}: its `tensor` axis splits the "
                         "contraction of the row-parallel projections (and of the column-parallel ones' dx), so each "
                         "shard would quantize by its own absmax (twinshard/model/quantize.py); use a strategy without "
                         "tensor (dp, fsdp, cp, ...), or --quantization=none.")
    if train.virtual_stages != 1 and declared.family != "pipeline":
        raise ValueError(f"--virtual_stages={train.virtual_stages} splits a pipeline stage into chunks, and "
                         f"--strategy={strategy} has no stages: use --strategy=pp or pp_fsdp, or drop --virtual_stages.")
    row = support.SUPPORT.get(strategy)
    if row is None:  # written by no twin (single): the one device runs every option
        return
    if model.tp_overlap_chunks > 1 and impl not in row.tp_overlap:
        raise ValueError(f"--tp_overlap_chunks={model.tp_overlap_chunks} overlaps Megatron's all-reduces over "
                         f"`tensor` and is written for --strategy={'/'.join(support.with_option('tp_overlap'))} with "
                         f"--impl=auto or manual, not --strategy={strategy} --impl={impl}: use one of those, or "
                         "--tp_overlap_chunks=1.")
    if model.num_experts and model.moe_dispatch == "ragged" and train.grad_accum > 1 and impl not in row.ragged_accum:
        raise ValueError(f"--moe_dispatch=ragged with --grad_accum={train.grad_accum} under --impl={impl}: the GSPMD "
                         "twin accumulates each data shard's micro-batches under jax.vmap, and JAX 0.12 cannot vmap "
                         "jax.lax.ragged_dot over weights it does not batch: use --grad_accum=1, --impl=manual "
                         "or --moe_dispatch=dense.")
    if model.loss_chunks and impl not in row.loss_chunks:
        raise ValueError(f"--loss_chunks={model.loss_chunks} (vocabulary tiling) is written and tested for "
                         f"--strategy={'/'.join(LOSS_CHUNK_STRATEGIES)} with --impl=manual or auto, not --strategy="
                         f"{strategy} --impl={impl}: use one of those, or --loss_chunks=0.")
    if (impl == "manual" and model.attention == "splash" and jax.default_backend() != "tpu"
            and "tensor" in declared.split_axes):
        raise ValueError(f"--attention=splash under --strategy={strategy} --impl=manual runs Pallas' interpret mode off "
                         "a TPU, which fails inside the manual twin's checked shard_map over `tensor` (a loop carry typed "
                         "varying over it; docs/speed.md): use --impl=auto, or --attention=recompute here.")
    if declared.family == "pipeline" and impl not in (twins := support.schedule_twins(strategy, train.schedule)):
        runs = [s for s in support.SCHEDULE_FIELDS if impl in support.schedule_twins(strategy, s)]
        where = (f"is written in the {' and '.join(twins)} twin only (--impl={' or --impl='.join(twins)})"
                 if twins else "has its table (twinshard/parallel/pipeline.py) but no twin runs it yet")
        raise ValueError(f"--schedule={train.schedule} {where}; --impl={impl} runs --schedule="
                         f"{' or '.join(runs)} under --strategy={strategy}.")


# The strategies a mixture-of-experts model runs under
MOE_STRATEGIES = support.with_option("moe")


def check_experts(declared: Strategy, model: ModelConfig) -> None:
    """ep and fsdp_ep need a mixture of experts, which runs only under MOE_STRATEGIES (and single)."""
    experts, strategy = model.num_experts, declared.name
    if declared.family == "experts" and experts == 0:
        raise ValueError(f"--strategy={strategy} splits the experts over the `expert` axis, and this model is dense "
                         "(--num_experts=0): add experts (--preset=tiny_moe, or --num_experts=4), or use dp/fsdp.")
    if experts and strategy not in MOE_STRATEGIES:
        raise ValueError(f"--num_experts={experts}: a mixture of experts runs under {', '.join(MOE_STRATEGIES)} "
                         f"(or single), not --strategy={strategy}: pick one of those, or --num_experts=0.")


def check_overlap_chunks(shape: Mapping[str, int], cfg: Config) -> None:
    """--tp_overlap_chunks divides each device's micro-batch (batch_size / grad_accum / data)."""
    n, local = cfg.model.tp_overlap_chunks, cfg.train.batch_size // cfg.train.grad_accum // shape.get("data", 1)
    if local % n:
        raise ValueError(f"--tp_overlap_chunks={n} does not divide the {local} sequences of a device's micro-batch "
                         f"(--batch_size / --grad_accum / data); choose a divisor of {local} (1: off), or a larger "
                         "--batch_size.")


def check_kv_heads(declared: Strategy, twin: str, shape: Mapping[str, int], cfg: Config) -> None:
    """The explicit twin refuses a tensor axis that does not divide the kv heads (measured, JAX 0.12:
    the typed [B, T, Hkv*dh/t] -> [B, T, Hkv, dh] reshape raises ShardingTypeError)."""
    axis, kv_heads = declared.params.get(strategies.KV_HEADS), cfg.model.kv_heads
    n = shape.get(axis, 1) if axis is not None else 1
    if kv_heads % n and twin not in support.SUPPORT[declared.name].uneven_kv_heads:
        raise ValueError(f"--impl={twin} splits kv heads over {axis}, and {axis}={n} does not divide "
                         f"--num_kv_heads={kv_heads}: use --impl=auto or --impl=manual (they replicate the kv "
                         f"heads), or a {axis} axis that divides {kv_heads}.")


def check_dispatch(declared: Strategy, twin: str, devices, cfg: Config) -> None:
    """moe_dispatch='ragged' under manual ep needs ragged_all_to_all, which XLA:CPU cannot compile."""
    if (twin == "manual" and declared.family == "experts" and cfg.model.moe_dispatch == "ragged"
            and any(d.platform == "cpu" for d in devices)):
        raise ValueError("--moe_dispatch=ragged under the manual expert-parallel twin exchanges tokens with "
                         "jax.lax.ragged_all_to_all, and XLA:CPU cannot run ragged-all-to-all (these devices are "
                         "CPUs): use --moe_dispatch=dense (with --capacity_factor=0 it drops nothing either), "
                         "or run on TPU or GPU. (--impl=auto runs the ragged math on CPU, but GSPMD replicates "
                         "the experts' work instead of exchanging tokens: docs/experts.md.)")
