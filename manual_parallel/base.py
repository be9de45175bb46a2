"""What every manual strategy shares: the placement rules it was built with."""

from __future__ import annotations

from typing import Callable, Mapping

from twinshard.parallelism import Parallelism


class ManualParallelism(Parallelism):
    """Single-device hooks plus the strategy's PARAM_RULES (logical -> mesh axis)."""

    def __init__(self, param_rules: Mapping[str, str]):
        self.param_rules = dict(param_rules)

    def remat(self, loss_fn: Callable) -> Callable:
        """How the loss is differentiated; FSDP re-gathers weights instead of saving them."""
        return loss_fn
