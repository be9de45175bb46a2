"""The index of every declared strategy's proofs: a strategy without one of its kinds fails here.

A kind's tests are the functions PROOFS lists; an item of one proves strategy S when it carries
S's marker (tests/harness/markers.py: from its parameters, or @pytest.mark.S) and, for a twin,
names the twin in its parameters. `pytest -m S` runs them all. A proof that does not exist yet
is listed in MISSING with the reason; once a proof of it is collected, its entry must go.
"""

import json
import subprocess
import sys

import explicit_parallel
from twinshard.parallel import strategies

DATA_TENSOR, SEQUENCE, CONTEXT = "test_data_tensor.py", "test_sequence.py", "test_context.py"
PIPELINE, EXPERTS, ULYSSES = "test_pipeline.py", "test_experts.py", "test_ulysses.py"
TWIN_TESTS = [(DATA_TENSOR, "test_adamw_matches_single_device"), (SEQUENCE, "test_tp_sp_matches_single_device"),
              (CONTEXT, "test_context_parallel_matches_single_device"),
              (PIPELINE, "test_pipeline_matches_single_device"), (PIPELINE, "test_pp_fsdp_matches_single_device"),
              (EXPERTS, "test_expert_parallel_matches_single_device_while_dropping_tokens"),
              (ULYSSES, "test_twins_match_single_device")]
# kind -> (module, test function, the word its parameters must hold, or None)
PROOFS = {
    "manual twin vs single device": [(*t, "manual") for t in TWIN_TESTS],
    "auto twin vs single device": [(*t, "auto") for t in TWIN_TESTS],
    "explicit twin vs single device": [("test_explicit.py", "test_explicit_matches_single_device", None),
                                       (ULYSSES, "test_explicit_twin_matches_single_device_with_the_manual_twins_all_to_alls",
                                        None)],
    "ledger vs cost model": [(m, f, None) for m, f in [
        (DATA_TENSOR, "test_manual_ledger_equals_the_cost_model_exactly"),
        (SEQUENCE, "test_manual_ledger_equals_the_cost_model"),
        (CONTEXT, "test_manual_ledger_equals_the_cost_model_exactly"),
        (PIPELINE, "test_manual_ledger_equals_the_cost_model_exactly"),
        (PIPELINE, "test_pp_fsdp_manual_ledger_equals_the_cost_model_exactly"),
        (EXPERTS, "test_manual_ledger_equals_the_cost_model_exactly"),
        (ULYSSES, "test_manual_ledger_equals_the_cost_model_exactly")]],
    "ledger under --remat vs cost model": [
        ("test_remat.py", "test_manual_collectives_equal_the_cost_model_under_every_policy", None),
        ("test_remat.py", "test_manual_ledger_under_full_remat_equals_the_cost_model", None)],
    "memory vs memory_analysis": [(m, f, None) for m, f in [
        ("test_memory.py", "test_memory_analysis_beside_the_model"),
        (SEQUENCE, "test_temporaries_below_tp"),
        (CONTEXT, "test_compiled_temporaries_beside_the_memory_model"),
        (PIPELINE, "test_compiled_temporaries_beside_the_memory_model"),
        (EXPERTS, "test_compiled_step_beside_the_memory_model"),
        (ULYSSES, "test_compiled_temporaries_beside_the_memory_model")]],
    "checkpoint restores elsewhere": [
        ("test_train.py", "test_every_strategy_checkpoint_restores_on_one_device", None),
        ("test_experts.py", "test_a_checkpoint_written_under_one_expert_strategy_restores_under_single_and_the_other", None),
        (ULYSSES, "test_a_checkpoint_written_under_ulysses_restores_under_single_and_cp", None)],
}
MISSING: dict[tuple[str, str], str] = {}  # (strategy, kind) -> why its proof does not exist yet

_COLLECT = """
import json, sys
sys.path.insert(0, "tests")
import pytest
from harness import markers

class Report:
    def pytest_collection_finish(self, session):
        self.items = [[i.nodeid, sorted({m.name for m in i.iter_markers()}), sorted(markers.param_words(i))]
                      for i in session.items]

report = Report()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *sys.argv[2:]], plugins=[report])
json.dump({"code": int(code), "items": report.items}, open(sys.argv[1], "w"))
"""


def kinds(strategy: str) -> list[str]:
    """The kinds every strategy has, the twins it is written in."""
    twins = ["manual", "auto"] + (["explicit"] if strategy in explicit_parallel.STRATEGIES else [])
    return [k for k in PROOFS if not k.endswith("twin vs single device") or k.split()[0] in twins]


def collected(tmp_path) -> list[tuple[str, set[str], set[str]]]:
    """(node id, markers, parameter words) of every test in PROOFS's modules, as pytest collects them."""
    out = tmp_path / "items.json"
    files = sorted({f"tests/{m}" for proofs in PROOFS.values() for m, *_ in proofs})
    proc = subprocess.run([sys.executable, "-c", _COLLECT, str(out), *files], capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["code"] == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [(nodeid, set(marks), set(words)) for nodeid, marks, words in result["items"]]


def test_every_declared_strategy_has_every_kind_of_proof(tmp_path):
    items = collected(tmp_path)
    found, unknown = {}, []
    for kind, proofs in PROOFS.items():
        for module, function, word in proofs:
            mine = [i for i in items if i[0].split("[")[0] == f"tests/{module}::{function}"]
            if not mine:
                unknown.append(f"{module}::{function}")
            for nodeid, marks, words in mine:
                for s in marks & set(strategies.NAMES):
                    if word is None or word in words:
                        found.setdefault((s, kind), []).append(nodeid)
    assert not unknown, f"PROOFS names tests pytest does not collect: {unknown}"
    lacking = [(s, k) for s in strategies.NAMES for k in kinds(s) if (s, k) not in found and (s, k) not in MISSING]
    assert not lacking, f"declared strategies without a proof of these kinds: {lacking}"
    stale = [key for key in MISSING if key in found]
    assert not stale, f"MISSING lists proofs that exist now (remove them): {[(k, found[k]) for k in stale]}"


def test_each_strategy_is_a_registered_marker(pytestconfig):
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(strategies.NAMES) <= registered
