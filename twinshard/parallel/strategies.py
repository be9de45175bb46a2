"""Every parallelism strategy, declared once.

A declaration is data: the mesh axes the strategy needs, its placement (logical axis -> mesh
axis) and what it composes; the twins, launchers, mesh checks, cost model and planner read it,
and nothing else names a strategy.

    strategy  composes   splits over the mesh                               family
    single    -          nothing (one device: the reference of every twin)  base
    dp        -          the batch over data                                base
    fsdp      -          the batch and every weight's d_model over data     base
    tp        -          heads, kv heads, d_ff, vocab over tensor           base
    fsdp_tp   fsdp x tp  both of the above                                  base
    tp_sp     (tp)       tp's, plus the residual stream's T over tensor     base
    cp        -          the sequence over context (ring attention)         context
    fsdp_cp   fsdp x cp  both                                               context
    ulysses   -          the sequence over context (all-to-all to heads in attention)  context
    fsdp_ulysses  fsdp x ulysses  both                                      context
    pp        -          the layer stack over stage                         pipeline
    pp_fsdp   pp x fsdp  both                                               pipeline
    ep        -          the experts over expert, the batch over (data, expert)  experts
    fsdp_ep   fsdp x ep  both                                               experts
    hsdp      dp x fsdp  the batch over (data, fsdp); every weight's d_model over fsdp,
                         replicated over data (the axis across slices, over DCN)    slices

An axis absent from a table is replicated; a tuple of mesh axes splits a dimension over their
product. `Strategy.placed` drops kv_heads (replicated) where the tensor axis exceeds the kv heads
(docs/design.md, grouped-query attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from twinshard.parallel.axes import ORDER

MANY, ONE, ANY = ">1", "=1", ">=1"  # what a mesh axis's size must be: split over, unused, either
KV_HEADS = "kv_heads"  # the logical axis of the key/value projections' output columns
FAMILIES = ("base", "pipeline", "context", "experts", "slices")


def _frozen(table: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(table))


@dataclass(frozen=True)
class Strategy:
    """One strategy: `mesh` (axis -> MANY / ONE / ANY), `params` and `activations` (logical axis ->
    mesh axis; a weight where it is used follows `activations`), `sequence` (the residual stream's
    table where it differs: tp_sp), `composes`, `family` (base, pipeline, context, experts, slices) and
    `dcn`: the mesh axes that may run across slices over DCN (--dcn_mesh); every other axis stays
    inside a slice, on ICI."""

    name: str
    summary: str
    mesh: Mapping[str, str]
    params: Mapping[str, str]
    activations: Mapping[str, str]
    sequence: Mapping[str, str] | None = None
    composes: tuple[str, ...] = ()
    family: str = "base"
    dcn: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.family in FAMILIES, self.family
        assert all(self.mesh.get(a) == MANY for a in self.dcn), (self.name, self.dcn)
        for name in ("mesh", "params", "activations"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        if self.sequence is not None:
            object.__setattr__(self, "sequence", _frozen(self.sequence))

    @property
    def split_rules(self) -> dict[str, str]:
        """Every logical dim the strategy splits -> its mesh axis."""
        return {**self.params, **(self.sequence if self.sequence is not None else self.activations)}

    def placed(self, kv_heads: int, mesh: Mapping[str, int]) -> Strategy:
        """This declaration for `kv_heads` key/value heads on `mesh`: kv_heads dropped from every table where its axis exceeds them."""
        axis = self.params.get(KV_HEADS)
        if axis is None or kv_heads % mesh.get(axis, 1) == 0:
            return self
        drop = lambda table: {k: v for k, v in table.items() if k != KV_HEADS}  # noqa: E731
        return replace(self, params=drop(self.params), activations=drop(self.activations),
                       sequence=None if self.sequence is None else drop(self.sequence))

    @property
    def split_axes(self) -> tuple[str, ...]:
        """The mesh axes it splits something over (size > 1)."""
        return tuple(a for a, need in self.mesh.items() if need == MANY)


# Megatron: column/row/vocab-parallel (the kv heads too, while the tensor axis divides them: `placed`)
_TP = {"heads": "tensor", KV_HEADS: "tensor", "mlp": "tensor", "vocab": "tensor"}


def compose(name: str, summary: str, *parts: Strategy, family: str = "base") -> Strategy:
    """The product of `parts`: the union of their tables (MANY wins over ONE)."""
    needs: dict[str, str] = {}
    for part in parts:
        for axis, need in part.mesh.items():
            needs[axis] = MANY if MANY in (need, needs.get(axis)) else need
    union = lambda table: {k: v for part in parts for k, v in getattr(part, table).items()}  # noqa: E731
    return Strategy(name, summary, mesh={a: needs[a] for a in ORDER if a in needs}, params=union("params"),
                    activations=union("activations"), composes=tuple(p.name for p in parts), family=family)


# One device, nothing split and nothing moved: the reference every twin is compared with
# (twinshard.train.trainer.SingleDevice runs it; no twin writes it).
SINGLE = Strategy("single", "one device: nothing split, no collective; the reference of every twin",
                  mesh={}, params={}, activations={})
DP = Strategy("dp", "replicate every weight; split the batch over data",
              mesh={"data": MANY, "tensor": ONE}, params={}, activations={"batch": "data"})
FSDP = Strategy("fsdp", "ZeRO-3: every weight's d_model over data, gathered whole before use; batch over data",
                mesh={"data": MANY, "tensor": ONE}, params={"embed": "data"}, activations={"batch": "data"})
TP = Strategy("tp", "Megatron: heads, d_ff and the vocabulary over tensor; the batch replicated",
              mesh={"data": ONE, "tensor": MANY}, params=_TP, activations=_TP)
FSDP_TP = compose("fsdp_tp", "fsdp over data inside Megatron tp over tensor", FSDP, TP)
TP_SP = Strategy("tp_sp", "Megatron sequence parallelism: tp, and the residual stream's T over tensor",
                 mesh={"data": ANY, "tensor": MANY}, params=_TP, activations={"batch": "data", **_TP},
                 sequence={"batch": "data", **_TP, "seq": "tensor"}, composes=("tp",))
CP = Strategy("cp", "context parallelism: the sequence over context (ring attention), weights replicated",
              mesh={"data": ONE, "context": MANY, "tensor": ONE}, params={}, activations={"seq": "context"},
              family="context")
FSDP_CP = compose("fsdp_cp", "fsdp over data, the sequence over context", FSDP, CP, family="context")
# DeepSpeed-Ulysses (Jacobs et al. 2023): cp's placement; attention all-to-alls the sequence shards
# into head shards (whole sequences) and back, so it holds the contiguous layout and splash runs.
ULYSSES = Strategy("ulysses", "all-to-all sequence parallelism: the sequence over context, attention on "
                   "whole sequences of h/C heads, weights replicated",
                   mesh={"data": ONE, "context": MANY, "tensor": ONE}, params={}, activations={"seq": "context"},
                   family="context")
FSDP_ULYSSES = compose("fsdp_ulysses", "fsdp over data, ulysses over context", FSDP, ULYSSES, family="context")
PP = Strategy("pp", "pipeline: the layer stack over stage, micro-batches handed stage to stage",
              mesh={"stage": MANY, "data": ONE, "tensor": ONE}, params={"layers": "stage"}, activations={},
              family="pipeline")
PP_FSDP = compose("pp_fsdp", "pp over stage, fsdp over data inside each stage", PP, FSDP, family="pipeline")
# Expert parallelism: expert e lives on expert index e // (E/ep); all (data, expert) devices' tokens
# travel to it and back (all_to_all).
EP = Strategy("ep", "expert parallelism: the experts over expert, the batch over (data, expert), the rest replicated",
              mesh={"data": ANY, "expert": MANY}, params={"experts": "expert"},
              activations={"batch": ("data", "expert"), "experts": "expert", "expert_groups": "data"},
              family="experts")
FSDP_EP = compose("fsdp_ep", "ep, plus fsdp of every weight's d_model over data", FSDP, EP, family="experts")
# Hybrid sharded data parallelism (PyTorch's HSDP; MaxText's dcn_data_parallelism with ici fsdp): the
# weights' shards live inside a slice, so across slices (over DCN) only the gradient shards' all-reduce
# travels: no weight and no activation crosses DCN.
HSDP = Strategy("hsdp", "data parallel over data (across slices, over DCN), fsdp of every weight's d_model over "
                "fsdp inside each slice; the batch over both",
                mesh={"data": MANY, "fsdp": MANY}, params={"embed": "fsdp"}, activations={"batch": ("data", "fsdp")},
                family="slices", dcn=("data",))

DECLARATIONS: tuple[Strategy, ...] = (SINGLE, DP, FSDP, TP, FSDP_TP, TP_SP, CP, FSDP_CP, ULYSSES, FSDP_ULYSSES, PP,
                                      PP_FSDP, EP, FSDP_EP, HSDP)
STRATEGIES: Mapping[str, Strategy] = MappingProxyType({s.name: s for s in DECLARATIONS})
# Every --strategy; NAMES: the parallel ones (a mesh axis to split over), which the twins write
RUNS: tuple[str, ...] = tuple(STRATEGIES)
NAMES: tuple[str, ...] = tuple(s.name for s in DECLARATIONS if s.split_axes)
# The strategies whose mesh is exactly data x tensor, each axis split or 1
DATA_TENSOR: tuple[str, ...] = tuple(s.name for s in DECLARATIONS
                                     if s.family == "base" and s.split_axes and ANY not in s.mesh.values())


# The strategies that may put an axis across slices (--dcn_mesh), and those axes
CROSS_DCN: tuple[str, ...] = tuple(s.name for s in DECLARATIONS if s.dcn)

# The context strategies whose attention sees whole sequences: contiguous layout whatever --cp_layout says
ALL_TO_ALL_CONTEXT: tuple[str, ...] = (ULYSSES.name, FSDP_ULYSSES.name)


def get(name: str) -> Strategy:
    """The declaration of `name`; an unknown name is a ValueError listing the strategies."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(RUNS)}.")
    return STRATEGIES[name]


def of_family(family: str) -> tuple[str, ...]:
    assert family in FAMILIES, family
    return tuple(s.name for s in DECLARATIONS if s.family == family)
