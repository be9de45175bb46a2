"""Plans: one strategy on one mesh of a topology, priced by the cost model over the links each mesh
axis crosses (`evaluate`), every such plan of a model (`plan_all`) and their ranking (`rank`).
`launch.plan` prints them; its module docstring says what each number means.

Every strategy the model runs under is planned on every mesh its declaration allows. Per chip:
memory against usable HBM, compute = FLOPs / (peak x mfu) times a pipeline's `pipeline_factor`,
and per mesh axis its collectives' seconds. Where data does not divide d_model, FSDP's weights are
split flat (`Plan.flat`, docs/planning.md).

Across `Topology.slices` > 1 slices (over the data-center network, DCN), `Plan.layout` names the layout:
each strategy inside a slice, data parallel across (`dp`; `hsdp` for fsdp inside: the weights' shards
stay in the slice), the DCN term each chip's float32 gradients' all-reduce with its counterparts,
2 (N-1)/N x their bytes at the DCN rate; or `fsdp` over every chip (`across`: the weights split over
all N x M chips), whose collectives XLA:TPU runs hierarchically (launch/slices.py): inside a slice as
fsdp over M chips, and across slices each weight's gather of its M-chip shard, (N-1)/N x G/M, and each
gradient's all-reduce of its shard, as hsdp's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction

from twinshard import cost
from twinshard.config import Config, ModelConfig, TrainConfig
from twinshard.cost.weights import DTYPE_BYTES, F32
from twinshard.hardware.chips import matmul_peak_flops
from twinshard.hardware.links import Link, Topology, axis_links, collective_seconds, dcn_link
from twinshard.parallel import mesh as mesh_lib, pipeline, resolve, strategies, support


@dataclass(frozen=True)
class Precision:
    """Params' (and gradients') and optimizer state's storage, plus a float32 master copy when `master`."""

    params: str = "float32"
    optimizer: str = "float32"
    master: bool = False

    def memory_kwargs(self) -> dict:
        return {"param_bytes": DTYPE_BYTES[self.params], "state_bytes": DTYPE_BYTES[self.optimizer],
                "master": self.master}

    @property
    def is_default(self) -> bool:
        return self == Precision()


@dataclass(frozen=True)
class Plan:
    strategy: str
    mesh: dict[str, int]
    cost: cost.Cost
    hbm_usable: float  # bytes per chip the plan may use
    compute_s: float
    comm_s: dict[str, float]  # per axis of the plan's mesh, and 'dcn' across slices; 0 where nothing moves
    links: dict[str, Link]
    flat: bool = False  # FSDP's weights split flat: data does not divide d_model (module docstring)
    slices: int = 1
    microbatches: int = 1  # a pipeline's M
    schedule: str = "gpipe"  # a pipeline's schedule
    across: bool = False  # slices > 1: fsdp's weights split over every slice's chips (module docstring)
    virtual: int = 1  # interleaved's chunks per stage (V)

    @property
    def layout(self) -> str:
        """The strategy; across slices `hsdp` for fsdp inside each, data parallel across (module docstring)."""
        return "hsdp" if self.slices > 1 and self.strategy == "fsdp" and not self.across else self.strategy

    @property
    def memory(self) -> int:
        return self.cost.memory.total

    @property
    def fits(self) -> bool:
        return self.memory <= self.hbm_usable

    @property
    def overlap_s(self) -> float:
        return max(self.compute_s, *self.comm_s.values())

    @property
    def serial_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())

    @property
    def bound(self) -> str:
        terms = {"compute": self.compute_s, **{f"comm {a}": s for a, s in self.comm_s.items()}}
        return max(terms, key=terms.get)

    @property
    def runnable(self) -> bool:
        """launch.train runs it as planned (one slice, d_model split evenly)."""
        return not self.flat and self.slices == 1

    @property
    def bubble(self) -> Fraction:
        """A pipeline's share of idle stage-ticks in its schedule's table (pipeline.build); 0 otherwise."""
        if self.strategy not in cost.PIPELINES:
            return Fraction(0)
        return pipeline.build(self.schedule, self.mesh["stage"], self.microbatches, self.virtual).bubble()

    def step_s(self, rank_by: str) -> float:
        """The step time `rank_by` ranks by: 'serial' (compute + every axis's communication) or
        'overlap' (the largest of them)."""
        return {"serial": self.serial_s, "overlap": self.overlap_s}[check_rank_by(rank_by)]

    def mesh_text(self) -> str:
        return mesh_lib.mesh_str(self.mesh, self.strategy)

    def label(self) -> str:
        """The mesh, and what else sets the plan apart ('data:1536,tensor:4 flat', 'stage:4 M=16 1f1b')."""
        text = self.mesh_text() + (" flat" if self.flat else "")
        if self.strategy in cost.PIPELINES:
            text += f" M={self.microbatches} {self.schedule}" + (f" V={self.virtual}" if self.virtual > 1 else "")
        if self.across:
            return f"{text} over {self.slices} slices"
        return text if self.slices == 1 else f"dcn:{self.slices} x {text}"


RANK_BY = ("serial", "overlap")  # the step times plans are ranked by (Plan.step_s), serial first: the default


def check_rank_by(rank_by: str) -> str:
    """rank_by itself, or a ValueError naming the choices (a typo must not rank by another step)."""
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by={rank_by!r}: rank by one of {RANK_BY}")
    return rank_by


def comm_times(c: cost.Cost, links: dict[str, Link]) -> dict[str, float]:
    """Seconds per mesh axis: ring bytes / bandwidth (x Link.all_to_all for an all-to-all, a shift at one link's rate)."""
    out = dict.fromkeys(c.mesh, 0.0)
    for (op, axes), s in c.summary().items():
        axis, seconds = collective_seconds(op, axes, s["ring_bytes"], links)
        out[axis] += seconds
    return out


def pipeline_factor(microbatches: int, stages: int, schedule: str, virtual: int = 1) -> float:
    """A pipeline stage's step time over its FLOPs' time: GPipe (M + S - 1) / M; a schedule run by hand
    takes per tick its slowest stage's op, in forwards of one chunk (1/V of a stage): a forward 1, a
    backward 3 (its jax.vjp re-runs the forward), zb_h1's input gradient 2 (the forward again and
    dx) and its weight gradient 1: dW alone from B's stash (manual_parallel/pp_split.py; its dots
    counted in the compiled program: tests/test_pipeline.py::test_zb_h1_splits_the_backward_in_the_compiled_program)."""
    if schedule == "gpipe":
        return pipeline.ticks(microbatches, stages) / microbatches
    units = {pipeline.IDLE: 0, pipeline.FORWARD: 1, pipeline.BACKWARD: 3, pipeline.INPUT: 2, pipeline.WEIGHT: 1}
    kinds, _, _ = pipeline.build(schedule, stages, microbatches, virtual).arrays()
    return sum(max(units[k] for k in row) for row in kinds) / (3 * microbatches * virtual)


def _flops_per_chip(c: cost.Cost) -> float:
    """MFU's FLOPs per device: causal attention half, and (C+1)/(2C) of it under ring attention."""
    f, n = c.flops, c.mesh.get("context", 1)
    skipped = 3 * f.forward_attention * (1 - (n + 1) / (2 * n) if n > 1 else 0.5)
    return f.per_device * (1 - skipped / f.total)


def train_config(cfg: ModelConfig, batch: int, microbatches: int = 1, schedule: str = "gpipe",
                 virtual: int = 1) -> Config:
    return Config(cfg, TrainConfig(batch_size=batch, microbatches=microbatches, schedule=schedule,
                                   virtual_stages=virtual))


def _check_mesh(cfg: ModelConfig, chips: int, strategy: str, mesh: dict[str, int], train: Config) -> bool:
    """launch.train's mesh checks for this model: True when only d_model over data fails (flat), else ValueError."""
    spec = mesh_lib.mesh_str(mesh, strategy)
    try:
        resolve.resolve_mesh(strategy, spec, train, chips, advise=False)
    except ValueError as e:
        if not str(e).startswith("embed="):
            raise
        resolve.resolve_mesh(strategy, spec, train, chips, advise=False, flat_weights=True)
        return True
    return False


def dcn_seconds(inside: cost.Cost, slices: int, link: Link, precision: Precision, across: bool) -> float:
    """Each chip's seconds on DCN a step (module docstring): its float32 gradient shards' all-reduce over
    the slices; across, also each weight gather's (N-1)/N x its M-chip shard (`inside`: the cost on one
    slice's mesh)."""
    share = (slices - 1) / slices
    grads = inside.memory.grads * F32 // DTYPE_BYTES[precision.params]
    sent = 2 * share * grads
    if across:
        chips = inside.mesh["data"]
        sent += sum(share * s["bytes"] / chips for (op, axes), s in inside.summary().items()
                    if op == "all-gather" and axes == ("data",))
    return sent / link.bytes_per_s


def evaluate(cfg: ModelConfig, topo: Topology, strategy: str, mesh: dict[str, int], batch: int,
             mfu: float = 1.0, headroom: float = 0.25, optimizer: str = "adamw",
             precision: Precision = Precision(), microbatches: int = 1, schedule: str = "gpipe",
             across: bool = False, virtual: int = 1) -> Plan:
    """One strategy on one mesh of each slice (across: fsdp's `data` over every slice's chips, module
    docstring); ValueError where launch.train would refuse the mesh (flat aside)."""
    if across and (strategy != "fsdp" or topo.slices == 1):
        raise ValueError(f"across=True splits fsdp's weights over several slices' chips, not {strategy} on "
                         f"{topo.slices} slice(s): plan --strategy fsdp with --slices > 1")
    if batch % topo.slices:
        raise ValueError(f"batch={batch} does not split over {topo.slices} slices; pass a --batch_size that is "
                         f"a multiple of {topo.slices}")
    batch //= topo.slices
    if strategy not in cost.PIPELINES:
        microbatches, schedule, virtual = 1, "gpipe", 1
    flat = _check_mesh(cfg, topo.chips, strategy, mesh, train_config(cfg, batch, microbatches, schedule, virtual))
    if strategy not in support.with_option("collective_matmul"):  # tp_sp's gathers only
        cfg = dataclasses.replace(cfg, collective_matmul=False)
    if strategy not in support.with_option("tp_overlap"):  # Megatron's all-reduces of tp, fsdp_tp only
        cfg = dataclasses.replace(cfg, tp_overlap_chunks=1)
    c = cost.cost(cfg, strategy, mesh, batch, cfg.context_length, optimizer=optimizer, microbatches=microbatches,
                  schedule=schedule, gpu=not topo.chip.is_tpu, flat_weights=flat, virtual_stages=virtual,
                  **precision.memory_kwargs())
    links = axis_links(topo, c.mesh)
    comm = comm_times(c, links)
    if topo.slices > 1:  # each chip's f32 gradients all-reduced with its counterparts in the other slices
        links["dcn"] = dcn_link(topo)
        comm["dcn"] = dcn_seconds(c, topo.slices, links["dcn"], precision, across)
    if across:  # memory and mesh: fsdp over every chip; compute and ICI: one slice's (the same per chip)
        c, flat = _across(cfg, topo, batch * topo.slices, optimizer, precision)
    peak, _ = matmul_peak_flops(topo.chip, cfg.dtype)
    compute = _flops_per_chip(c) / (peak * mfu)
    if strategy in cost.PIPELINES:
        compute *= pipeline_factor(microbatches, mesh["stage"], schedule, virtual)
    return Plan(strategy, c.mesh, c, topo.chip.hbm_bytes * (1 - headroom), compute, comm, links, flat, topo.slices,
                microbatches, schedule, across, virtual)


def _across(cfg: ModelConfig, topo: Topology, batch: int, optimizer: str,
            precision: Precision) -> tuple[cost.Cost, bool]:
    """fsdp's cost on data = every slice's chips (its memory and mesh), the whole `batch`; and whether flat."""
    mesh = {"data": topo.chips * topo.slices, "tensor": 1}
    flat = _check_mesh(cfg, mesh["data"], "fsdp", mesh, train_config(cfg, batch))
    return cost.cost(cfg, "fsdp", mesh, batch, cfg.context_length, optimizer=optimizer, flat_weights=flat,
                     **precision.memory_kwargs()), flat


def candidate_meshes(strategy: str, n: int) -> list[dict[str, int]]:
    """Every factoring of n over the strategy's mesh axes its declaration allows, inner axis smallest first."""
    out = []
    for shape in mesh_lib.factorings(tuple(a for a in mesh_lib.ORDER if a in mesh_lib.NEEDS[strategy]), n):
        try:
            mesh_lib.check_mesh(strategy, shape, n)
        except ValueError:
            continue
        out.append(shape)
    return out


@dataclass(frozen=True)
class Skipped:
    strategy: str
    mesh: dict[str, int]
    why: str

    def mesh_text(self) -> str:
        return mesh_lib.mesh_str(self.mesh, self.strategy)


def runnable(cfg: ModelConfig) -> tuple[list[str], dict[str, str]]:
    """The declared strategies the model runs under, and the others -> resolve.check_experts's reason. A
    strategy with axes across slices (hsdp) is no plan of one slice's chips: across slices it is the
    `hsdp` layout of fsdp (`Plan.layout`)."""
    ok, refused = [], {}
    for strategy in support.SUPPORT:
        if strategy in strategies.CROSS_DCN:
            continue
        try:
            resolve.check_experts(strategies.get(strategy), cfg)
        except ValueError as e:
            refused[strategy] = str(e)
        else:
            ok.append(strategy)
    return ok, refused


def _best(plans: list[Plan], rank_by: str) -> Plan:
    """The fastest plan that fits, else the smallest."""
    check_rank_by(rank_by)
    fit = [p for p in plans if p.fits]
    return min(fit, key=lambda p: (p.step_s(rank_by), p.memory)) if fit else min(plans, key=lambda p: p.memory)


MAX_VIRTUAL = 4  # the most chunks per stage the planner tries for interleaved (each V sends V times as often)


def schedule_choices(num_layers: int, stages: int) -> list[tuple[str, int]]:
    """(schedule, V) the planner tries on S stages: every pipeline.SCHEDULES entry, interleaved once per V in
    2 ... MAX_VIRTUAL that splits a stage's L/S layers into equal chunks (none where no V does)."""
    per_stage = num_layers // stages
    return [(s, v) for s in pipeline.SCHEDULES
            for v in (range(2, MAX_VIRTUAL + 1) if s in pipeline.INTERLEAVED else (1,)) if per_stage % v == 0]


def _pipeline_plans(cfg: ModelConfig, topo: Topology, strategy: str, mesh: dict[str, int], batch: int,
                    rank_by: str, **kwargs) -> list[Plan]:
    """One plan per (schedule, V) of schedule_choices, with the micro-batch count M that ranks best (interleaved:
    M a multiple of S); ValueError when none gives a plan."""
    rows, stages = batch // topo.slices // mesh.get("data", 1), mesh["stage"]
    counts = [m for m in range(stages, rows + 1) if rows % m == 0]
    if not counts:  # pipeline.check names the value and the fix
        pipeline.check(cfg.num_layers, batch // topo.slices, stages, stages, data=mesh.get("data", 1))
    out, error = [], None
    for schedule, virtual in schedule_choices(cfg.num_layers, stages):
        plans = []
        for m in (m for m in counts if virtual == 1 or m % stages == 0):
            try:
                plans.append(evaluate(cfg, topo, strategy, mesh, batch, microbatches=m, schedule=schedule,
                                      virtual=virtual, **kwargs))
            except ValueError as e:
                error = error or e
        if plans:
            out.append(_best(plans, rank_by))
    if not out:
        raise error
    return out


def plan_all(cfg: ModelConfig, topo: Topology, batch: int, mfu: float = 1.0, headroom: float = 0.25,
             optimizer: str = "adamw", precision: Precision = Precision(),
             rank_by: str = "serial") -> tuple[list[Plan], list[Skipped]]:
    """Every (strategy, mesh) the model splits on, and those it does not (with the first reason)."""
    check_rank_by(rank_by)
    plans, skipped = [], []
    kwargs = dict(mfu=mfu, headroom=headroom, optimizer=optimizer, precision=precision)
    for strategy in runnable(cfg)[0]:
        for shape in candidate_meshes(strategy, topo.chips):
            try:
                if strategy in cost.PIPELINES:
                    plans += _pipeline_plans(cfg, topo, strategy, shape, batch, rank_by, **kwargs)
                else:
                    plans.append(evaluate(cfg, topo, strategy, shape, batch, **kwargs))
                if strategy == "fsdp" and topo.slices > 1:  # and fsdp over every slice's chips
                    plans.append(evaluate(cfg, topo, strategy, shape, batch, across=True, **kwargs))
            except ValueError as e:
                skipped.append(Skipped(strategy, shape, str(e).split(";")[0]))
    return plans, skipped


def rank(plans: list[Plan], rank_by: str) -> tuple[list[Plan], list[Plan]]:
    """(plans that fit, fastest first; plans that do not fit, smallest memory first)."""
    check_rank_by(rank_by)
    fit = sorted((p for p in plans if p.fits), key=lambda p: (p.step_s(rank_by), p.memory))
    over = sorted((p for p in plans if not p.fits), key=lambda p: p.memory)
    return fit, over


def pipeline_schedules(fit: list[Plan], over: list[Plan]) -> list[Plan]:
    """The plans of the best-ranked pipeline mesh, one per (schedule, V) with its best M, in rank's order (those
    that fit, fastest first, then those that do not); the first that fits is the schedule named for that
    shape. [] without a pipeline plan."""
    first = next((p for p in fit + over if p.strategy in cost.PIPELINES), None)
    key = lambda p: (p.strategy, p.mesh, p.slices, p.across)  # noqa: E731
    return [p for p in fit + over if first is not None and key(p) == key(first)]
