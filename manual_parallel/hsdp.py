"""HSDP (hybrid sharded data parallelism), shard_map twin: FSDP inside each slice, data parallelism
across slices. Mesh data x fsdp: `data` steps from slice to slice (over DCN, --dcn_mesh=data:N),
`fsdp` stays inside one (ICI).

Per step, for a matrix W [D, F] held as W [D/fsdp, F] (replicated over data):

    forward    all_gather over fsdp             W [D/fsdp, F] -> [D, F]      inside the slice
    backward   all_gather over fsdp (re-gather)                              inside the slice
               psum_scatter over fsdp / fsdp    dW [D, F] -> dW [D/fsdp, F]  inside the slice
               pmean over data                  dW [D/fsdp, F], f32          across slices (DCN)

so the gradient reduction is hierarchical: a reduce-scatter inside the slice, then an all-reduce of
the 1/fsdp shard across slices. The norm gains (replicated) are averaged inside the slice first,
then across. No weight and no activation crosses DCN; the only other traffic across slices is the
loss's scalar mean (a metric). Each device reads B/(data fsdp) sequences."""

import jax
from jax import lax

from manual_parallel.fsdp import FullyShardedDataParallel
from manual_parallel.runner import ManualRunner

__all__ = ["HybridShardedDataParallel", "Runner", "parallelism"]

DCN_AXIS, SLICE_AXIS = "data", "fsdp"


class HybridShardedDataParallel(FullyShardedDataParallel):
    """FSDP's hooks (gather before use, re-gather in the backward) over `fsdp`, the axis inside a slice."""

    AXIS = SLICE_AXIS


class Runner(ManualRunner):
    """The tokens split over data x fsdp; each gradient's mean over them runs inside the slice first."""

    TOKEN_AXES = (DCN_AXIS, SLICE_AXIS)

    def mean_over_tokens(self, grads, replicated):
        """The mean over the token axes a param is replicated over, innermost first: a matrix's
        [D/fsdp, F] shard (already the slice's mean: fsdp_gather's backward) pmean over data alone;
        a norm gain [D] pmean over fsdp, then over data. One all-reduce over both would send the
        slice's every gain across DCN in a ring over all devices (the ledger's data,fsdp row)."""
        def sync(g, axes):
            for axis in sorted(axes, key=(SLICE_AXIS, DCN_AXIS).index):  # fsdp (ICI), then data (DCN)
                g = lax.pmean(g, axis)
            return g
        return jax.tree.map(sync, grads, replicated)


def parallelism(mesh, run) -> HybridShardedDataParallel:
    return HybridShardedDataParallel(run.placed.params)
