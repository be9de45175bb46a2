"""A compiled program's predicted step on a named chip: twinshard.hlo.timing's reader priced at the
chip table's peaks, the measured efficiencies and the links of the topology's mesh axes.

    pred = predict_step(compiled, "v5e", mesh, axis_links(topology, mesh))
    print(pred.table())
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinshard.hardware.chips import Chip, Efficiency, chip as chip_named, efficiency as measured, matmul_peak_flops
from twinshard.hardware.links import Link, collective_seconds
from twinshard.hlo.timing import Prediction, Rates, predict


def rates(chip: Chip | str, efficiency: Efficiency | None = None) -> Rates:
    """`chip`'s peaks with `efficiency` (default: the measured EFFICIENCIES, else the peaks)."""
    chip = chip_named(chip) if isinstance(chip, str) else chip
    eff = efficiency or measured(chip)
    return Rates(chip.name, {d: matmul_peak_flops(chip, d)[0] for d in ("bfloat16", "float32", "int8")},
                 chip.hbm_bytes_per_s, eff.matmul_efficiency, eff.hbm_efficiency, eff.splash_efficiency,
                 eff.splash_by_head_dim, eff.source)


def predict_step(compiled_or_hlo_text: Any, chip: Chip | str, mesh: Any = None,
                 links: Mapping[str, Link] | None = None, efficiency: Efficiency | None = None,
                 causal_attention: bool = True) -> Prediction:
    """twinshard.hlo.predict on `chip` (a Chip or a name: 'v5e'); links: mesh axis -> Link for every
    axis a collective crosses (`links.axis_links(topology, mesh)`)."""
    known = dict(links or {})
    return predict(compiled_or_hlo_text, rates(chip, efficiency), mesh,
                   lambda op, axes, ring_bytes: collective_seconds(op, axes, ring_bytes, known), causal_attention)
