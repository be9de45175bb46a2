"""Which dims Adafactor factors: shape arithmetic read by the optimizer (train/optim.py) and by
the memory model (cost/memory.py), which must not import the trainer."""

from __future__ import annotations

import numpy as np

MIN_DIM_SIZE_TO_FACTOR = 128  # optax.adafactor's default: smaller params keep a full `v`


def factored_dims(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(d1, d0): the dims Adafactor factors - the second largest and the largest, ordered as
    np.argsort orders ties (optax's rule) - or None when the param has < 2 dims or its second
    largest is < MIN_DIM_SIZE_TO_FACTOR. A stacked [L, D, F] block param factors (D, F), or L
    and F once L > D."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < MIN_DIM_SIZE_TO_FACTOR:
        return None
    return int(order[-2]), int(order[-1])
