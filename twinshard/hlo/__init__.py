"""The collective ledger of a compiled XLA program, and the HLO reading behind it.

`ledger(compiled, mesh)` lists every collective of a compiled program (docs/hlo-assertions.md);
`schedule(compiled, mesh)` says when each runs in the compiled schedule, and `predict(compiled, rates,
mesh, link_seconds)` what a step costs and which communication compute hides (docs/schedule.md).
Modules, each importing only those before it: parse, matmul_flops, groups, loops, records, schedule, timing, draw,
evaluate, pipeline_ticks (a pipeline step's ticks x stages read from the program), draw_pipeline.
Nothing here imports the rest of twinshard: with twinshard.testing it installs alone (twinshard-hlo:
jax and numpy); a chip's rates and links come from twinshard.hardware (`twinshard.hardware.step_time.predict_step`).
"""

from twinshard.hlo.groups import (MeshSpec, Shift, classify, decode_replica_groups, describe_permute,
                                  mesh_spec, ring_step, shift_pairs, shift_pattern)
from twinshard.hlo.parse import OPS
from twinshard.hlo.records import PHASES, REDUCTIONS, Collective, Ledger, NotCompiledHLO, ledger, ring_bytes
from twinshard.hlo.schedule import Schedule, Sequence, Window, schedule
from twinshard.hlo.timing import AxisTime, CollectiveTime, OpTime, Prediction, Rates, predict

__all__ = [
    "OPS", "PHASES", "REDUCTIONS", "AxisTime", "Collective", "CollectiveTime", "Ledger", "MeshSpec",
    "NotCompiledHLO", "OpTime", "Prediction", "Rates", "Schedule", "Sequence", "Shift", "Window", "classify",
    "decode_replica_groups", "describe_permute", "ledger", "mesh_spec", "predict", "ring_bytes", "ring_step",
    "schedule",
    "shift_pairs", "shift_pattern",
]
