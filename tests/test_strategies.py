"""The strategy registry: one declaration per strategy, read by everything that names one.

The expected tables are written out by hand from the strategies' definitions (ZeRO-3 splits
every weight's d_model over data; Megatron splits heads, kv heads, d_ff and the vocabulary; sequence
parallelism splits the residual stream's T over tensor; ring attention splits the sequence
over context; a pipeline splits the layer stack over stage; expert parallelism splits the
experts over expert and the tokens over data x expert), not derived from the code, so a
slip in a declaration or in `compose` fails here.
"""

from __future__ import annotations

import pathlib

import pytest

import auto_parallel
import manual_parallel
from launch import common
from twinshard import cost
from twinshard.parallel import mesh as mesh_lib, strategies
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
    assert set(auto_parallel.MODULES) == set(manual_parallel.MODULES) == names
    assert set(cost.STRATEGY_ROWS) == names and set(cost.RULES) == names
    assert set(mesh_lib.NEEDS) == names
    assert set(common.STRATEGIES) == names | {"single"}
    assert strategies.DATA_TENSOR == mesh_lib.DATA_TENSOR == ("dp", "fsdp", "tp", "fsdp_tp")
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert all(f"`{n}`" in readme for n in names), [n for n in names if f"`{n}`" not in readme]


def test_an_unknown_strategy_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'; choose one of dp, fsdp, tp, fsdp_tp, tp_sp, "
                                         r"cp, fsdp_cp, ulysses, fsdp_ulysses, pp, pp_fsdp, ep, fsdp_ep\."):
        strategies.get("zero3")
