"""FSDP (ZeRO-3), GSPMD twin: every weight's d_model dimension sharded over `data`, the batch
split over `data`.

The collectives and why: docs/memory.md (auto_parallel/fsdp.py)."""

import jax
from jax.sharding import NamedSharding

from auto_parallel.runner import GSPMD
from twinshard.parallel import placement

__all__ = ["FullyShardedDataParallel", "parallelism"]


class FullyShardedDataParallel(GSPMD):
    AXIS = "data"  # the mesh axis the weights are sharded over (hsdp: fsdp, inside a slice)

    def weight(self, w, axes):
        """W1 [D/data, F] -> pinned whole [D, F]: the all-gather, and its gradient's reduce-scatter.

        Without this pin GSPMD gathered the token ids instead of the embedding table (measured, JAX 0.12)."""
        return self.constrain(w, axes)

    def gather_step(self, params, axes, specs, dtype):
        """Every matrix sharded over `data` pinned whole in the compute dtype, once per step.

        The bf16 copy is pinned to the shard's layout first: without it GSPMD gathered the f32 master
        shard and cast after it on XLA:CPU, twice the bytes (measured, JAX 0.12)."""
        def gather(w, ax, s):
            if self.AXIS not in placement.sharded_axes(s):
                return w
            return self.weight(jax.lax.with_sharding_constraint(w.astype(dtype), NamedSharding(self.mesh, s)), ax)
        return jax.tree.map(gather, params, axes, specs)


def parallelism(mesh, run) -> FullyShardedDataParallel:
    return FullyShardedDataParallel(mesh, run.placed.activations)
