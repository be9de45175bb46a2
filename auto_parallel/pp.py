"""Pipeline parallelism (GPipe, and interleaved as MaxText's circular pipeline), GSPMD twin: the
whole pipeline as ONE array program over a stage dimension, sharded over `stage`; XLA turns the
shift of that dimension into collective-permutes. --virtual_stages=V > 1 runs each micro-batch
round the stages V times, through each device's V chunks (stored round-robin:
twinshard/parallel/round_robin.py, the state's order in every runner, twinshard/placed.py).

The collectives and why: docs/pipelines.md (auto_parallel/pp.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from auto_parallel.runner import GSPMD
from twinshard.parallel.pipeline import STAGE


class PipelineParallel(GSPMD):
    """GSPMD hooks plus the circular loop over a stage-sharded dimension (V = 1: GPipe)."""

    def __init__(self, mesh: jax.sharding.Mesh, activation_rules, microbatches: int, virtual: int = 1):
        super().__init__(mesh, activation_rules)
        self.microbatches, self.virtual = microbatches, virtual

    def _per_stage(self, a, batch_dim: int | None = None):
        """Pin dim 0 (the stage dim) to the `stage` axis, and `batch_dim` (rows of a micro-batch)
        to the batch's axis (pp_fsdp: `data`; pp: none)."""
        dims = [STAGE] + [None] * (a.ndim - 1)
        if batch_dim is not None:
            dims[batch_dim] = self.rules.get("batch")
        return lax.with_sharding_constraint(a, NamedSharding(self.mesh, P(*dims)))

    def layer_stack(self, stacked, cfg, x, scan):
        """x: [B, T, D] (pp: replicated; pp_fsdp: rows over data) -> the blocks' output [B, T, D].

        Micro-batch i is rows [i B/(data M), (i+1) B/(data M)) of every data shard, as in the
        manual twin (pp: data = 1, rows [i B/M, (i+1) B/M)). `scan` runs one chunk's layers.

        MaxText's circular pipeline: V M + S - 1 ticks (V = 1: GPipe's M + S - 1). In tick k every
        stage s runs its op number k - s, micro-batch (k - s) % M on its local chunk (k - s) // M,
        then the stage buffer rolls one stage on, S-1 round to 0 (a collective-permute; backward its
        transpose). Stage 0 reads its input from a queue of M slots on its own row: slot i holds
        micro-batch i, then what the last stage sent back of it, so after the last tick the queue
        holds the output of every micro-batch. Ops with k - s outside [0, V M) are the bubble:
        their results reach no slot and no loss. M >= S (pipeline.check), so an output waits in
        its slot until stage 0 reads it (M - S ticks), never overwritten before."""
        n, m, v = self.mesh.shape[STAGE], self.microbatches, self.virtual
        dp = self.mesh.shape[self.rules["batch"]] if "batch" in self.rules else 1
        b, t, d = x.shape[0] // m, x.shape[1], x.shape[2]
        # [B, T, D] -> [data, M, B/(data M), T, D] -> [M, B/M, T, D]: each data shard's rows split into M
        micro = x.reshape(dp, m, b // dp, t, d).swapaxes(0, 1).reshape(m, b, t, d)
        # [L, ...] stored device-major (twinshard/parallel/round_robin.py) -> [S, V, L/(S V), ...]
        chunks = jax.tree.map(lambda w: self._per_stage(w.reshape(n, v, -1, *w.shape[1:])), stacked)
        row = lambda k: (jnp.arange(n) == k).reshape(n, 1, 1, 1, 1)  # noqa: E731  [S, 1, 1, 1, 1]
        run_stages = self._stage_runner(scan, cfg)
        queue = self._per_stage(jnp.zeros((n, m, b, t, d), x.dtype).at[0].set(micro), 2)  # [S, M, B/M, T, D]

        def tick(carry, k):
            state, queue = carry  # [S, B/M, T, D], [S, M, B/M, T, D] (row 0 is stage 0's queue)
            head = lax.dynamic_index_in_dim(queue, k % m, 1, keepdims=False)
            state = self._per_stage(jnp.where(row(0)[:, 0], head, state), 1)
            local = jnp.clip((k - jnp.arange(n)) // m, 0, v - 1)  # [S]: each stage's local chunk
            out = self._per_stage(run_stages(chunks, local, state), 1)
            state = self._per_stage(jnp.roll(out, 1, axis=0), 1)  # stage s -> s+1, S-1 -> 0
            j = k - (n - 1)  # the last stage's op of this tick, now at stage 0: micro-batch j % M
            arrived = lax.dynamic_update_index_in_dim(queue, state[:, None], j % m, 1)
            return (state, self._per_stage(jnp.where(row(0) & (j >= 0), arrived, queue), 2)), None

        start = (self._per_stage(jnp.zeros((n, b, t, d), x.dtype), 1), queue)
        (_, queue), _ = lax.scan(tick, start, jnp.arange(v * m + n - 1))
        return queue[0].reshape(m, dp, b // dp, t, d).swapaxes(0, 1).reshape(m * b, t, d)

    def _stage_runner(self, scan, cfg):
        """(chunks [S, V, L/(S V), ...], local [S], h [S, B/M, T, D]) -> [S, B/M, T, D]: stage s runs
        its chunk local[s] on h[s], under vmap over the stage-sharded dim (each device its row).
        spmd_axis_name keeps `stage` on the vmapped dim of the hooks' constraints inside a stage
        (a weight pinned whole over data, the residual stream's rows over data)."""
        stage = self  # a stage's layers run with these hooks (pp_fsdp: FSDP's weight pin); not layer_stack
        if self.virtual == 1:  # GPipe: the one chunk, no index
            return jax.vmap(lambda w, _, h: scan(jax.tree.map(lambda a: a[0], w), cfg, h, stage), spmd_axis_name=STAGE)
        pick = lambda w, c: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, c, 0, keepdims=False), w)  # noqa: E731
        return jax.vmap(lambda w, c, h: scan(pick(w, c), cfg, h, stage), spmd_axis_name=STAGE)


def parallelism(mesh, run) -> PipelineParallel:
    return PipelineParallel(mesh, run.placed.activations, run.cfg.train.microbatches, run.cfg.train.virtual_stages)
