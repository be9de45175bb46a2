"""`pytest -m <strategy>`: a marker per declared strategy, on every test about it.

A test is about a strategy its name, its parameters (values and ids) or its module's name say:
`test_manual_fsdp_gathers_...`, `[manual-fsdp_tp]`, `test_ulysses.py`. Names are read as words
split at `_` and other non-alphanumerics, longest strategy first, so `fsdp_tp` is one strategy,
not fsdp and tp. A compound strategy's test is also marked with each strategy it composes (its
declaration's `composes`): `pytest -m fsdp` runs every proof that runs fsdp's code, fsdp_tp,
fsdp_cp, pp_fsdp, ... included; `-m "fsdp and not (fsdp_tp or fsdp_cp)"` narrows it. A test about
a strategy none of those name says so with @pytest.mark.<strategy>; tests/test_proofs.py fails
on a test whose body names a strategy it is not marked with.
"""

import functools
import re

import pytest

_WORD = re.compile(r"[A-Za-z0-9]+")
# "single_device" is the reference every twin is compared with, not a strategy named single
_NOT_A_STRATEGY = {("single", "device"), ("single", "devices")}


def declared() -> tuple[str, ...]:
    from twinshard.parallel import strategies  # stdlib imports only

    return strategies.NAMES


def composed(name: str) -> tuple[str, ...]:
    from twinshard.parallel import strategies

    return strategies.get(name).composes


@functools.cache
def _longest_first() -> list[tuple[str, ...]]:
    return sorted((tuple(n.split("_")) for n in declared()), key=len, reverse=True)


def named_in(text: str) -> set[str]:
    """The declared strategies `text` names: "test_pp_fsdp_ledger[manual-tp]" -> {pp_fsdp, tp}."""
    words, names = [w.lower() for w in _WORD.findall(text)], _longest_first()
    found, i = set(), 0
    while i < len(words):
        hit = next((n for n in names if tuple(words[i:i + len(n)]) == n
                    and tuple(words[i:i + 2]) not in _NOT_A_STRATEGY), None)
        if hit:
            found.add("_".join(hit))
        i += len(hit) if hit else 1
    return found


def param_words(item) -> set[str]:
    """The words of a test's parameter values ("manual fsdp" -> manual, fsdp; tuples and lists
    read through; a Strategy by its name)."""
    words: set[str] = set()

    def add(value):
        if isinstance(value, str):
            words.update(re.findall(r"\w+", value))
        elif isinstance(value, (tuple, list)):
            for v in value:
                add(v)
        elif type(value).__name__ == "Strategy":
            words.add(value.name)

    callspec = getattr(item, "callspec", None)
    for value in (callspec.params.values() if callspec else ()):
        add(value)
    return words


def named(item) -> set[str]:
    """The strategies a test names itself: by its function's name, its parameters (values and
    id: "[auto_fsdp_accum]") or @pytest.mark.<strategy>."""
    callspec = getattr(item, "callspec", None)
    marked = {m.name for m in item.iter_markers()} & set(declared())
    return (named_in(getattr(item, "originalname", item.name)) | (param_words(item) & set(declared()))
            | (named_in(callspec.id) if callspec else set()) | marked)


def about(item) -> set[str]:
    """Every strategy `item` is about: those it names, its module's name names, and what each composes."""
    direct = named(item) | named_in(item.path.stem)
    return direct | {part for name in direct for part in composed(name)}


NAMED = pytest.StashKey[frozenset]()  # item.stash[NAMED]: the strategies the test names (`named`)


def pytest_configure(config):
    for name in declared():
        config.addinivalue_line("markers", f"{name}: a proof of the {name} strategy (tests/harness/markers.py)")


def mark_strategies(items) -> None:
    """Marks each item with the strategies it is about; stashes those it names (tests/test_proofs.py
    counts a proof of S only where the test names S, not where it runs S as a part of another)."""
    for item in items:
        item.stash[NAMED] = frozenset(named(item))
        for name in sorted(about(item)):
            item.add_marker(getattr(pytest.mark, name))
