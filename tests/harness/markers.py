"""`pytest -m <strategy>`: a marker per declared strategy, on every test that names it."""

import re

_WORD = re.compile(r"\w+")


def declared() -> tuple[str, ...]:
    from twinshard.parallel import strategies  # stdlib imports only

    return strategies.NAMES


def param_words(item) -> set[str]:
    """The words of a test's parameter values ("manual fsdp" -> manual, fsdp; tuples and lists
    read through; a Strategy by its name)."""
    words: set[str] = set()

    def add(value):
        if isinstance(value, str):
            words.update(_WORD.findall(value))
        elif isinstance(value, (tuple, list)):
            for v in value:
                add(v)
        elif type(value).__name__ == "Strategy":
            words.add(value.name)

    callspec = getattr(item, "callspec", None)
    for value in (callspec.params.values() if callspec else ()):
        add(value)
    return words


def pytest_configure(config):
    for name in declared():
        config.addinivalue_line("markers", f"{name}: a proof of the {name} strategy (tests/harness/markers.py)")


def mark_strategies(items) -> None:
    """A test is marked with each declared strategy one of its parameters names; a test that
    proves a strategy it does not take as a parameter says so with @pytest.mark.<strategy>."""
    import pytest

    names = set(declared())
    for item in items:
        for name in sorted(param_words(item) & names):
            item.add_marker(getattr(pytest.mark, name))
