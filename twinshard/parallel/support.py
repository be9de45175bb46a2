"""What each twin writes: the strategies, and the options each runs them with.

One row per declared strategy (twinshard/parallel/strategies.py); each field names the twins that
run it. Validation (twinshard/parallel/resolve.py), the planner (twinshard/hardware/plan.py), the
cost model's check and the launchers read this table; README.md's strategy table agrees with it
(tests/test_strategies.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from twinshard.parallel import strategies

TWINS = ("auto", "manual", "explicit")
_ALL, _TWO, _MANUAL, _NONE = TWINS, ("auto", "manual"), ("manual",), ()


@dataclass(frozen=True)
class Support:
    """The twins that write a strategy, and those of them that run each option under it.

    moe:               a mixture of experts (ep and fsdp_ep need one).
    one_f_one_b:       --schedule=1f1b (the others run GPipe).
    collective_matmul: --collective_matmul (tp_sp's sequence all-gathers decomposed).
    ragged_accum:      --moe_dispatch=ragged with --grad_accum > 1.
    uneven_kv_heads:   a tensor axis larger than the kv heads (each kv head replicated, Strategy.placed).
    loss_chunks:       --loss_chunks (vocabulary tiling).
    """

    twins: tuple[str, ...]
    moe: tuple[str, ...] = _NONE
    one_f_one_b: tuple[str, ...] = _NONE
    collective_matmul: tuple[str, ...] = _NONE
    ragged_accum: tuple[str, ...] = _NONE
    uneven_kv_heads: tuple[str, ...] = _NONE
    loss_chunks: tuple[str, ...] = _NONE


_MOE = dict(moe=_TWO, ragged_accum=_MANUAL)
_MEGATRON = dict(uneven_kv_heads=_TWO)
SUPPORT: dict[str, Support] = {
    "dp": Support(_ALL, loss_chunks=_TWO, **_MOE),
    "fsdp": Support(_ALL, loss_chunks=_TWO, **_MOE),
    "tp": Support(_ALL, loss_chunks=_TWO, **_MEGATRON),
    "fsdp_tp": Support(_ALL, loss_chunks=_TWO, **_MEGATRON),
    "tp_sp": Support(_ALL, collective_matmul=_MANUAL, **_MEGATRON),
    "cp": Support(_TWO),
    "fsdp_cp": Support(_TWO),
    "ulysses": Support(_TWO),
    "fsdp_ulysses": Support(_TWO),
    "pp": Support(_TWO, one_f_one_b=_MANUAL),
    "pp_fsdp": Support(_TWO, one_f_one_b=_MANUAL),
    "ep": Support(_TWO, **_MOE),
    "fsdp_ep": Support(_TWO, **_MOE),
}
assert tuple(SUPPORT) == strategies.NAMES, "one row per declared strategy, in declaration order"


def get(strategy: str) -> Support:
    """The row of `strategy`; an unknown name is strategies.get's ValueError."""
    strategies.get(strategy)
    return SUPPORT[strategy]


def written_by(twin: str) -> tuple[str, ...]:
    """The strategies `twin` writes."""
    return tuple(name for name, row in SUPPORT.items() if twin in row.twins)


def with_option(option: str, twin: str | None = None) -> tuple[str, ...]:
    """The strategies that run `option` (a Support field) in `twin`, or in any twin."""
    return tuple(name for name, row in SUPPORT.items()
                 if (twin in getattr(row, option) if twin is not None else getattr(row, option)))
