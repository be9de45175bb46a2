"""The collective ledger of a compiled XLA program, and the HLO reading behind it.

`ledger(compiled, mesh)` lists every collective of a compiled program (docs/hlo-assertions.md).
Modules, each importing only those before it: parse, groups, loops, records. Nothing here imports
the rest of twinshard: with twinshard.testing it installs alone (twinshard-hlo: jax and numpy).
"""

from twinshard.hlo.groups import (MeshSpec, Shift, classify, decode_replica_groups, describe_permute,
                                  mesh_spec, ring_step, shift_pairs, shift_pattern)
from twinshard.hlo.parse import OPS
from twinshard.hlo.records import PHASES, REDUCTIONS, Collective, Ledger, NotCompiledHLO, ledger, ring_bytes

__all__ = [
    "OPS", "PHASES", "REDUCTIONS", "Collective", "Ledger", "MeshSpec", "NotCompiledHLO", "Shift", "classify",
    "decode_replica_groups", "describe_permute", "ledger", "mesh_spec", "ring_bytes", "ring_step",
    "shift_pairs", "shift_pattern",
]
