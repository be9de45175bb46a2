"""Pipeline parallelism (GPipe), GSPMD twin: the whole pipeline as ONE array
program over a stage dimension, sharded over `stage`; XLA turns the shift of
that dimension into collective-permutes.

The collectives and why: docs/pipelines.md (auto_parallel/pp.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from auto_parallel.runner import GSPMD
from twinshard.parallel import pipeline
from twinshard.parallel.pipeline import STAGE

class PipelineParallel(GSPMD):
    """GSPMD hooks plus the GPipe loop over a stage-sharded dimension."""

    def __init__(self, mesh: jax.sharding.Mesh, activation_rules, microbatches: int):
        super().__init__(mesh, activation_rules)
        self.microbatches = microbatches

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
        manual twin (pp: data = 1, rows [i B/M, (i+1) B/M)). `scan` runs a stage's L/S layers."""
        n, m = self.mesh.shape[STAGE], self.microbatches
        dp = self.mesh.shape[self.rules["batch"]] if "batch" in self.rules else 1
        b, t, d = x.shape[0] // m, x.shape[1], x.shape[2]
        # [B, T, D] -> [data, M, B/(data M), T, D] -> [M, B/M, T, D]: each data shard's rows split into M
        micro = x.reshape(dp, m, b // dp, t, d).swapaxes(0, 1).reshape(m, b, t, d)
        stages = jax.tree.map(lambda w: self._per_stage(w.reshape(n, -1, *w.shape[1:])), stacked)  # [S, L/S, ...]
        # each device: its row; spmd_axis_name keeps `stage` on the vmapped dim of the hooks' constraints
        # (a weight pinned whole over data, the residual stream's rows over data) inside a stage
        stage = self  # a stage's layers run with these hooks (pp_fsdp: FSDP's weight pin); not layer_stack
        run_stages = jax.vmap(lambda w, h: scan(w, cfg, h, stage), spmd_axis_name=STAGE)
        row = lambda k: (jnp.arange(n) == k).reshape(n, 1, 1, 1, 1)  # noqa: E731  [S, 1, 1, 1, 1]
        inject = self._per_stage(jnp.zeros((n, m, b, t, d), x.dtype).at[0].set(micro), 2)

        def tick(carry, i):
            state, finished = carry  # [S, B/M, T, D], [S, M, B/M, T, D]
            fresh = lax.dynamic_index_in_dim(inject, jnp.minimum(i, m - 1), 1, keepdims=False)
            state = self._per_stage(jnp.where(row(0)[:, 0], fresh, state), 1)
            out = self._per_stage(run_stages(stages, state), 1)
            j = i - (n - 1)  # the micro-batch that leaves the last stage at tick i
            done = lax.dynamic_update_index_in_dim(finished, out[:, None], jnp.maximum(j, 0), 1)
            finished = self._per_stage(jnp.where(row(n - 1) & (j >= 0), done, finished), 2)
            return (self._per_stage(jnp.roll(out, 1, axis=0), 1), finished), None  # stage s -> s+1

        start = (self._per_stage(jnp.zeros((n, b, t, d), x.dtype), 1), jnp.zeros_like(inject))
        (_, finished), _ = lax.scan(tick, start, jnp.arange(pipeline.ticks(m, n)))
        return finished[n - 1].reshape(m, dp, b // dp, t, d).swapaxes(0, 1).reshape(m * b, t, d)


def parallelism(mesh, run) -> PipelineParallel:
    return PipelineParallel(mesh, run.placed.activations, run.cfg.train.microbatches)
