"""Plans: one strategy on one mesh of a topology, priced by the cost model over the links each mesh
axis crosses (`evaluate`), every such plan of a model (`plan_all`) and their ranking (`rank`).
`launch.plan` prints them; its module docstring says what each number means.

Per chip: memory (`cost.memory`) against the usable HBM, compute = FLOPs per chip / (peak x mfu),
and per mesh axis the seconds its collectives take (`comm_times`). With `Topology.slices` > 1 each
slice runs the plan on its share of the batch and every chip's gradients are all-reduced with its
counterparts in the other slices over the data-center network (`comm_s['dcn']`): pure data
parallelism across slices, the scaling book's recipe beyond one pod.

Where data does not divide d_model, FSDP's weights are split flat (`Plan.flat`). ZeRO-3 needs each
device to hold 1/data of every weight, not a whole slice of its d_model dim: it can flatten a
weight and pad it to a multiple of data (PyTorch's FSDP does: its FlatParameter), under data
elements per weight, which the cost model's bytes // data already rounds away. No other dim would
do in general (v5p:16x16x24's data:1536 = 3 x 512 divides none of Llama-3-70B's: 8192, 28672,
128256 / 1536, ...). launch.train's twins split d_model itself, with even shards (shard_map and
jit's argument shardings need them), so a flat plan is ranked but gets no launch line.
"""

from __future__ import annotations

from dataclasses import dataclass

from twinshard import cost
from twinshard.config import Config, ModelConfig, TrainConfig
from twinshard.cost.weights import DTYPE_BYTES
from twinshard.hardware.chips import matmul_peak_flops
from twinshard.hardware.links import Link, Topology, axis_links, dcn_link
from twinshard.parallel import mesh as mesh_lib, resolve, strategies


@dataclass(frozen=True)
class Precision:
    """What a parameter costs besides the compute dtype: params (and their gradients) stored in
    `params`, the optimizer state in `optimizer`, and a float32 master copy when `master` (mixed
    precision's bf16 weights + f32 master + f32 moments). Default: float32 params and state, as
    launch.train trains (16 bytes per parameter under AdamW)."""

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

    def step_s(self, rank_by: str) -> float:
        return self.serial_s if rank_by == "serial" else self.overlap_s

    def mesh_text(self) -> str:
        return mesh_lib.mesh_str(self.mesh, self.strategy)

    def label(self) -> str:
        """The mesh, and what else sets the plan apart ('data:1536,tensor:4 flat', 'dcn:2 x data:64,tensor:1')."""
        text = self.mesh_text() + (" flat" if self.flat else "")
        return text if self.slices == 1 else f"dcn:{self.slices} x {text}"


def comm_times(c: cost.Cost, links: dict[str, Link]) -> dict[str, float]:
    """Seconds per mesh axis: ring bytes / bandwidth, an all-to-all's times its link's hop factor
    (Link.all_to_all); a group over several axes goes at the slowest."""
    ring: dict[tuple[str, ...], float] = {}
    for (op, axes), s in c.summary().items():
        hops = links[min(axes, key=lambda a: links[a].bytes_per_s)].all_to_all if op == "all-to-all" else 1.0
        ring[axes] = ring.get(axes, 0.0) + s["ring_bytes"] * hops
    out = dict.fromkeys(c.mesh, 0.0)
    for axes, nbytes in ring.items():
        slowest = min(axes, key=lambda a: links[a].bytes_per_s)
        out[slowest] += nbytes / links[slowest].bytes_per_s
    return out


def train_config(cfg: ModelConfig, batch: int) -> Config:
    return Config(cfg, TrainConfig(batch_size=batch))


def _check_mesh(cfg: ModelConfig, topo: Topology, strategy: str, mesh: dict[str, int], batch: int) -> bool:
    """launch.train's checks of the mesh for this model (resolve.resolve_mesh: it also checks E over
    `expert`, which cost.cost does not): True when only d_model over data fails (a flat plan), a
    ValueError for anything else."""
    train, spec = train_config(cfg, batch), mesh_lib.mesh_str(mesh, strategy)
    try:
        resolve.resolve_mesh(strategy, spec, train, topo.chips, advise=False)
    except ValueError as e:
        if not str(e).startswith("embed="):
            raise
        resolve.resolve_mesh(strategy, spec, train, topo.chips, advise=False, flat_weights=True)
        return True
    return False


def evaluate(cfg: ModelConfig, topo: Topology, strategy: str, mesh: dict[str, int], batch: int,
             mfu: float = 1.0, headroom: float = 0.25, optimizer: str = "adamw",
             precision: Precision = Precision()) -> Plan:
    """One strategy on one mesh of each slice, `batch` sequences over all `topo.slices` slices; a
    ValueError when launch.train would refuse the mesh for this model but for d_model over data
    (`Plan.flat`)."""
    if batch % topo.slices:
        raise ValueError(f"batch={batch} does not split over {topo.slices} slices; pass a --batch_size that is "
                         f"a multiple of {topo.slices}")
    batch //= topo.slices
    flat = _check_mesh(cfg, topo, strategy, mesh, batch)
    c = cost.cost(cfg, strategy, mesh, batch, cfg.context_length, optimizer=optimizer, gpu=not topo.chip.is_tpu,
                  flat_weights=flat, **precision.memory_kwargs())
    links = axis_links(topo, c.mesh)
    comm = comm_times(c, links)
    if topo.slices > 1:  # each chip's gradients all-reduced with its counterparts in the other slices
        links["dcn"] = dcn_link(topo)
        comm["dcn"] = 2 * (topo.slices - 1) / topo.slices * c.memory.grads / links["dcn"].bytes_per_s
    peak, _ = matmul_peak_flops(topo.chip, cfg.dtype)
    return Plan(strategy, c.mesh, c, topo.chip.hbm_bytes * (1 - headroom), c.flops.per_device / (peak * mfu),
                comm, links, flat, topo.slices)


def candidate_meshes(strategy: str, n: int) -> list[dict[str, int]]:
    """Every factoring of n over the strategy's mesh axes that it allows (mesh.check_mesh: dp/fsdp
    data x tensor 1, tp data 1, ep data x expert > 1, fsdp_ep data > 1 x expert > 1 x tensor 1);
    the inner axis smallest first (data:64,tensor:1, data:32,tensor:2, ...)."""
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
    """The plannable strategies the model runs under (dense: dp, fsdp, tp, fsdp_tp; a mixture of
    experts: dp, fsdp, ep, fsdp_ep), and the others -> resolve.check_experts's reason."""
    ok, refused = [], {}
    for strategy in strategies.PLANNABLE:
        try:
            resolve.check_experts(strategy, train_config(cfg, 1))  # it reads the model only
        except ValueError as e:
            refused[strategy] = str(e)
        else:
            ok.append(strategy)
    return ok, refused


def plan_all(cfg: ModelConfig, topo: Topology, batch: int, mfu: float = 1.0, headroom: float = 0.25,
             optimizer: str = "adamw", precision: Precision = Precision()) -> tuple[list[Plan], list[Skipped]]:
    """Every (strategy, mesh) the model splits on, and those it does not (with the first reason);
    the strategies it cannot run under at all (`runnable`) are in neither."""
    plans, skipped = [], []
    for strategy in runnable(cfg)[0]:
        for shape in candidate_meshes(strategy, topo.chips):
            try:
                plans.append(evaluate(cfg, topo, strategy, shape, batch, mfu, headroom, optimizer, precision))
            except ValueError as e:
                skipped.append(Skipped(strategy, shape, str(e).split(";")[0]))
    return plans, skipped


def rank(plans: list[Plan], rank_by: str) -> tuple[list[Plan], list[Plan]]:
    """(plans that fit, fastest first; plans that do not fit, smallest memory first)."""
    fit = sorted((p for p in plans if p.fits), key=lambda p: (p.step_s(rank_by), p.memory))
    over = sorted((p for p in plans if not p.fits), key=lambda p: p.memory)
    return fit, over
