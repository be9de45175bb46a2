"""A frozen config dataclass's fields checked by their annotations ('int', 'float', 'bool', 'str'):
a bad value is a ValueError naming `ModelConfig.d_model`-style the field, the value and what is accepted."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any


def checked(where: str, value: Any, kind: str) -> Any:
    """`value` as the annotated type `kind` ('int', 'float', 'bool' or 'str'), or a ValueError."""
    got = f"{where}={value!r} ({type(value).__name__})"
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{got}: expected an int (a whole number such as 64, not a bool, "
                             "a float like 64.0 or a string).")
        return int(value)  # numpy integers become Python ints
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{got}: expected a finite number such as 1e-3 (an int or float, not a bool).")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"{got}: expected a finite number (not nan or inf).")
        return number
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{got}: expected True or False.")
        return value
    if kind == "str":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{got}: expected a non-empty string.")
        return value
    raise TypeError(f"{where}: no check for annotation {kind!r}")  # a new field needs a kind here


def check_types(config: Any) -> None:
    """Check (and normalise: numpy ints -> int, ints -> float) every field by its annotation."""
    cls = type(config).__name__
    for f in dataclasses.fields(config):  # annotations are strings: `from __future__ import annotations`
        value = checked(f"{cls}.{f.name}", getattr(config, f.name), str(f.type))
        object.__setattr__(config, f.name, value)
