"""The shard_map twin: the same strategies with every collective written out."""

from __future__ import annotations

import jax

from auto_parallel import resolve_mesh
from auto_parallel.tp_sp import check_collective_matmul
from manual_parallel import cp, dp, fsdp, fsdp_cp, fsdp_tp, pp, pp_fsdp, tp, tp_sp
from manual_parallel.runner import ManualRunner
from twinshard.config import Config

STRATEGIES = {"dp": dp, "fsdp": fsdp, "tp": tp, "fsdp_tp": fsdp_tp, "tp_sp": tp_sp}
PIPELINES = {"pp": pp, "pp_fsdp": pp_fsdp}  # on a `stage` axis (twinshard/pipeline.py)
CONTEXT = {"cp": cp, "fsdp_cp": fsdp_cp}  # the sequence over a `context` axis (ring attention)


def make_runner(strategy: str, mesh_spec: str | None, cfg: Config, devices=None) -> ManualRunner:
    n_devices = len(jax.devices() if devices is None else devices)  # None: jax.make_mesh orders them
    check_collective_matmul(strategy, "manual", cfg.model.collective_matmul)
    shape = resolve_mesh(strategy, mesh_spec, cfg, n_devices)
    if strategy in PIPELINES:
        return pp.PipelineRunner(strategy, PIPELINES[strategy], shape, cfg, devices)
    if strategy in CONTEXT:
        return CONTEXT[strategy].ContextRunner(strategy, CONTEXT[strategy], shape, cfg, devices)
    return ManualRunner(strategy, STRATEGIES[strategy], shape, cfg, devices)
