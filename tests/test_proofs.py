"""The index of every declared strategy's proofs: a strategy without one of its kinds fails here.

A kind's tests are the functions PROOFS lists; an item of one proves strategy S when it names S
itself (tests/harness/markers.py `named`: its function's name, its parameters, or @pytest.mark.S;
not fsdp_tp's test for fsdp) and, for a twin, names the twin in its parameters. `pytest -m S`
runs them all, and every other test about S (below: none is left unmarked). A proof that does not exist yet
is listed in MISSING with the reason; once a proof of it is collected, its entry must go.
"""

import pytest

import explicit_parallel
import suite
from harness import markers
from twinshard.parallel import strategies

DATA_TENSOR, SEQUENCE, CONTEXT = "test_data_tensor.py", "test_sequence.py", "test_context.py"
PIPELINE, EXPERTS, ULYSSES = "test_pipeline.py", "test_experts.py", "test_ulysses.py"
TWIN_TESTS = [(DATA_TENSOR, "test_adamw_matches_single_device"), (SEQUENCE, "test_tp_sp_matches_single_device"),
              (CONTEXT, "test_context_parallel_matches_single_device"),
              (PIPELINE, "test_pipeline_matches_single_device"), (PIPELINE, "test_pp_fsdp_matches_single_device"),
              (EXPERTS, "test_expert_parallel_matches_single_device_while_dropping_tokens"),
              (ULYSSES, "test_twins_match_single_device"),
              ("test_hsdp.py", "test_the_twins_across_two_slices_equal_single_device")]
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
        (ULYSSES, "test_manual_ledger_equals_the_cost_model_exactly"),
        ("test_hsdp.py", "test_manual_ledger_equals_the_cost_model_exactly")]],
    "ledger under --remat vs cost model": [
        ("test_remat.py", "test_manual_collectives_equal_the_cost_model_under_every_policy", None),
        ("test_remat.py", "test_manual_ledger_under_full_remat_equals_the_cost_model", None),
        (ULYSSES, "test_remat_full_saves_the_all_to_alls", None)],
    "memory vs memory_analysis": [(m, f, None) for m, f in [
        ("test_memory.py", "test_memory_analysis_beside_the_model"),
        (SEQUENCE, "test_temporaries_below_tp"),
        (SEQUENCE, "test_fsdp_tp_sp_memory_beside_the_model"),
        (CONTEXT, "test_compiled_temporaries_beside_the_memory_model"),
        (PIPELINE, "test_compiled_temporaries_beside_the_memory_model"),
        (EXPERTS, "test_compiled_step_beside_the_memory_model"),
        (ULYSSES, "test_compiled_temporaries_beside_the_memory_model")]],
    "checkpoint restores elsewhere": [
        ("test_train.py", "test_every_strategy_checkpoint_restores_on_one_device", None),
        ("test_experts.py", "test_a_checkpoint_written_under_one_expert_strategy_restores_under_single_and_the_other", None),
        (ULYSSES, "test_a_checkpoint_written_under_ulysses_restores_under_single_and_cp", None),
        ("test_multiprocess.py", "test_two_processes_train_as_two_slices_like_a_single_device", None)],
}
MISSING: dict[tuple[str, str], str] = {  # (strategy, kind) -> why its proof does not exist yet
    ("hsdp", "memory vs memory_analysis"): "hsdp's compiled temporaries are not yet set beside the memory model",
}

def kinds(strategy: str) -> list[str]:
    """The kinds every strategy has, the twins it is written in."""
    twins = ["manual", "auto"] + (["explicit"] if strategy in explicit_parallel.STRATEGIES else [])
    return [k for k in PROOFS if not k.endswith("twin vs single device") or k.split()[0] in twins]


def test_every_declared_strategy_has_every_kind_of_proof():
    items = [(i["nodeid"], set(i["named"]), set(i["words"])) for i in suite.collect()]
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


def test_every_test_named_after_a_strategy_carries_its_marker():
    """Read from the node id as pytest prints it (class, function, module and parameter ids
    alike): a test about S that `pytest -m S` would not run fails here."""
    items = suite.collect()
    assert len(items) > 100, len(items)
    unmarked = []
    for item in items:
        want = markers.named_in(item["nodeid"].removeprefix("tests/"))
        want |= {part for name in want for part in strategies.get(name).composes}
        if want - set(item["markers"]):
            unmarked.append((item["nodeid"], sorted(want - set(item["markers"]))))
    assert not unmarked, f"tests about a strategy without its marker: {unmarked[:10]}"


@pytest.mark.parametrize(("text", "names"), [
    ("test_manual_fsdp_gathers_each_weight", {"fsdp"}),
    ("test_fsdp_tp_composes_both[manual-tp_sp]", {"fsdp_tp", "tp_sp"}),
    ("test_pp_fsdp_ledger[auto_fsdp_accum]", {"pp_fsdp", "fsdp"}),
    ("test_fsdp_ulysses_accumulates", {"fsdp_ulysses"}),
    ("test_twins_match_single_device[cpu-steps]", set()),  # cpu is not cp, steps not ep
    ("test_dp_and_ep-tp", {"dp", "ep", "tp"}),
], ids=["a-word", "compounds-first", "an-id-of-words", "a-composition", "not-within-words", "separators"])
def test_strategy_names_are_read_longest_first_and_as_whole_words(text, names):
    assert markers.named_in(text) == names


def test_a_compound_strategys_test_is_also_marked_with_its_parts():
    """`pytest -m fsdp` runs fsdp_tp's proofs too (docs/mutation-testing.md says why)."""
    items = {i["nodeid"]: set(i["markers"]) for i in suite.collect()}
    assert {"fsdp_tp", "fsdp", "tp"} <= items["tests/test_data_tensor.py::test_manual_matches_auto[fsdp_tp]"]
    assert not {"fsdp", "tp"} & items["tests/test_data_tensor.py::test_manual_matches_auto[dp]"]
