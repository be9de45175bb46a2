"""The shard_map twin: each strategy's placement (twinshard/parallel/strategies.py) with every collective
written out. `manual_parallel/<name>.py` holds a strategy's hooks and collectives
(manual_parallel/collectives.py: the conjugate pairs, forward and backward)."""

from __future__ import annotations

import importlib

from manual_parallel.runner import ManualRunner
from twinshard.config import Config
from twinshard.parallel import resolve, support

RUNNER = ManualRunner  # a strategy module's `Runner` replaces it
MODULES = {name: importlib.import_module(f"manual_parallel.{name}") for name in support.written_by("manual")}


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None) -> ManualRunner:
    """The shard_map runner of `strategy` on `mesh_spec` (None: the strategy's default mesh)."""
    return resolve.make_runner(resolve.resolve_run(strategy, "manual", mesh_spec, cfg, devices))
