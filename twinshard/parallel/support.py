"""What each twin writes: the strategies, and the options each runs them with.

One row per declared strategy; each field names the twins that run it. README.md's table agrees (tests/test_strategies.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from twinshard.parallel import strategies

TWINS = ("auto", "manual", "explicit")
_ALL, _TWO, _MANUAL, _NONE = TWINS, ("auto", "manual"), ("manual",), ()


@dataclass(frozen=True)
class Support:
    """The twins that write a strategy, and those of them that run each option under it
    (moe, --schedule=1f1b / zb_h1 / interleaved, --collective_matmul, ragged with grad_accum, kv heads
    replicated, --loss_chunks, --tp_overlap_chunks)."""

    twins: tuple[str, ...]
    moe: tuple[str, ...] = _NONE
    one_f_one_b: tuple[str, ...] = _NONE
    zb_h1: tuple[str, ...] = _NONE
    interleaved: tuple[str, ...] = _NONE
    collective_matmul: tuple[str, ...] = _NONE
    ragged_accum: tuple[str, ...] = _NONE
    uneven_kv_heads: tuple[str, ...] = _NONE
    loss_chunks: tuple[str, ...] = _NONE
    tp_overlap: tuple[str, ...] = _NONE


_MOE = dict(moe=_TWO, ragged_accum=_MANUAL)
_MEGATRON = dict(uneven_kv_heads=_TWO)
# The schedules beyond gpipe (every pipeline twin's): the manual twin runs each by hand from its table
# (twinshard/parallel/pipeline.py); the GSPMD twin runs interleaved as a circular loop (auto_parallel/pp.py)
_BY_HAND = dict(one_f_one_b=_MANUAL, zb_h1=_MANUAL, interleaved=_TWO)
SUPPORT: dict[str, Support] = {
    "dp": Support(_ALL, loss_chunks=_TWO, **_MOE),
    "fsdp": Support(_ALL, loss_chunks=_TWO, **_MOE),
    "tp": Support(_ALL, loss_chunks=_TWO, tp_overlap=_TWO, **_MEGATRON),
    "fsdp_tp": Support(_ALL, loss_chunks=_TWO, tp_overlap=_TWO, **_MEGATRON),
    "tp_sp": Support(_ALL, collective_matmul=_MANUAL, **_MEGATRON),
    "cp": Support(_TWO),
    "fsdp_cp": Support(_TWO),
    "ulysses": Support(_ALL),
    "fsdp_ulysses": Support(_TWO),
    "pp": Support(_TWO, **_BY_HAND),
    "pp_fsdp": Support(_TWO, **_BY_HAND),
    "ep": Support(_TWO, **_MOE),
    "fsdp_ep": Support(_TWO, **_MOE),
    "hsdp": Support(_TWO),
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


# --schedule's value -> the Support field naming the twins that run it (gpipe: every twin of the strategy)
SCHEDULE_FIELDS = {"gpipe": "twins", "1f1b": "one_f_one_b", "zb_h1": "zb_h1", "interleaved": "interleaved"}


def schedule_twins(strategy: str, schedule: str) -> tuple[str, ...]:
    """The twins that run pipeline `schedule` under `strategy`; an unknown schedule is a ValueError."""
    if schedule not in SCHEDULE_FIELDS:
        raise ValueError(f"--schedule={schedule} is not a pipeline schedule; choose one of {', '.join(SCHEDULE_FIELDS)}.")
    return getattr(get(strategy), SCHEDULE_FIELDS[schedule])
