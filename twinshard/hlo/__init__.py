"""The collective ledger of a compiled XLA program, and the HLO reading behind it.

`ledger(compiled, mesh)` lists every collective of a compiled program (docs/hlo-assertions.md);
`schedule(compiled, mesh)` says when each runs in the compiled schedule, and `predict(compiled, chip,
mesh, links)` what a step costs and which communication compute hides (docs/schedule.md).
Modules, each importing only those before it: parse, groups, loops, records, schedule, timing.
"""

from twinshard.hlo.groups import (MeshSpec, Shift, classify, decode_replica_groups, describe_permute,
                                  mesh_spec, ring_step, shift_pairs, shift_pattern)
from twinshard.hlo.parse import OPS
from twinshard.hlo.records import Collective, Ledger, NotCompiledHLO, ledger, ring_bytes
from twinshard.hlo.schedule import Schedule, Sequence, Window, schedule
from twinshard.hlo.timing import AxisTime, CollectiveTime, OpTime, Prediction, predict

__all__ = [
    "OPS", "AxisTime", "Collective", "CollectiveTime", "Ledger", "MeshSpec", "NotCompiledHLO", "OpTime",
    "Prediction", "Schedule", "Sequence", "Shift", "Window", "classify", "decode_replica_groups",
    "describe_permute", "ledger", "mesh_spec", "predict", "ring_bytes", "ring_step", "schedule",
    "shift_pairs", "shift_pattern",
]
