"""Pipeline parallelism: what both twins share (the schedule, the mesh, the checks).

The L stacked blocks are split into S contiguous stages of L/S layers (`layers -> stage`), the
batch into M micro-batches of B/M. GPipe runs M + S - 1 ticks; at tick i stage s runs micro-batch
i - s (a bubble otherwise) and hands [B/M, T, D] to the next stage; autodiff hands gradients back.

    tick  0    1    2    3    4    5    6          S = 4 stages, M = 4 micro-batches
    s=0   m0   m1   m2   m3   .    .    .          '.' = bubble: (S-1)/(M+S-1) of the
    s=1   .    m0   m1   m2   m3   .    .          stage-ticks do no useful work
    s=2   .    .    m0   m1   m2   m3   .
    s=3   .    .    .    m0   m1   m2   m3   -> loss of m_j at tick j + S - 1

Embedding, ln_final and lm_head are replicated over `stage` (a shard_map program is the same on
every device); the manual twin sums their gradients over `stage`. pp_fsdp adds FSDP over `data`
inside each stage. More in docs/pipelines.md.
"""

from __future__ import annotations

from twinshard.config import PIPELINE_SCHEDULES as SCHEDULES  # noqa: F401  ("gpipe", "1f1b")

STAGE = "stage"
IDLE, FORWARD, BACKWARD = 0, 1, 2  # what a stage does in one tick of the 1F1B table


def ticks(microbatches: int, stages: int) -> int:
    """Iterations of the GPipe loop: the last micro-batch leaves the last stage at M + S - 2."""
    return microbatches + stages - 1


def bubble_fraction(microbatches: int, stages: int) -> float:
    """(S - 1) / (M + S - 1): the share of stage-ticks that are bubbles."""
    return (stages - 1) / ticks(microbatches, stages)


def check(num_layers: int, batch: int, stages: int, microbatches: int, grad_accum: int = 1,
          data: int = 1) -> None:
    """L splits into S stages, the batch (pp_fsdp: each data shard's) into M >= S micro-batches, or ValueError."""
    if grad_accum != 1:
        raise ValueError(f"grad_accum={grad_accum}: a pipeline already accumulates the gradients of its "
                         "micro-batches; use --microbatches instead and leave --grad_accum at 1.")
    if stages < 2:
        raise ValueError(f"pipeline parallelism needs stage >= 2, got stage={stages}; use --mesh=stage:2 "
                         "or more (stage:1 is single-device training).")
    if num_layers % stages:
        fits = [s for s in range(2, num_layers + 1) if num_layers % s == 0]
        raise ValueError(f"num_layers={num_layers} does not split into stage={stages} equal stages; "
                         f"choose stage from {fits} (e.g. --mesh=stage:{fits[0]} --devices={fits[0]}) or change "
                         "num_layers.")
    if microbatches < stages:
        raise ValueError(f"microbatches={microbatches} < stage={stages}: a pipeline of {stages} stages needs "
                         f"at least {stages} micro-batches to fill (pass --microbatches={stages} or more).")
    if batch % (data * microbatches):  # (data = 1: pp, the whole batch into M)
        fits = [m for m in range(stages, batch // data + 1) if batch % (data * m) == 0]
        split = f"data={data} x microbatches={microbatches}" if data > 1 else f"microbatches={microbatches}"
        rows = " (each data shard's B/data rows into M)" if data > 1 else ""
        raise ValueError(f"batch={batch} does not split into {split} equal micro-batches{rows}; choose microbatches "
                         f"from {fits} or a --batch_size that is a multiple of {data * microbatches}.")


def one_f_one_b(microbatches: int, stages: int) -> tuple[list[list[int]], list[list[int]]]:
    """The 1F1B (PipeDream-flush) schedule as two [ticks][stages] tables: the op (IDLE, FORWARD,
    BACKWARD) and its micro-batch. Stage s runs S-1-s warm-up forwards, then alternates, each op at
    the first tick its input has arrived, so it holds at most S - s micro-batches whatever M is:

        M=4, S=2   tick:  0   1   2   3   4   5   6   7   8   9
              stage 0:    F0  F1  .   B0  F2  B1  F3  B2  .   B3
              stage 1:    .   F0  B0  F1  B1  F2  B2  F3  B3  .
    """
    order = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        ops, f, b = [(FORWARD, i) for i in range(warmup)], warmup, 0
        while f < microbatches or b < microbatches:
            if f < microbatches:
                ops.append((FORWARD, f))
                f += 1
            if b < microbatches:
                ops.append((BACKWARD, b))
                b += 1
        order.append(ops)
    done: dict[tuple[int, int, int], int] = {}
    kinds, mbs, nxt, t = [], [], [0] * stages, 0
    while any(nxt[s] < len(order[s]) for s in range(stages)):
        row = [(IDLE, 0)] * stages
        for s in range(stages):
            if nxt[s] == len(order[s]):
                continue
            kind, i = order[s][nxt[s]]
            after = (FORWARD, s - 1, i) if kind == FORWARD else \
                (FORWARD, s, i) if s == stages - 1 else (BACKWARD, s + 1, i)
            if (kind == FORWARD and s == 0) or done.get(after, t) < t:
                row[s] = (kind, i)
        for s, (kind, i) in enumerate(row):
            if kind != IDLE:
                done[(kind, s, i)] = t
                nxt[s] += 1
        kinds.append([k for k, _ in row])
        mbs.append([i for _, i in row])
        t += 1
    return kinds, mbs
