"""The ledger refuses what is not a compiled program's HLO; expect_* refuse what proves nothing.

`ledger("")`, `ledger("garbage")` or StableHLO text would otherwise give an empty
ledger on which `expect_no_collective` / `expect_parsed` pass.
Every refusal here is a ValueError (`hlo.NotCompiledHLO`) that names what to
pass (`.compile()` / `.as_text()`). A compiled program with genuinely no
collectives (the single-device train step) still gives an empty, usable ledger.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from twinshard import hlo, testing
from twinshard.config import preset
from twinshard.train.trainer import SingleDevice

MESH = {"data": 8}
PASS = r"lower\(\*args\)\.compile\(\)"  # every message names what to pass


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture(scope="module")
def psum_program(mesh):
    """A shard_map psum over 'data': exactly one all-reduce once compiled."""
    f = jax.jit(jax.shard_map(lambda x: lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=jax.NamedSharding(mesh, P("data")))
    return f, f.lower(x)


@pytest.mark.parametrize("text, why", [
    ("", "empty text"),
    ("  \n\t\n", "empty text"),
    ("garbage", "no HLO instruction"),
    ("all-reduce(%p) happened somewhere", "no HLO instruction"),
    ("HloModule m, num_partitions=8\n\nENTRY %main {\n}\n", "no HLO instruction"),
])
def test_empty_and_unreadable_text_is_refused(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"{why}.*{PASS}"):
        hlo.ledger(text, MESH)


def test_stablehlo_text_is_refused(psum_program) -> None:
    _, lowered = psum_program
    text = lowered.as_text()  # what users print first: MLIR, before XLA compiles
    assert text.lstrip().startswith("module @") and "stablehlo." in text
    with pytest.raises(ValueError, match=f"StableHLO/MLIR.*{PASS}"):
        hlo.ledger(text, MESH)


def test_uncompiled_hlo_dialect_text_is_refused(psum_program, mesh) -> None:
    # `as_text(dialect='hlo')` is HLO syntax but before partitioning: a GSPMD
    # program's collectives are not in it yet, so a ledger of it would lie.
    _, lowered = psum_program
    gspmd = jax.jit(lambda x: jnp.sum(x)).lower(
        jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=jax.NamedSharding(mesh, P("data"))))
    for text in (lowered.as_text(dialect="hlo"), gspmd.as_text(dialect="hlo")):
        assert text.startswith("HloModule")
        with pytest.raises(ValueError, match=f"not compiled yet.*{PASS}"):
            hlo.ledger(text, MESH)
    # ... while the compiled GSPMD program has its all-reduce over 'data'.
    testing.expect_collectives(hlo.ledger(gspmd.compile(), mesh), "all-reduce", "data", count=1)


def test_lowered_and_functions_are_refused(psum_program, mesh) -> None:
    f, lowered = psum_program
    with pytest.raises(ValueError, match=r"Lowered.*\.compile\(\)"):
        hlo.ledger(lowered, mesh)
    with pytest.raises(TypeError):  # also a TypeError, as a Lowered raised before
        hlo.ledger(lowered, mesh)
    with pytest.raises(ValueError, match=f"a function.*{PASS}"):
        hlo.ledger(f, mesh)
    for bad in (None, 42, b"HloModule m"):
        with pytest.raises(ValueError, match=f"got a {type(bad).__name__}.*{PASS}"):
            hlo.ledger(bad, mesh)


def test_compiled_and_its_text_give_the_same_ledger(psum_program, mesh) -> None:
    _, lowered = psum_program
    compiled = lowered.compile()
    a, b = hlo.ledger(compiled, mesh), hlo.ledger(compiled.as_text(), mesh)
    assert a.records == b.records and a.instructions == b.instructions > 0
    testing.expect_parsed(a)
    testing.expect_collectives(a, "all-reduce", "data", count=1)


def test_single_device_step_gives_an_empty_but_parsed_ledger() -> None:
    cfg = preset("tiny")
    r = SingleDevice(cfg.model, cfg.train)
    xs = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32)
    led = hlo.ledger(r.train_step.lower(r.abstract_state(), xs, xs).compile(), {"data": 1})
    assert len(led) == 0 and led.instructions > 100, led.table()
    testing.expect_parsed(led)
    testing.expect_no_collective(led)
    testing.expect_collectives(led, "all-reduce", count=0)
    testing.expect_bytes(led, None, bytes=0)
    assert "instructions: " in led.table() and led.as_dict()["instructions"] == led.instructions


def test_expect_helpers_refuse_a_ledger_that_parsed_nothing() -> None:
    empty = hlo.Ledger([], hlo.mesh_spec(MESH))  # built by hand: instructions=0
    checks = [lambda: testing.expect_parsed(empty),
              lambda: testing.expect_no_collective(empty),
              lambda: testing.expect_no_collective(empty, op="all-gather", larger_than=0),
              lambda: testing.expect_collectives(empty, "all-reduce", count=0),
              lambda: testing.expect_bytes(empty, "data", bytes=0),
              lambda: testing.expect_parsed(empty.filter(op="all-reduce"))]
    for check in checks:
        with pytest.raises(AssertionError, match="parsed no HLO instructions"):
            check()
    with pytest.raises(AssertionError, match="expected a twinshard.hlo.Ledger"):
        testing.expect_no_collective("HloModule m")


def test_filter_keeps_the_parsed_module_count(psum_program, mesh) -> None:
    led = hlo.ledger(psum_program[1].compile(), mesh)
    none = led.filter(op="all-gather")
    assert len(none) == 0 and none.instructions == led.instructions
    testing.expect_no_collective(none)


UNPARSED = """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

ENTRY %main {
  %p = f32[4,4]{1,0} parameter(0)
  %bad = f32[4,4]{1,0} all-reduce(%p), channel_id=1, replica_groups=weird(3), to_apply=%add
  ROOT %out = f32[] constant(0)
}
"""


def test_no_collective_is_not_asserted_over_an_unparsed_one() -> None:
    led = hlo.ledger(UNPARSED, MESH)
    assert len(led) == 0 and len(led.unparsed) == 1 and led.instructions == 6
    for op in (None, "all-reduce"):
        with pytest.raises(AssertionError, match="1 collective-looking HLO line"):
            testing.expect_no_collective(led, op=op)
    testing.expect_no_collective(led, op="all-gather")  # the unreadable line is an all-reduce


def test_a_compiled_module_keeping_shardys_mesh_in_its_header_is_read() -> None:
    # JAX 0.10.2's compiled programs keep `frontend_attributes={xla.sdy.meshes=...}` in the module's header
    # (measured on a TPU v5e and on CPU); scheduled, the module is compiled, and the ledger reads it.
    body = ("\n\nENTRY %main (p: f32[8]) -> f32[8] {\n  %p = f32[8]{0} parameter(0)\n"
            "  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add\n}\n"
            "\n%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
            "  ROOT %s = f32[] add(%a, %b)\n}\n")
    header = 'HloModule m, {}entry_computation_layout={{(f32[8]{{0}})->f32[8]{{0}}}}, num_partitions=8, ' \
             'frontend_attributes={{xla.sdy.meshes={{mesh = #sdy.mesh<["data"=8]>}}}}'
    testing.expect_collectives(hlo.ledger(header.format("is_scheduled=true, ") + body, MESH), "all-reduce", "data",
                               count=1)
    with pytest.raises(ValueError, match=f"not compiled yet.*{PASS}"):  # unscheduled: still refused
        hlo.ledger(header.format("") + body, MESH)
