"""A setting the model reads while it is traced (which platform its kernels lower for, how its products
are quantized), set for the extent of a `with` block and nestable: the innermost wins."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class TraceSetting:
    """`with setting.using(value):` makes `setting.current()` return value until the block ends; outside
    every block it returns `default()`."""

    def __init__(self, default: Callable[[], str]):
        self._default = default
        self._stack: list[str] = []

    @contextlib.contextmanager
    def using(self, value: str) -> Iterator[None]:
        self._stack.append(value)
        try:
            yield
        finally:
            self._stack.pop()

    def current(self) -> str:
        return self._stack[-1] if self._stack else self._default()
