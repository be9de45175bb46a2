"""HSDP (hybrid sharded data parallelism), shard_map twin: FSDP inside each slice, data parallelism
across slices. Mesh data x fsdp: `data` steps from slice to slice (over DCN, --dcn_mesh=data:N),
`fsdp` stays inside one (ICI).

Per step, for a matrix W [D, F] held as W [D/fsdp, F] (replicated over data), all in hsdp_gather
(manual_parallel/collectives.py), once per use (per layer, inside the scanned layer loop):

    forward    all_gather over fsdp             W [D/fsdp, F] -> [D, F]      inside the slice
    backward   all_gather over fsdp (re-gather)                              inside the slice
               psum_scatter over fsdp / fsdp    dW [D, F] -> dW [D/fsdp, F]  inside the slice
               pmean over data                  dW [D/fsdp, F]               across slices (DCN)

so the gradient reduction is hierarchical: a reduce-scatter inside the slice, then an all-reduce of
the 1/fsdp shard across slices, issued in the backward right after that layer's reduce-scatter (it
can run behind the backward of the layers below). The norm gains (replicated) are averaged inside
the slice first, then across, after the backward. No weight and no activation crosses DCN; the only
other traffic across slices is the loss's scalar mean (a metric). Each device reads B/(data fsdp)
sequences."""

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from manual_parallel.collectives import hsdp_gather
from manual_parallel.fsdp import FullyShardedDataParallel
from manual_parallel.runner import ManualRunner
from twinshard.parallel.placement import sharded_axes

__all__ = ["HybridShardedDataParallel", "Runner", "parallelism"]

DCN_AXIS, SLICE_AXIS = "data", "fsdp"


class HybridShardedDataParallel(FullyShardedDataParallel):
    """FSDP's hooks (gather before use, re-gather in the backward) over `fsdp`, the axis inside a slice;
    each gathered weight's gradient also averaged across slices in its backward (hsdp_gather)."""

    AXIS = SLICE_AXIS

    def gather_weight(self, w, dim: int):
        """W [D/fsdp, F] (invariant over data) -> [D, F] varying over data; backward: dW [D/fsdp, F], the
        mean over this slice's tokens (fsdp) and then over the slices' (data)."""
        return hsdp_gather(w, SLICE_AXIS, dim, DCN_AXIS)


class Runner(ManualRunner):
    """The tokens split over data x fsdp; each gradient's mean over them runs inside the slice first."""

    TOKEN_AXES = (DCN_AXIS, SLICE_AXIS)

    def __init__(self, run, parallelism):
        super().__init__(run, parallelism)
        # A matrix (sharded over fsdp) enters the step invariant over data: hsdp_gather's backward has
        # already averaged its gradient across slices, so neither a pcast before nor a pmean after it.
        self.replicated_over_tokens = jax.tree.map(
            lambda s, axes: tuple(a for a in axes if a != DCN_AXIS) if SLICE_AXIS in sharded_axes(s) else axes,
            self.param_specs, self.replicated_over_tokens, is_leaf=lambda x: isinstance(x, P))

    def mean_over_tokens(self, grads, replicated):
        """The mean over the token axes a param is replicated over, innermost first: a matrix's
        [D/fsdp, F] shard needs none (hsdp_gather's backward averaged it over fsdp, then data);
        a norm gain [D] pmean over fsdp, then over data. One all-reduce over both would send the
        slice's every gain across DCN in a ring over all devices (the ledger's data,fsdp row)."""
        def sync(g, axes):
            for axis in sorted(axes, key=(SLICE_AXIS, DCN_AXIS).index):  # fsdp (ICI), then data (DCN)
                g = lax.pmean(g, axis)
            return g
        return jax.tree.map(sync, grads, replicated)


def parallelism(mesh, run) -> HybridShardedDataParallel:
    return HybridShardedDataParallel(run.placed.params)
