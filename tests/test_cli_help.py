"""Every launcher's --help lists the flags a user sets for it, the shared ones included (absl's
own --help lists only the flags defined in the main module), and exits 0; --helpfull keeps
absl's own flags too. Nothing compiles: each command only parses its flags."""

from __future__ import annotations

import re

import pytest

from cli import run

LAUNCHERS = ["launch.train", "launch.bench", "launch.collectives", "launch.compare", "launch.plan",
             "launch.sample", "launch.tokenize", "tools.step_profile", "tools.chip_micro"]
# a few flags each launcher must list, shared (launch/common.py) and its own
SOME = {"launch.train": ["preset", "strategy", "impl", "mesh", "dcn_mesh", "workdir", "debug"],
        "launch.bench": ["preset", "strategies", "impls", "json", "dcn_mesh"],
        "launch.collectives": ["preset", "strategy", "impl", "mesh", "dcn_mesh", "topology", "debug"],
        "launch.compare": ["strategy", "impl", "plot", "dcn_mesh"],
        "launch.plan": ["preset"],
        "launch.sample": ["workdir"],
        "launch.tokenize": ["input", "out", "tokenizer"],
        "tools.step_profile": ["preset", "strategy"],
        "tools.chip_micro": ["json", "small", "reps", "parts"]}


def _flags(text: str, modules: str = r".*") -> set[str]:
    """Flag names listed in absl help text under the module headings matching `modules`."""
    names, keep = set(), False
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            keep = re.fullmatch(modules, line[:-1]) is not None
        elif keep and (m := re.match(r"^  --(?:\[no\])?(\w+)", line)):
            names.add(m.group(1))
    return names


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_help_lists_the_launchers_flags_and_exits_0(launcher: str) -> None:
    short = run("-m", launcher, "--help")
    full = run("-m", launcher, "--helpfull")
    assert short.returncode == 0 and full.returncode == 0, (short.stderr[-2000:], full.stderr[-2000:])
    listed = _flags(short.stdout)
    ours = _flags(full.stdout, r"/.*|(launch|twinshard|tools)\..*")  # the project's (not absl's, orbax's)
    assert set(SOME[launcher]) <= listed, (launcher, sorted(set(SOME[launcher]) - listed))
    assert ours == listed, (launcher, sorted(ours - listed), sorted(listed - ours))
    assert "logtostderr" in _flags(full.stdout) and "logtostderr" not in listed
