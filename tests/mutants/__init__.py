"""The curated mutants of tools/mutate.py: small, realistic bugs, one line each, one module a family
(parallel, sequence, pipeline, experts, explicit, model, ledger, launch, timeline, kinds, blind, blind3, blind4, blind5, blind6, blind7; base.py: the record and
the shared file paths and test selections).

A mutant replaces `original` (which must occur exactly once in `file`, else the
mutant is reported `stale`) by `replacement` and names the tests that should
catch it, cheapest and likeliest first (pytest runs with -x, so a caught mutant
stops at its first failure). Selections are whole files unless a node id is
clearly enough: a mutant reported `missed` because its selection was too narrow
is a bug of this list, not of the tests.

How a selection is chosen: the tests that hold an independent reference for the
mutated code. A bug in shared single-device math (layers, loss, optimizer) changes
the single-device run and both twins alike, so the twin-vs-single tests cannot see
it: such a mutant selects the tests with hand/NumPy references (test_layers,
test_model, test_loss_optim). The GSPMD twin never imports manual_parallel/, so
manual-twin mutants select the manual twin's tests of test_data_tensor (MANUAL, node ids)
and test_train, which trains manual fsdp.

`equivalent` (a reason) marks a mutant known not to change behaviour; such a
mutant is not run unless --run-equivalent (which then checks the label).

When code moves or changes, fix the mutant's file or snippet (tests/test_mutants.py fails
on it in CI, and names it; the run reports `stale`). A new strategy
adds mutants for its placement table, each named collective (forward and
backward) and its cost-model rows.
"""

from . import blind, blind3, blind4, blind5, blind6, blind7, experts, explicit, kinds, launch, ledger, model, parallel, pipeline, sequence, timeline
from .base import Mutant

__all__ = ["MUTANTS", "Mutant"]

# one family a module, in this order (--list, a full run)
MUTANTS: list[Mutant] = [m for family in (parallel, sequence, pipeline, experts, explicit, model, ledger, launch, timeline, kinds, blind, blind3, blind4, blind5, blind6, blind7)
                          for m in family.MUTANTS]
