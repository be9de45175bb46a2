"""Expert parallelism, GSPMD twin: the experts split over `expert`, the batch over
(data, expert); the dense weights and the router replicated.

The collectives and why: docs/experts.md (auto_parallel/ep.py)."""

from auto_parallel.runner import GSPMD

__all__ = ["ExpertParallel", "parallelism"]

ROUTED = (None, "batch", None, None)  # [E, G, C, D]: the groups where their tokens are
AT_EXPERTS = ("experts", "expert_groups", None, None)  # E over expert, G over data


class ExpertParallel(GSPMD):
    def dispatch(self, x):
        """x [E, G, C, D] (G over data x expert) -> E over expert, G over data."""
        return self.constrain(self.constrain(x, ROUTED), AT_EXPERTS)

    def combine(self, x):
        """x [E, G, C, D] (E over expert, G over data) -> G over data x expert."""
        return self.constrain(self.constrain(x, AT_EXPERTS), ROUTED)


def parallelism(mesh, run) -> ExpertParallel:
    return ExpertParallel(mesh, run.placed.activations)
