"""tools/same_programs.py --compare: equal runs pass, any difference in losses, temporaries or
ledger (or a run on one side only) fails with exit status 1."""

from __future__ import annotations

import copy
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))

import same_programs  # noqa: E402  (tools/ is not a package)

RUN = {"fsdp/manual": {"losses": [(5.75).hex(), (5.5).hex()], "temp": 807744,
                       "ledger": {"all-gather data": [31, 123456]}}}


def test_equal_runs_compare_equal(capsys) -> None:
    assert same_programs.compare(RUN, copy.deepcopy(RUN)) == 0
    assert "| fsdp/manual | bitwise equal | 807744 | 807744 | equal |" in capsys.readouterr().out


def test_any_difference_fails() -> None:
    for change in (lambda r: r["fsdp/manual"]["losses"].__setitem__(1, (5.5 + 2**-50).hex()),
                   lambda r: r["fsdp/manual"].__setitem__("temp", 807745),
                   lambda r: r["fsdp/manual"]["ledger"].__setitem__("all-gather data", [30, 123456]),
                   lambda r: r.__setitem__("fsdp/auto", r["fsdp/manual"])):
        after = copy.deepcopy(RUN)
        change(after)
        assert same_programs.compare(RUN, after) == 1
