"""The assertion API a pytest user meets: what each record says (reduction, phase, source), how
records are selected, what a failure shows, and that it needs nothing but jax and numpy.

This file imports only jax, numpy, pytest and the two modules of the twinshard-hlo distribution,
so it also runs against that distribution installed alone, on another JAX (docs/hlo-assertions.md,
"Install it"): run alone, it asks for 8 CPU devices itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # run alone; the suite's conftest has set both already
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import twinshard.hlo
from twinshard import hlo, testing
from twinshard.testing import expect_bytes, expect_collectives, expect_no_collective

HERE = pathlib.Path(__file__).name
B, D, F = 64, 128, 256


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _line(marker: str) -> int:
    """The line of this file that holds `marker` (a comment on the collective's call)."""
    lines = pathlib.Path(__file__).read_text().splitlines()
    (n,) = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(marker)]
    return n


def fsdp_matmul(x, w):
    """x: [B/8, D], w: [D/8, F] -> [B/8, F]; w gathered forward, its gradient scattered backward."""
    w_full = lax.all_gather(w, "data", axis=0, tiled=True)  # [D, F]  # <- the gather
    return x @ w_full


@pytest.fixture(scope="module")
def grad_ledger(mesh) -> hlo.Ledger:
    """jit(grad) of a shard_map FSDP matmul: one all-gather forward, one reduce-scatter backward."""
    layer = jax.shard_map(fsdp_matmul, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    step = jax.jit(jax.grad(lambda x, w: layer(x, w).sum(), argnums=1))
    spec = NamedSharding(mesh, P("data"))
    args = (jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=spec),
            jax.ShapeDtypeStruct((D, F), jnp.float32, sharding=spec))
    return hlo.ledger(step.lower(*args).compile(), mesh)


def reductions(x):
    """x: [1, 4] per device -> four all-reduces (sum, max, min, min) and one reduce-scatter (sum)."""
    return (lax.psum(x, "data"), lax.pmax(x, "data"), lax.pmin(x, "data"),
            lax.pmin(x.astype(jnp.int32), "data"),
            lax.psum_scatter(jnp.tile(x, (8, 1)), "data", scatter_dimension=0, tiled=True))


def test_every_all_reduce_and_reduce_scatter_says_its_reduction(mesh) -> None:
    fn = jax.jit(jax.shard_map(reductions, mesh=mesh, in_specs=P("data"), out_specs=(P(),) * 4 + (P("data"),)))
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    led = hlo.ledger(fn.lower(x).compile(), mesh)
    reducing = led.filter(op=("all-reduce", "reduce-scatter"))
    assert sorted((r.op, r.reduction, r.dtype) for r in reducing for _ in range(r.multiplicity)) == [
        ("all-reduce", "max", "f32"), ("all-reduce", "min", "f32"), ("all-reduce", "min", "s32"),
        ("all-reduce", "sum", "f32"), ("reduce-scatter", "sum", "f32")], led.table()
    expect_collectives(led, "all-reduce", "data", count=2, reduction="min")
    expect_collectives(led, "all-reduce", "data", count=1, reduction="max")
    expect_no_collective(led, "reduce-scatter", reduction="max")
    assert "all-reduce max" in led.table() and "reduce-scatter sum" in led.table()
    assert {r["reduction"] for r in led.as_dict()["records"]} == {"sum", "max", "min"}


ANDS_AND_ORS = """HloModule ands, num_partitions=8

%and (x: pred[], y: pred[]) -> pred[] {
  %x = pred[] parameter(0)
  %y = pred[] parameter(1)
  ROOT %and = pred[] and(%x, %y)
}

%or (x: pred[], y: pred[]) -> pred[] {
  %x = pred[] parameter(0)
  %y = pred[] parameter(1)
  ROOT %or = pred[] or(%x, %y)
}

%add_in_f32 (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  %xf = f32[] convert(%x)
  %yf = f32[] convert(%y)
  %sum = f32[] add(%xf, %yf)
  ROOT %back = bf16[] convert(%sum)
}

ENTRY %main {
  %p = pred[4]{0} parameter(0)
  %h = bf16[8]{0} parameter(1)
  %all = pred[4]{0} all-reduce(%p), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%and
  %any = pred[4]{0} all-reduce(%p), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%or
  %rs = bf16[1]{0} reduce-scatter(%h), channel_id=3, replica_groups=[1,8]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add_in_f32
  %ag = bf16[64]{0} all-gather(%h), channel_id=4, replica_groups=[1,8]<=[8], use_global_device_ids=true, dimensions={0}
  ROOT %out = pred[] constant(false)
}
"""


def test_and_or_and_a_reduction_through_converts() -> None:
    led = hlo.ledger(ANDS_AND_ORS, {"data": 8})
    assert [(r.name, r.reduction) for r in led] == [("all", "and"), ("any", "or"), ("rs", "sum"), ("ag", "")]
    assert led.count("all-reduce", reduction="or") == 1


def test_phase_says_forward_or_backward(grad_ledger: hlo.Ledger) -> None:
    assert [(r.op, r.phase) for r in grad_ledger] == [("reduce-scatter", "backward")], grad_ledger.table()
    expect_collectives(grad_ledger, "reduce-scatter", "data", count=1, phase="backward")
    expect_no_collective(grad_ledger, phase="forward")  # dL/dw = x^T g: the gathered w is not needed
    with pytest.raises(ValueError, match="unknown phase 'backwards'"):
        grad_ledger.filter(phase="backwards")


def test_phase_of_a_program_without_grad_and_of_what_runs_after_the_grad(mesh) -> None:
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    forward = jax.jit(jax.shard_map(lambda v: lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))
    assert [r.phase for r in hlo.ledger(forward.lower(x).compile(), mesh)] == ["forward"]

    def step(v):  # v: [1, 4]; the gradient's all-reduce runs after jax.grad, outside jvp/transpose
        g = jax.grad(lambda u: (lax.all_gather(u, "data", tiled=True) ** 2).sum())(v)
        return lax.pmax(g, "data")
    led = hlo.ledger(jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P())).lower(x).compile(), mesh)
    assert {(r.op, r.reduction, r.phase) for r in led} == {("all-gather", "", "forward"),
                                                            ("reduce-scatter", "sum", "backward"),
                                                            ("all-reduce", "max", "")}, led.table()


def test_select_by_source_file_and_line(grad_ledger: hlo.Ledger) -> None:
    gather_line = _line("# <- the gather")
    (r,) = grad_ledger.records
    assert r.source.endswith(f"{HERE}:{gather_line}"), r.source  # the transpose keeps the gather's line
    expect_collectives(grad_ledger, "reduce-scatter", count=1, source=HERE)
    expect_collectives(grad_ledger, "reduce-scatter", count=1, source=f"{HERE}:{gather_line}")
    expect_collectives(grad_ledger, "reduce-scatter", count=1, source=f"{pathlib.Path(__file__).parent.name}/{HERE}")
    expect_no_collective(grad_ledger, source=f"{HERE}:{gather_line + 1}")
    with pytest.raises(ValueError, match=f"source '{HERE[1:]}' names no instruction .* files in the program: .*'{HERE}'"):
        expect_no_collective(grad_ledger, source=HERE[1:])  # whole path components only: a typo, refused
    assert expect_bytes(grad_ledger, "data", D // 8 * F * 4, source=HERE, phase="backward") == D // 8 * F * 4


def test_failure_shows_the_expected_row_beside_the_nearest(grad_ledger: hlo.Ledger) -> None:
    with pytest.raises(AssertionError) as err:
        expect_collectives(grad_ledger, "reduce-scatter", "data", count=2, phase="backward")
    message = str(err.value)
    lines = message.splitlines()
    expected = next(i for i, s in enumerate(lines) if s.startswith("expected  "))  # the rows, below
    found = expected + 1                                                           # the first line
    assert lines[expected].split()[:4] == ["expected", "reduce-scatter", "data", "count=2"], message
    assert lines[found].split()[:4] == ["found", "reduce-scatter", "sum", "data"], message
    assert lines[found].split()[4] == "1", message  # the count found, in the column of the expected one
    assert message.endswith(grad_ledger.table())
    with pytest.raises(AssertionError, match="no row of this op or these axes"):
        expect_collectives(grad_ledger, "all-to-all", count=1)


def test_an_axis_the_mesh_lacks_is_one_line(grad_ledger: hlo.Ledger) -> None:
    for call in (lambda: expect_collectives(grad_ledger, "reduce-scatter", "date"),
                 lambda: expect_bytes(grad_ledger, ("data", "tensor"), 0),
                 lambda: expect_no_collective(grad_ledger, axes="date"),
                 lambda: testing.expect_permute(grad_ledger, {"stage": 1})):
        with pytest.raises(ValueError) as err:
            call()
        assert "\n" not in str(err.value) and "('data',)" in str(err.value), str(err.value)


def test_escaped_names_print_as_written() -> None:
    text = ANDS_AND_ORS.replace(
        "to_apply=%and", "to_apply=%and, metadata={op_name=\"jit(step)/state.params[\\'lm_head\\']\"}").replace(
        "to_apply=%or", "to_apply=%or, metadata={op_name=\"jit(f)/psum\" source_file=\"/src/it\\'s.py\" source_line=3}")
    led = hlo.ledger(text, {"data": 8})
    assert led[0].op_name == "jit(step)/state.params['lm_head']" and led[1].source == "/src/it's.py:3"
    assert "state.params['lm_head']" in led.table() and "\\'" not in led.table()


def test_public_names() -> None:
    assert sorted(testing.__all__) == sorted(n for n in dir(testing) if n.startswith("expect_"))
    assert all(hasattr(hlo, n) for n in hlo.__all__) and {"ledger", "Ledger", "Collective"} <= set(hlo.__all__)


def test_helper_frames_are_hidden_from_failures(tmp_path: pathlib.Path) -> None:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(f"""
        from twinshard import hlo, testing
        TEXT = {ANDS_AND_ORS!r}

        def test_two_gathers():
            testing.expect_collectives(hlo.ledger(TEXT, {{"data": 8}}), "all-gather", count=2)
    """))
    proc = _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "test_user.py"], tmp_path)
    assert proc.returncode == 1 and "expected all-gather over any axes with count=2" in proc.stdout, proc.stdout
    assert "testing.py" not in proc.stdout and "records.py" not in proc.stdout, proc.stdout
    assert "test_user.py:6" in proc.stdout, proc.stdout  # the user's line is the one shown


BLOCKED = ("flax", "optax", "orbax")


def test_imports_without_flax_optax_orbax_or_the_rest_of_twinshard(tmp_path: pathlib.Path) -> None:
    """twinshard.hlo (every module of its directory, the ones added later included) and
    twinshard.testing import only themselves, jax and numpy: a finder that raises on flax, optax,
    orbax and any other twinshard module proves it in a fresh process."""
    modules = sorted(f"twinshard.hlo.{p.stem}" for p in pathlib.Path(twinshard.hlo.__file__).parent.glob("*.py")
                     if p.stem != "__init__")
    probe = textwrap.dedent(f"""
        import sys

        class Blocked:
            def find_spec(self, name, path=None, target=None):
                top = name.split(".")[0]
                if top in {BLOCKED!r} or (top == "twinshard" and name not in ("twinshard", "twinshard.testing")
                                          and not name.startswith("twinshard.hlo")):
                    raise ImportError(f"blocked: {{name}}")
                return None

        sys.meta_path.insert(0, Blocked())
        import twinshard.hlo, twinshard.testing, {", ".join(modules)}
        print(sorted(m for m in sys.modules if m.startswith("twinshard")))
    """)
    proc = _python(["-c", probe], tmp_path)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    loaded = eval(proc.stdout.strip().splitlines()[-1])
    assert {"twinshard.testing", "twinshard.hlo.records", *modules} <= set(loaded), loaded


def _python(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """The interpreter running this test, in `cwd`, able to import the twinshard under test."""
    root = pathlib.Path(twinshard.hlo.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
