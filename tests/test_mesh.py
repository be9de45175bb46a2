"""Mesh parsing, per-strategy defaults and every validation error (twinshard/parallel/mesh.py,
twinshard.parallel.resolve.resolve_mesh, shared by both twins).

Each error is a ValueError raised before anything compiles, and its message names
the offending value, the mesh axis involved and a valid alternative; the `match=`
patterns below check all three. `resolve_mesh` takes a device count, so meshes of
any size are validated here without those devices existing.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import pytest

from twinshard.parallel import strategies
from twinshard.parallel.resolve import resolve_mesh
from twinshard.parallel import mesh as mesh_lib
from twinshard.config import preset
from twinshard.parallel.placement import logical_dims

TINY = preset("tiny")  # d_model 64, num_heads 4, d_ff 192, padded vocab 384, batch 8


def cfg(batch: int | None = None, **model):
    """The tiny preset with some model fields (and the global batch) replaced."""
    train = TINY.train if batch is None else dataclasses.replace(TINY.train, batch_size=batch)
    return dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, **model), train=train)


TP8 = cfg(num_heads=8)  # tp over 8 devices needs num_heads % 8 == 0 (head_dim 8)


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("spec, shape", [
    ("data:4,tensor:2", {"data": 4, "tensor": 2}),
    ("tensor:2,data:4", {"data": 4, "tensor": 2}),
    (" data : 8 , tensor : 1 ", {"data": 8, "tensor": 1}),
    ("data:1,tensor:8,", {"data": 1, "tensor": 8}),
])
def test_parse_mesh(spec, shape):
    assert mesh_lib.parse_mesh(spec) == shape


@pytest.mark.parametrize("spec, match", [
    ("data:4", r"mesh 'data:4' lacks axis 'tensor'; name both axes.*e\.g\. data:4,tensor:1"),
    ("tensor:8", r"lacks axis 'data'.*e\.g\. data:1,tensor:8"),
    ("", r"mesh '' lacks axis 'data'.*e\.g\. data:4,tensor:2"),
    ("data:4,pipe:2", r"at 'pipe:2': unknown axis 'pipe' \(the axes are data, tensor\).*e\.g\. data:4,tensor:2"),
    ("data:4,data:2", r"at 'data:2': axis 'data' appears twice.*each axis once"),
    ("data:0,tensor:8", r"at 'data:0': size '0' of axis 'data' is not an integer >= 1.*e\.g\. data:4,tensor:2"),
    ("data:x,tensor:8", r"size 'x' of axis 'data' is not an integer >= 1"),
    ("data:-2,tensor:8", r"size '-2' of axis 'data' is not an integer >= 1"),
    ("data4,tensor:2", r"at 'data4': unknown axis 'data4'.*write it as data:N,tensor:M"),
    ("data=4,tensor=2", r"unknown axis 'data=4'.*write it as data:N,tensor:M"),
])
def test_parse_mesh_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        mesh_lib.parse_mesh(spec)


# ----------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("strategy, shape", [
    ("dp", {"data": 8, "tensor": 1}),
    ("fsdp", {"data": 8, "tensor": 1}),
    ("tp", {"data": 1, "tensor": 8}),
    ("fsdp_tp", {"data": 4, "tensor": 2}),
])
def test_default_mesh_for_8_devices(strategy, shape):
    assert mesh_lib.default_mesh(strategy, 8) == shape
    assert resolve_mesh(strategy, None, TP8, 8) == shape  # the default passes its own validation


@pytest.mark.parametrize("strategy, n, shape", [
    ("fsdp_tp", 6, {"data": 3, "tensor": 2}),
    ("fsdp_tp", 4, {"data": 2, "tensor": 2}),
    ("fsdp_tp", 9, {"data": 3, "tensor": 3}),
    ("tp", 2, {"data": 1, "tensor": 2}),
    ("dp", 2, {"data": 2, "tensor": 1}),
])
def test_default_mesh_other_device_counts(strategy, n, shape):
    assert mesh_lib.default_mesh(strategy, n) == shape


@pytest.mark.parametrize("strategy, spec", [
    ("dp", "data:8,tensor:1"), ("fsdp", "data:8,tensor:1"), ("tp", "data:1,tensor:8"),
    ("fsdp_tp", "data:2,tensor:4"), ("fsdp_tp", "data:4,tensor:2"),
])
def test_valid_meshes_resolve(strategy, spec):
    assert resolve_mesh(strategy, spec, TP8, 8) == mesh_lib.parse_mesh(spec)


# ----------------------------------------------------------------------------- strategy vs mesh


@pytest.mark.parametrize("strategy, spec, match", [
    ("dp", "data:4,tensor:2", r"strategy dp needs tensor = 1, got mesh data:4,tensor:2; try --mesh=data:8,tensor:1"),
    ("dp", "data:1,tensor:8", r"strategy dp needs data > 1, got mesh data:1,tensor:8; try --mesh=data:8,tensor:1"),
    ("fsdp", "data:2,tensor:4", (r"strategy fsdp needs tensor = 1, got mesh data:2,tensor:4; "
                                 r"try --mesh=data:8,tensor:1")),
    ("fsdp", "data:1,tensor:8", r"strategy fsdp needs data > 1.*try --mesh=data:8,tensor:1"),
    ("tp", "data:2,tensor:4", r"strategy tp needs data = 1, got mesh data:2,tensor:4; try --mesh=data:1,tensor:8"),
    ("tp", "data:8,tensor:1", r"strategy tp needs data = 1.*try --mesh=data:1,tensor:8"),
    ("fsdp_tp", "data:8,tensor:1", (r"strategy fsdp_tp needs tensor > 1, got mesh data:8,tensor:1; "
                                    r"try --mesh=data:4,tensor:2")),
    ("fsdp_tp", "data:1,tensor:8", (r"strategy fsdp_tp needs data > 1, got mesh data:1,tensor:8; "
                                    r"try --mesh=data:4,tensor:2")),
])
def test_strategy_needs_its_axes(strategy, spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_mesh(strategy, spec, TP8, 8)


def test_tp_needs_tensor_above_one():
    # Only reachable on one device (data must be 1): no valid mesh exists there.
    with pytest.raises(ValueError, match=r"strategy tp needs tensor > 1, got mesh data:1,tensor:1; "
                                         r"strategy tp needs at least 2 devices, have 1; run on more devices "
                                         r"or use the single-device runner"):
        resolve_mesh("tp", "data:1,tensor:1", TINY, 1)


@pytest.mark.parametrize("strategy, n, match", [
    ("fsdp_tp", 7, (r"strategy fsdp_tp needs data > 1, got mesh data:1,tensor:7; strategy fsdp_tp needs a device "
                    r"count with a factor pair data, tensor > 1 \(4, 6, 8, \.\.\.\), have 7; run on more devices "
                    r"or use strategy dp or fsdp or tp")),
    ("fsdp_tp", 2, r"needs data > 1.*have 2; run on more devices or use strategy dp or fsdp or tp"),
    ("dp", 1, (r"strategy dp needs data > 1, got mesh data:1,tensor:1; strategy dp needs at least 2 devices, "
               r"have 1; run on more devices or use the single-device runner")),
])
def test_default_mesh_impossible_on_this_device_count(strategy, n, match):
    # The default mesh is invalid here, so the message must not suggest it.
    with pytest.raises(ValueError, match=match) as err:
        resolve_mesh(strategy, None, TINY, n)
    assert "try --mesh" not in str(err.value)


@pytest.mark.parametrize("strategy, spec, match", [
    ("dp", "data:4,tensor:1", r"mesh data:4,tensor:1 has 4 devices but 8 are available; try --mesh=data:8,tensor:1"),
    ("dp", "data:16,tensor:1", r"mesh data:16,tensor:1 has 16 devices but 8 are available; try --mesh=data:8,tensor:1"),
    ("tp", "data:1,tensor:4", r"has 4 devices but 8 are available; try --mesh=data:1,tensor:8"),
    ("fsdp_tp", "data:4,tensor:4", (r"mesh data:4,tensor:4 has 16 devices but 8 are available; "
                                    r"try --mesh=data:4,tensor:2")),
])
def test_mesh_must_use_every_device(strategy, spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_mesh(strategy, spec, TP8, 8)


@pytest.mark.parametrize("shape, match", [
    ({"data": 8}, (r"mesh \{'data': 8\} lacks axis 'tensor'; name both axes \(size 1 allowed\); "
                   r"try --mesh=data:8,tensor:1")),
    ({"data": 4, "tensor": 1, "pipeline": 2},
     r"has axis 'pipeline', not one of data, tensor.*try --mesh=data:8,tensor:1"),
    ({"data": 0, "tensor": 1}, r"mesh axis data=0 must be an integer >= 1; try --mesh=data:8,tensor:1"),
    ({"data": 8.0, "tensor": 1}, r"mesh axis data=8\.0 must be an integer >= 1"),
])
def test_check_mesh_needs_both_axes_as_positive_integers(shape, match):
    with pytest.raises(ValueError, match=match):
        mesh_lib.check_mesh("dp", shape, 8)


@pytest.mark.parametrize("call", [
    lambda: resolve_mesh("zero3", None, TINY, 8),
    lambda: resolve_mesh("zero3", "data:8,tensor:1", TINY, 8),
    lambda: mesh_lib.default_mesh("zero3", 8),
    lambda: mesh_lib.check_mesh("DP", {"data": 8, "tensor": 1}, 8),
])
def test_unknown_strategy(call):
    with pytest.raises(ValueError, match=r"unknown strategy '(zero3|DP)'; choose one of single, dp, fsdp, tp, fsdp_tp"):
        call()


# ----------------------------------------------------------------------------- divisibility


NO_MESH = r"no mesh on {n} devices splits this model for this strategy; run on {k}: --devices={k} --mesh={mesh}"


def rules(strategy: str) -> dict[str, str]:
    decl = strategies.get(strategy)
    return {**decl.params, **decl.activations}


@pytest.mark.parametrize("strategy, spec, n, config, match", [
    # heads over tensor (tiny has 4 heads; tp takes all 8 devices, so no tp mesh on 8 fits)
    ("tp", None, 8, TINY,
     r"heads=4 is not divisible by mesh axis tensor=8 \(or make heads \(num_heads\) a multiple of 8\); "
     + NO_MESH.format(n=8, k=4, mesh="data:1,tensor:4")),
    ("fsdp_tp", "data:1,tensor:8", 8, TINY, r"needs data > 1.*try --mesh=data:4,tensor:2"),  # axis rule first
    ("fsdp_tp", "data:2,tensor:4", 8, cfg(num_heads=2),
     r"heads=2 is not divisible by mesh axis tensor=4 \(or make heads \(num_heads\) a multiple of 4\); "
     r"try --mesh=data:4,tensor:2\.$"),
    # d_ff over tensor
    ("tp", None, 8, cfg(num_heads=8, d_ff=196),
     r"mlp=196 is not divisible by mesh axis tensor=8 \(or make mlp \(d_ff\) a multiple of 8\); "
     + NO_MESH.format(n=8, k=4, mesh="data:1,tensor:4")),
    # the padded vocab (257 -> 384 = 3 * 128) over tensor: 5 devices, heads and d_ff divisible by 5
    # (and by no tensor size from 2 to 4, so no smaller device count helps)
    ("tp", None, 5, cfg(d_model=80, num_heads=5, d_ff=320),
     r"vocab=384 is not divisible by mesh axis tensor=5 \(or pick a vocab_size whose padded size \(a multiple "
     r"of 128\) is a multiple of 5\); no mesh on 5 or fewer devices splits this model for this strategy\.$"),
    # d_model over data (FSDP shards the embed dimension): 6 devices, batch 12, d_model 64
    ("fsdp", None, 6, cfg(batch=12),
     r"embed=64 is not divisible by mesh axis data=6 \(or make embed \(d_model\) a multiple of 6\); "
     + NO_MESH.format(n=6, k=4, mesh="data:4,tensor:1")),
    ("fsdp_tp", "data:3,tensor:2", 6, cfg(batch=12),
     r"embed=64 is not divisible by mesh axis data=3 .*; " + NO_MESH.format(n=6, k=4, mesh="data:2,tensor:2")),
    # global batch over data (the flag that sets it is named)
    ("dp", "data:3,tensor:1", 3, TINY,
     r"batch=8 is not divisible by mesh axis data=3 \(or make batch \(--batch_size\) a multiple of 3\); "
     + NO_MESH.format(n=3, k=2, mesh="data:2,tensor:1")),
    ("fsdp", None, 16, TINY, r"batch=8 is not divisible by mesh axis data=16 .*; "
     + NO_MESH.format(n=16, k=8, mesh="data:8,tensor:1")),
    ("fsdp_tp", "data:2,tensor:2", 4, cfg(batch=7),
     r"batch=7 is not divisible by mesh axis data=2 \(or make batch \(--batch_size\) a multiple of 2\); "
     r"no mesh on 4 or fewer devices splits this model for this strategy\.$"),
])
def test_split_dimensions_must_divide(strategy, spec, n, config, match):
    with pytest.raises(ValueError, match=match):
        mesh_lib.resolve(strategy, spec, logical_dims(config), rules(strategy), n)
    with pytest.raises(ValueError):  # the twins' own check refuses it too
        resolve_mesh(strategy, spec, config, n)


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "tp", "fsdp_tp"])
@pytest.mark.parametrize("config", [TINY, cfg(num_heads=2), cfg(d_model=96, num_heads=12), cfg(batch=12)])
@pytest.mark.parametrize("spec, n", [(None, 8), ("data:1,tensor:4", 8), ("data:2,tensor:4", 8), (None, 6),
                                     ("data:8,tensor:1", 8), (None, 5)])
def test_mesh_advice_resolves_in_one_step(strategy, config, spec, n):
    """Whatever the error advises (a --mesh, or --devices with a --mesh) passes every check."""
    dims, r = logical_dims(config), rules(strategy)
    try:
        mesh_lib.resolve(strategy, spec, dims, r, n)
        return
    except ValueError as e:
        message = str(e)
    found = re.search(r"(?:--devices=(\d+) )?--mesh=([a-z0-9:,]+[0-9])", message)
    if found is None:
        assert "no mesh on" in message, message
        return
    k = int(found.group(1) or n)
    shape = mesh_lib.resolve(strategy, found.group(2), dims, r, k)
    assert resolve_mesh(strategy, found.group(2), config, k) == shape
    assert k <= n and shape == mesh_lib.parse_mesh(found.group(2))


def test_mesh_on_fewer_devices_advises_the_device_count():
    # README: `compare --strategy=tp --mesh=data:1,tensor:4` on 8 devices must not advise tensor:8 (4 heads)
    with pytest.raises(ValueError, match=r"has 4 devices but 8 are available; no mesh on 8 devices .* "
                                         r"run on 4: --devices=4 --mesh=data:1,tensor:4"):
        mesh_lib.resolve("tp", "data:1,tensor:4", logical_dims(TINY), rules("tp"), 8)
    with pytest.raises(ValueError, match=r"try --mesh=data:1,tensor:8 to use all 8, or run this mesh on 4 "
                                         r"devices \(--devices=4\)"):
        mesh_lib.check_mesh("tp", {"data": 1, "tensor": 4}, 8)


@pytest.mark.parametrize("bad", [None, 8, ["data:8"], b"data:8,tensor:1"])
def test_parse_mesh_rejects_non_strings(bad):
    with pytest.raises(ValueError, match=r"mesh spec must be a string such as 'data:4,tensor:2'"):
        mesh_lib.parse_mesh(bad)


@pytest.mark.parametrize("call, match", [
    (lambda: mesh_lib.default_mesh("dp", 0), r"device count 0 must be an integer >= 1"),
    (lambda: mesh_lib.default_mesh("dp", 2.0), r"device count 2\.0 must be an integer >= 1"),
    (lambda: mesh_lib.check_mesh("dp", "data:8,tensor:1", 8), r"is not a mapping of axis name to size"),
    (lambda: mesh_lib.check_mesh("dp", {"data": True, "tensor": 1}, 1), r"mesh axis data=True must be an integer"),
    (lambda: mesh_lib.check_mesh("dp", {"data": 8, "tensor": 1}, None), r"device count None must be"),
])
def test_bad_inputs_are_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_unsplit_dimensions_need_not_divide():
    # dp splits only the batch (d_model 36, 1 head, d_ff 100 on 8 devices); tp splits no batch.
    assert resolve_mesh("dp", None, cfg(d_model=36, num_heads=1, d_ff=100), 8) == {"data": 8, "tensor": 1}
    assert resolve_mesh("tp", None, cfg(batch=3, num_heads=8), 8) == {"data": 1, "tensor": 8}


def test_prime_dimension_offers_only_the_config_fix():
    with pytest.raises(ValueError, match=r"heads=1 is not divisible by mesh axis tensor=2; no mesh on 2 or fewer "
                                         r"devices splits this model for this strategy, or make heads \(num_heads\) "
                                         r"a multiple of 2\.$"):
        mesh_lib.check_divisible({"heads": 1}, {"heads": "tensor"}, {"data": 1, "tensor": 2})


# ----------------------------------------------------------------------------- the newer strategies' axes


@pytest.mark.parametrize("strategy, spec, shape", [
    ("tp", "tensor:2", {"data": 1, "tensor": 2}),
    ("dp", "data:8", {"data": 8, "tensor": 1}),
    ("fsdp", "data:8", {"data": 8, "tensor": 1}),
    ("ep", "expert:8", {"data": 1, "expert": 8}),
    ("pp", "stage:4", {"stage": 4, "data": 1, "tensor": 1}),
    ("pp_fsdp", "data:2, stage:4", {"stage": 4, "data": 2, "tensor": 1}),
    ("tp_sp", "tensor:8", {"data": 1, "tensor": 8}),
    ("tp_sp", "data:2,tensor:4", {"data": 2, "tensor": 4}),
    ("cp", "context:8", {"data": 1, "context": 8, "tensor": 1}),
    ("fsdp_cp", "context:2,data:4", {"data": 4, "context": 2, "tensor": 1}),
])
def test_newer_strategies_name_only_the_axes_they_split(strategy, spec, shape):
    assert mesh_lib.parse_mesh(spec, strategy) == shape
    assert list(mesh_lib.make_mesh(shape, devices=jax.devices()[:math.prod(shape.values())]).axis_names) == \
        [a for a in mesh_lib.ORDER if a in shape]  # mesh order: stage, data, context, tensor


@pytest.mark.parametrize("strategy, default", [
    ("pp", "stage:8"), ("pp_fsdp", "stage:4,data:2"), ("tp_sp", "data:1,tensor:8"),
    ("cp", "context:8"), ("fsdp_cp", "data:4,context:2"),
])
def test_newer_strategies_default_meshes(strategy, default):
    assert mesh_lib.default_mesh(strategy, 8) == mesh_lib.parse_mesh(default, strategy)
    mesh_lib.check_mesh(strategy, mesh_lib.default_mesh(strategy, 8), 8)


def test_a_mesh_may_omit_any_axis_of_size_one():
    """Every strategy's mesh string names only the axes it splits; the launchers resolve it so."""
    assert resolve_mesh("tp", "tensor:8", TP8, 8) == {"data": 1, "tensor": 8}
    assert resolve_mesh("fsdp", "data:8", TP8, 8) == {"data": 8, "tensor": 1}
    for name in strategies.NAMES:
        shape = mesh_lib.default_mesh(name, 8)
        split = ",".join(f"{a}:{n}" for a, n in shape.items() if n > 1)
        assert mesh_lib.parse_mesh(split, name) == shape, name


@pytest.mark.parametrize("strategy, spec, match", [
    ("tp", "tensor:4", r"mesh data:1,tensor:4 has 4 devices but 8 are available"),
    ("dp", "tensor:8", r"mesh 'tensor:8' lacks axis 'data', which strategy dp splits; e\.g\. data:8,tensor:1"),
    ("fsdp_tp", "data:8", r"mesh 'data:8' lacks axis 'tensor', which strategy fsdp_tp splits; e\.g\. data:4,tensor:2"),
    ("tp", "context:8", r"unknown axis 'context' \(the axes of strategy tp are data, tensor\)"),
    ("pp", "data:8", r"mesh 'data:8' lacks axis 'stage', which strategy pp splits; e\.g\. stage:8"),
    ("cp", "context:4,tensor:2", r"strategy cp needs tensor = 1, got mesh context:4,tensor:2; try --mesh=context:8"),
    ("fsdp_cp", "context:8", r"mesh 'context:8' lacks axis 'data', which strategy fsdp_cp splits; "
                             r"e\.g\. data:4,context:2"),
    ("fsdp_cp", "data:1,context:8", r"strategy fsdp_cp needs data > 1, got mesh data:1,context:8; "
                                    r"try --mesh=data:4,context:2"),
    ("pp", "stage:2", r"mesh stage:2 has 2 devices but 8 are available; try --mesh=stage:8"),
])
def test_newer_strategies_mesh_errors(strategy, spec, match):
    with pytest.raises(ValueError, match=match):
        mesh_lib.check_mesh(strategy, mesh_lib.parse_mesh(spec, strategy), 8)
