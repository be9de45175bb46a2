"""HSDP (hybrid sharded data parallelism), GSPMD twin: every weight's d_model dimension sharded over
`fsdp` (inside a slice) and replicated over `data` (across slices, over DCN); the batch split over
both. The manual twin's program (manual_parallel/hsdp.py) from shardings: each slice's gradient
reduced to its fsdp shard inside the slice, then the shards averaged across slices.

Measured (JAX 0.12, XLA:CPU): with the shardings alone GSPMD all-reduced every whole gradient over
data x fsdp at once, sending fsdp times the shard's bytes across DCN; so the step runs one gradient
per slice in a vmap over `data` (spmd_axis_name), each pinned to its fsdp shard inside the vmap,
and their mean over the vmapped axis is the one collective across slices."""

import copy
import functools

import jax
import jax.numpy as jnp

from auto_parallel.fsdp import FullyShardedDataParallel
from auto_parallel.runner import AutoRunner
from twinshard.train.trainer import accumulated_value_and_grad, loss_fn

__all__ = ["HybridShardedDataParallel", "Runner", "parallelism"]

DCN_AXIS, SLICE_AXIS = "data", "fsdp"


class HybridShardedDataParallel(FullyShardedDataParallel):
    """FSDP's pins (each matrix whole where it is used, once per step under grad_accum) over `fsdp`."""

    AXIS = SLICE_AXIS

    def inside_slice(self) -> "HybridShardedDataParallel":
        """These hooks for one slice's batch, in the vmap over `data`: the batch split over fsdp alone."""
        hooks = copy.copy(self)
        hooks.rules = {**self.rules, "batch": SLICE_AXIS}
        return hooks


class Runner(AutoRunner):
    """(loss, gradients) per slice in a vmap over `data`, then their mean: the all-reduce across slices."""

    def __init__(self, run, parallelism, tx=None):
        super().__init__(run, parallelism, tx)
        self.slice_loss = functools.partial(loss_fn, cfg=run.cfg.model, par=self.par.inside_slice())

    def _loss_and_grads(self, params, x, y):
        """x, y [B, T] -> [data, B/data, T]; per slice: its loss and gradient, pinned to the params'
        sharding ([D/fsdp, F]: reduced over fsdp inside the slice); mean over data: across slices."""
        d, k = self.sizes[DCN_AXIS], self.cfg.train.grad_accum
        slices = lambda a: a.reshape(d, a.shape[0] // d, *a.shape[1:])  # noqa: E731

        def one_slice(xs, ys):
            loss, grads = accumulated_value_and_grad(self.slice_loss, params, xs, ys, k,
                                                    sum_dtype=self.cfg.train.grad_accum_dtype)
            return loss, jax.tree.map(jax.lax.with_sharding_constraint, grads, self.state_shardings.params)

        losses, grads = jax.vmap(one_slice, spmd_axis_name=DCN_AXIS)(slices(x), slices(y))  # [data], [data, *shard]
        grads = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(jnp.mean(g, axis=0), s),
                             grads, self.state_shardings.params)
        return jnp.mean(losses), grads


def parallelism(mesh, run) -> HybridShardedDataParallel:
    return HybridShardedDataParallel(mesh, run.placed.activations)
