"""The strategy registry: one declaration per strategy, read by everything that names one.

The expected tables are written out by hand from the strategies' definitions (ZeRO-3 splits
every weight's d_model over data; Megatron splits heads, kv heads, d_ff and the vocabulary; sequence
parallelism splits the residual stream's T over tensor; ring attention splits the sequence
over context; a pipeline splits the layer stack over stage; expert parallelism splits the
experts over expert and the tokens over data x expert), not derived from the code, so a
slip in a declaration or in `compose` fails here.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

import auto_parallel
import explicit_parallel
import manual_parallel
from launch import common
from twinshard import cost
from twinshard.config import preset
from twinshard.parallel import mesh as mesh_lib, pipeline, resolve, strategies, support
from twinshard.parallel.strategies import ANY, MANY, ONE

TP = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
#           mesh needs                                          params                          activations
EXPECTED = {
    "dp": ({"data": MANY, "tensor": ONE}, {}, {"batch": "data"}),
    "fsdp": ({"data": MANY, "tensor": ONE}, {"embed": "data"}, {"batch": "data"}),
    "tp": ({"data": ONE, "tensor": MANY}, TP, TP),
    "fsdp_tp": ({"data": MANY, "tensor": MANY}, {"embed": "data", **TP}, {"batch": "data", **TP}),
    "tp_sp": ({"data": ANY, "tensor": MANY}, TP, {"batch": "data", **TP}),
    "cp": ({"data": ONE, "context": MANY, "tensor": ONE}, {}, {"seq": "context"}),
    "fsdp_cp": ({"data": MANY, "context": MANY, "tensor": ONE}, {"embed": "data"},
                {"batch": "data", "seq": "context"}),
    "ulysses": ({"data": ONE, "context": MANY, "tensor": ONE}, {}, {"seq": "context"}),
    "fsdp_ulysses": ({"data": MANY, "context": MANY, "tensor": ONE}, {"embed": "data"},
                     {"batch": "data", "seq": "context"}),
    "pp": ({"stage": MANY, "data": ONE, "tensor": ONE}, {"layers": "stage"}, {}),
    "pp_fsdp": ({"stage": MANY, "data": MANY, "tensor": ONE}, {"layers": "stage", "embed": "data"},
                {"batch": "data"}),
    "ep": ({"data": ANY, "expert": MANY}, {"experts": "expert"},
           {"batch": ("data", "expert"), "experts": "expert", "expert_groups": "data"}),
    "fsdp_ep": ({"data": MANY, "expert": MANY, "tensor": ONE}, {"embed": "data", "experts": "expert"},
                {"batch": ("data", "expert"), "experts": "expert", "expert_groups": "data"}),
    # data: the axis across slices (DCN), fsdp inside one; the weights' shards never cross slices
    "hsdp": ({"data": MANY, "fsdp": MANY}, {"embed": "fsdp"}, {"batch": ("data", "fsdp")}),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_declaration_is_the_strategys_placement(name: str) -> None:
    needs, params, activations = EXPECTED[name]
    decl = strategies.get(name)
    assert (dict(decl.mesh), dict(decl.params), dict(decl.activations)) == (needs, params, activations)
    assert list(decl.mesh) == [a for a in mesh_lib.ORDER if a in needs]  # the mesh holds them in mesh order


def test_sequence_parallelism_splits_the_residual_stream_over_tensor() -> None:
    decl = strategies.get("tp_sp")
    assert dict(decl.sequence) == {"batch": "data", **TP, "seq": "tensor"}
    assert decl.split_rules["seq"] == "tensor"
    assert all(strategies.get(n).sequence is None for n in EXPECTED if n != "tp_sp")


def test_compositions_name_their_parts_and_unite_their_tables() -> None:
    composed = {s.name: s.composes for s in strategies.DECLARATIONS if len(s.composes) > 1}
    assert composed == {"fsdp_tp": ("fsdp", "tp"), "fsdp_cp": ("fsdp", "cp"), "pp_fsdp": ("pp", "fsdp"),
                        "fsdp_ep": ("fsdp", "ep"), "fsdp_ulysses": ("fsdp", "ulysses")}
    for name, parts in composed.items():
        decl = strategies.get(name)
        for table in ("params", "activations"):
            union = {k: v for p in parts for k, v in getattr(strategies.get(p), table).items()}  # later parts win
            assert dict(getattr(decl, table)) == union, (name, table)
        assert set(decl.split_axes) == {a for p in parts for a in strategies.get(p).split_axes}, name


def test_every_reader_of_the_registry_sees_every_strategy() -> None:
    names = set(EXPECTED)
    assert set(strategies.NAMES) == names
    assert set(auto_parallel.MODULES) == set(manual_parallel.MODULES) == set(support.SUPPORT) == names
    packages = (auto_parallel, manual_parallel, explicit_parallel)
    assert tuple(p.TWIN for p in packages) == support.TWINS  # launch.common.twin's registry
    assert all(common.twin(p.TWIN) is p and tuple(p.MODULES) == support.written_by(p.TWIN) for p in packages)
    runs = names | {"single"}  # single: declared as the others, written by no twin (one device, nothing split)
    assert set(cost.STRATEGY_ROWS) == runs and set(cost.RULES) == runs
    assert set(mesh_lib.NEEDS) == runs
    assert set(common.STRATEGIES) == set(strategies.RUNS) == runs and strategies.get("single") is strategies.SINGLE
    assert not strategies.SINGLE.split_axes and cost.RULES["single"] == {} and mesh_lib.NEEDS["single"] == {}
    assert strategies.DATA_TENSOR == mesh_lib.DATA_TENSOR == ("dp", "fsdp", "tp", "fsdp_tp")
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert all(f"`{n}`" in readme for n in names), [n for n in names if f"`{n}`" not in readme]


def test_an_unknown_strategy_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'; choose one of single, dp, fsdp, tp, fsdp_tp, tp_sp, "
                                         r"cp, fsdp_cp, ulysses, fsdp_ulysses, pp, pp_fsdp, ep, fsdp_ep, hsdp\."):
        strategies.get("zero3")


def readme_strategies() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the strategies of README.md's "## Strategies" table, in order; those its text says explicit writes)."""
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("\n## Strategies\n", 1)[1].split("\n## ", 1)[0]
    rows = tuple(re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE))
    explicit = re.search(r"\(explicit: ([\w, \n]+)\)", section)
    return rows, tuple(n.strip() for n in explicit.group(1).split(","))


def test_the_readme_table_agrees_with_the_support_table() -> None:
    rows, explicit = readme_strategies()
    assert rows == tuple(support.SUPPORT) == strategies.NAMES  # every declared strategy, in order
    assert support.written_by("auto") == support.written_by("manual") == rows  # --impl=auto|manual: any
    assert explicit == support.written_by("explicit") == explicit_parallel.STRATEGIES


ROOT = pathlib.Path(__file__).resolve().parent.parent
_NAME = "(?:" + "|".join(sorted(strategies.NAMES, key=len, reverse=True)) + ")"
# three or more strategy names in a list: "dp, fsdp, tp", "tp, fsdp_tp and tp_sp", across a line break too
_LIST = re.compile(rf"(?<![\w`]){_NAME}(?:(?:,\s*(?:and\s+)?|\s+and\s+){_NAME}){{2,}}(?!\w)")


def explicit_lists(text: str) -> list[tuple[int, tuple[str, ...]]]:
    """(line, names) of every list of strategies that starts on a line speaking of the explicit twin,
    or on the line after one (a wrapped sentence, a column of the design picture)."""
    found = []
    for m in _LIST.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        context = text[text.rfind("\n", 0, max(line_start - 1, 0)) + 1:m.start()]
        if "explicit" in context.lower():
            found.append((text.count("\n", 0, m.start()) + 1, tuple(re.findall(_NAME, m.group(0)))))
    return found


def test_every_list_of_the_explicit_twins_strategies_is_support_s() -> None:
    """README.md, docs/ and the launchers' help say which strategies the explicit twin writes as
    support.py does (the launchers' help is generated from it)."""
    from absl import flags

    common.define_model_flags()
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))}
    texts["--impl"] = flags.FLAGS["impl"].help
    lists = {(where, line): names for where, text in texts.items() for line, names in explicit_lists(text)}
    assert {where for where, _ in lists} >= {"README.md", "docs/design.md", "--impl"}  # the parse finds them
    wrong = {k: names for k, names in lists.items() if names != support.written_by("explicit")}
    assert not wrong, f"say {', '.join(support.written_by('explicit'))} (twinshard/parallel/support.py): {wrong}"
    assert explicit_lists("the explicit twin (dp, fsdp, tp and tp_sp).\nOther twins:\nall of dp, fsdp, tp") == [
        (1, ("dp", "fsdp", "tp", "tp_sp"))]


def test_every_option_is_run_by_twins_that_write_the_strategy() -> None:
    fields = [f.name for f in dataclasses.fields(support.Support) if f.name != "twins"]
    for name, row in support.SUPPORT.items():
        assert set(row.twins) <= set(support.TWINS), name
        for field in fields:
            assert set(getattr(row, field)) <= set(row.twins), (name, field)
    assert support.with_option("moe") == resolve.MOE_STRATEGIES == ("dp", "fsdp", "ep", "fsdp_ep")
    assert support.with_option("one_f_one_b") == support.with_option("zb_h1") == strategies.of_family("pipeline")
    # interleaved: the manual twin's table and the GSPMD twin's circular loop, under pp and pp_fsdp
    assert support.with_option("interleaved", "manual") == support.with_option("interleaved", "auto") \
        == strategies.of_family("pipeline")
    assert [support.schedule_twins("pp", s) for s in pipeline.SCHEDULES] == [("auto", "manual"), ("manual",),
                                                                             ("auto", "manual"), ("manual",)]
    with pytest.raises(ValueError, match=r"--schedule=zbv is not a pipeline schedule; choose one of gpipe, 1f1b, "):
        support.schedule_twins("pp", "zbv")
    assert support.with_option("collective_matmul") == ("tp_sp",)


@pytest.mark.parametrize("twin", support.TWINS)
def test_a_twin_runs_exactly_the_strategies_the_table_gives_it(twin) -> None:
    cfg = preset("tiny")
    for name, row in support.SUPPORT.items():
        if twin in row.twins:
            resolve.check_twin(strategies.get(name), twin, cfg)
        else:
            with pytest.raises(ValueError, match=rf"--impl={twin} runs {', '.join(support.written_by(twin))}, "
                                                 rf"not --strategy={name}, which the "
                                                 rf"{' and '.join(row.twins)} twins write") as err:
                resolve.check_twin(strategies.get(name), twin, cfg)
            assert "\n" not in str(err.value)  # one line, ending with the --impl values that run it
            assert str(err.value).endswith(f"use {' or '.join(f'--impl={t}' for t in row.twins)}."), err.value
