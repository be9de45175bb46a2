"""Taps on the ops that apply a parameter, to split a backward into its input and its weight gradient
(the zero-bubble pipeline's B and W: manual_parallel/pp_split.py).

Each such op is linear in its weight: layers.linear's matmul y = x W, rms_norm's gain y = x^ g, the
embedding lookup y = table[ids]. The layer math runs each through `tapped(op, a, w)`, `a` the op's
weight-free operand; outside a tape that is op(a, w). On a tape:

- `recording(probes)`: op(a, w) + the op's probe (zeros of y's shape), `a` recorded. jax.vjp with
  respect to the stage input and the probes is B: the input's gradient, and each probe's cotangent
  IS its op's output gradient dy; the params are not differentiated, so no weight gradient is formed.
  `recording()` without probes adds none and notes each y's shape (the probes to make).
- `replaying(inputs)`: op(a_k, w) on the recorded a_k, the live operand ignored, its output noted and
  handed on under stop_gradient. The noted outputs are linear in the weights with no path through
  the activations, so their vjp with the dy's is W: x^T dy per matrix, sum_rows(dy x^) per gain, a
  scatter-add for the table, and no input-gradient matmul.

Ops that share one operand (q, k, v on one normed input; w1 and w3) record it once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import jax

Array = jax.Array
Op = Callable[[Array, Array], Array]  # op(a, w): linear in w


@dataclass
class Tape:
    """What one traced segment (one block, the embedding, the head) records or replays, in op order.

    probes: recording, the probes to add (None: add none, note each output's shape in `outputs`);
    replay: replaying, the inputs recorded earlier (`inputs`) with `slots`, the input each op read."""

    probes: Sequence[Array] | None = None
    replay: Sequence[Array] | None = None
    slots: list[int] = field(default_factory=list)  # per op, its operand's index in `inputs`
    inputs: list[Array] = field(default_factory=list)  # the distinct operands recorded
    outputs: list = field(default_factory=list)  # per op: its output's ShapeDtypeStruct, or (replay) the output
    weights: list[Array] = field(default_factory=list)  # per op, its weight (how many distinct: `check`)

    def check(self, leaves: int, where: str) -> None:
        """Every parameter of the segment went through a tapped op (else W would miss its gradient)."""
        distinct = len({id(w) for w in self.weights})  # (the tape holds them: no id is reused)
        if distinct != leaves:
            raise NotImplementedError(f"{where}: {distinct} weights went through a tapped op "
                                      f"(twinshard/model/taps.py) of the {leaves} params: a weight used by "
                                      "another op would get no gradient from the split backward.")


_TAPES: list[Tape] = []


@contextlib.contextmanager
def recording(probes: Sequence[Array] | None = None) -> Iterator[Tape]:
    """Tap the ops traced inside (see the module docstring); the innermost tape wins."""
    tape = Tape(probes=probes)
    _TAPES.append(tape)
    try:
        yield tape
    finally:
        _TAPES.pop()


@contextlib.contextmanager
def replaying(inputs: Sequence[Array], slots: Sequence[int]) -> Iterator[Tape]:
    """Re-apply the ops traced inside to `inputs` (a recording's, slots: its `slots`)."""
    tape = Tape(replay=inputs, slots=list(slots))
    _TAPES.append(tape)
    try:
        yield tape
    finally:
        _TAPES.pop()


def tapped(op: Op, a: Array, w: Array) -> Array:
    """op(a, w), as the innermost tape (if any) wants it."""
    if not _TAPES:
        return op(a, w)
    tape = _TAPES[-1]
    k = len(tape.outputs)
    tape.weights.append(w)
    if tape.replay is not None:
        y = op(tape.replay[tape.slots[k]], w)
        tape.outputs.append(y)
        return jax.lax.stop_gradient(y)
    slot = next((j for j, seen in enumerate(tape.inputs) if seen is a), len(tape.inputs))
    if slot == len(tape.inputs):
        tape.inputs.append(a)
    tape.slots.append(slot)
    y = op(a, w)
    if tape.probes is None:
        tape.outputs.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
        return y
    tape.outputs.append(None)
    return y + tape.probes[k]
