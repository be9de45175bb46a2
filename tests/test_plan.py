"""launch.plan and twinshard/hardware/ (links.py, plan.py): topologies, the links each mesh axis
uses, one plan row by hand, the memory check, the ranking, docs/multi-host.md's launch lines, and
the CLI (one run and its one-line errors).

Nothing is compiled here (a --compile of the tiny preset runs in
test_compile_refines_the_top_plans_with_the_compiled_step, ~20 s: it reuses launch.collectives,
which tests/test_tpu_topology.py checks in depth).
"""

import dataclasses
import itertools
import json
import math
import re
from collections import defaultdict

import numpy as np
import pytest

from cli import ROOT, assert_user_error, run
from launch import common, plan as planner
from twinshard.hardware import plan as plans_lib
from twinshard.hardware import links as hardware_links
from twinshard.hardware import chips
from twinshard import cost
from twinshard.config import Config, preset
from twinshard.parallel import resolve

LLM_1B = preset("llm_1b").model
MIXTRAL = preset("mixtral_8x7b").model  # bfloat16


def test_topologies_parse_as_gcloud_and_slurm_write_them():
    v5p = hardware_links.parse_topology("v5p:4x4x4")
    assert (v5p.chips, v5p.grid, v5p.torus, v5p.chip.name) == (64, (4, 4, 4), True, "v5p")
    v5e = hardware_links.parse_topology("v5e:16x16")
    assert (v5e.chips, v5e.torus) == (256, True)
    v4 = hardware_links.parse_topology("v4:2x2x4")  # less than a 4x4x4 cube: no wraparound links
    assert (v4.chips, v4.torus, v4.chip.ici_links) == (16, False, 6)
    # v5e, v6e wrap each side of 16 on its own (no optical switches); v4, v5p wrap whole cubes only
    v5e_8x16 = hardware_links.parse_topology("v5e:8x16")
    assert (v5e_8x16.wraps, v5e_8x16.torus) == ((False, True), False)
    assert v5e_8x16.describe() == "v5e:8x16 = 128 TPU v5e chips (wraparound on y only)"
    assert hardware_links.parse_topology("v6e:16x4").wraps == (True, False)
    assert v4.wraps == (False, False, False) and hardware_links.parse_topology("v5p:2x4x4").wraps == (False,) * 3
    assert hardware_links.parse_topology("v5p:4x8x12").wraps == (True,) * 3
    h100 = hardware_links.parse_topology("H100:8x8")
    assert (h100.name, h100.chips, h100.grid, h100.chip.gpus_per_node) == ("h100:8x8", 64, (8, 8), 8)
    assert hardware_links.parse_topology("h200:1x8").chip.hbm_bytes == 141 * 2**30


@pytest.mark.parametrize("text, needle", [
    ("x100:8x8", "unknown chip 'x100'; choose one of h200, h100, a100, v4, v5e, v5p, v6e"),
    ("v5p", "shape '' is not sizes >= 1 joined by 'x'"),
    ("v5p:4x4x", "shape '4x4x' is not sizes >= 1 joined by 'x'"),
    ("v5e:0x4", "shape '0x4' is not sizes"),
    ("v5p:4x4", "v5p slices are 3-D (AxBxC, e.g. 4x4x4)"),
    ("v5e:4x4x4", "v5e slices are 2-D (AxB, e.g. 4x4)"),
    ("v5e:32x16", "32x16 does not fit in a v5e pod (16x16 = 256 chips)"),
    ("v5p:16x20x32", "16x20x32 does not fit in a v5p pod (16x20x28 = 8960 chips)"),
    ("v4:8x8x32", "8x8x32 does not fit in a v4 pod (16x16x16 = 4096 chips)"),
    ("h100:2x16", "16 GPUs per node; an HGX H100 node has 8"),
    ("h100:8", "a GPU cluster is NODESxGPUS"),
    ("v5e:1x1", "one chip needs no parallelism plan"),
])
def test_bad_topologies_are_one_line_errors(text, needle):
    with pytest.raises(ValueError) as e:
        hardware_links.parse_topology(text)
    assert str(e.value).startswith(f"--topology={text}: ") and needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("headroom", [0.25, 0.9999])
@pytest.mark.parametrize("with_pipelines", [True, False])
def test_the_report_says_no_plan_fits_exactly_when_none_does(headroom, with_pipelines):
    """Whether a plan fits and whether a pipeline plan exists are two questions: tiny on v5e:2x2 fits every
    plan at the default headroom and none with 0.01% of HBM usable (--hbm_headroom=0.9999: 1.7 MB a chip), with
    its pp and pp_fsdp plans kept or filtered out. The report says "no plan fits" when no plan
    fits, whatever the pipelines, and shows the pipeline schedules when a pipeline plan exists, fitting or not."""
    topo, cfg = hardware_links.parse_topology("v5e:2x2"), preset("tiny")
    plans, skipped = plans_lib.plan_all(cfg.model, topo, cfg.train.batch_size, headroom=headroom)
    kept = [p for p in plans if with_pipelines or p.strategy not in cost.PIPELINES]
    fit, over = plans_lib.rank(kept, "serial")
    assert (len(fit), len(over)) == ((len(kept), 0) if headroom == 0.25 else (0, len(kept)))
    assert any(p.strategy in cost.PIPELINES for p in kept) == with_pipelines
    text = planner.report(fit, over, skipped, topo, "tiny", cfg, 3, 1.0, headroom, "serial")
    assert ("== no plan fits in memory" in text) == (not fit), text
    assert ("== pipeline schedules on" in text) == with_pipelines, text


def test_any_slice_of_the_pod_plans_with_a_note_above_googles_largest_job():
    """v5p slices up to the whole 16x20x28 pod (8960 chips, in any orientation), beyond the 6144 chips
    Google schedules as one slice: planned, and the report says so."""
    for name in ("v5p:16x20x28", "v5p:28x16x20", "v5p:16x16x24"):
        topo = hardware_links.parse_topology(name)
        assert topo.torus and topo.chips == (6144 if name.endswith("24") else 8960)
    topo = hardware_links.parse_topology("v5p:16x20x28")
    cfg = dataclasses.replace(preset("llm_1b"), train=dataclasses.replace(preset("llm_1b").train, batch_size=8960))
    plans, skipped = plans_lib.plan_all(cfg.model, topo, 8960)
    fit, over = plans_lib.rank(plans, "serial")
    assert ("dp", {"data": 8960, "tensor": 1}) in [(p.strategy, p.mesh) for p in fit]
    text = planner.report(fit, over, skipped, topo, "llm_1b", cfg, 3, 1.0, 0.25, "serial")
    assert "NOTE: 8960 chips is more than the largest single-slice job Google schedules on v5p (6144 chips)" in text
    small = hardware_links.parse_topology("v5p:16x16x24")
    plans, skipped = plans_lib.plan_all(cfg.model, small, 6144)
    assert "largest single-slice job" not in planner.report(*plans_lib.rank(plans, "serial"), skipped, small, "llm_1b",
                                                            cfg, 3, 1.0, 0.25, "serial")


def test_fsdp_splits_weights_flat_where_data_does_not_divide_d_model():
    """Llama-3-70B on a 6144-chip v5p slice (16x16x24) with 1536 sequences: data:1536 = 3 x 512
    divides none of its weights' dims (8192, 28672, 1024, 128256), so no mesh split d_model
    and no plan fit. ZeRO-3 needs 1/data of each weight per chip, not a slice of d_model: split
    flat (padded under data elements per weight), each chip holds N_matrices/(data x tensor)
    matrix parameters and the replicated norm gains. launch.train's twins split d_model evenly and
    refuse the mesh, so the report's launch line is the best plan they run (tp_sp, whose data axis
    splits no weight)."""
    cfg = dataclasses.replace(preset("llama3_70b").model, context_length=4096, remat="full")
    topo = hardware_links.parse_topology("v5p:16x16x24")
    plans, skipped = plans_lib.plan_all(cfg, topo, 1536)
    fit, over = plans_lib.rank(plans, "serial")
    assert [(p.strategy, p.label()) for p in fit] == [
        ("fsdp_tp", "data:1536,tensor:4 flat"), ("fsdp_tp_sp", "data:1536,tensor:4 flat"),
        ("fsdp_cp", "data:1536,context:4 flat"), ("fsdp_cp", "data:768,context:8 flat"),
        ("fsdp_ulysses", "data:1536,context:4 flat"), ("fsdp_ulysses", "data:768,context:8 flat"),
        ("fsdp_tp", "data:768,tensor:8 flat"), ("fsdp_tp", "data:384,tensor:16 flat"),
        ("fsdp_tp_sp", "data:768,tensor:8 flat"), ("fsdp_cp", "data:384,context:16 flat"),
        ("fsdp_tp_sp", "data:384,tensor:16 flat"), ("fsdp_ulysses", "data:384,context:16 flat"),
        ("fsdp_ulysses", "data:192,context:32 flat"), ("fsdp_cp", "data:192,context:32 flat"),
        ("fsdp_ulysses", "data:96,context:64 flat"), ("fsdp_tp_sp", "data:192,tensor:32 flat"),
        ("tp_sp", "data:192,tensor:32"), ("fsdp_tp_sp", "data:96,tensor:64 flat"), ("tp_sp", "data:96,tensor:64")]
    assert all(p.flat == ("embed" in cost.RULES[p.strategy]) for p in plans)
    best, norms = fit[0], (2 * cfg.num_layers + 1) * cfg.d_model
    # (each weight's bytes // chips: under 4 bytes short of the exact share, 12 leaves)
    assert best.cost.memory.params == pytest.approx(4 * ((cfg.num_params() - norms) / 6144 + norms), abs=4 * 12)
    # the gathers and scatters move what an even split would: (d-1)/d x 3 x each bf16 matrix's tensor
    # shard (2 gathers, 1 scatter; the embedding is not re-gathered), and the norm gains' f32 means
    V, D, L, F, kv = cfg.padded_vocab_size, cfg.d_model, cfg.num_layers, cfg.d_ff, 8 * 128
    shards = (L * (2 * D * D + 2 * D * kv + 3 * D * F) + V * D) * 2 / 4  # all matrices but the embedding, bf16, / t
    fsdp = 1535 / 1536 * (3 * shards + 2 * V * D * 2 / 4) + 2 * 1535 / 1536 * 4 * (norms + 1)
    data = sum(r.ring_bytes for r in best.cost.collectives if r.axes == ("data",))
    assert data == pytest.approx(fsdp, rel=1e-5)  # each scattered shard's bytes // data: under a byte short
    with pytest.raises(ValueError, match="embed=8192 is not divisible by mesh axis data=1536"):
        resolve.resolve_mesh("fsdp_tp", "data:1536,tensor:4", plans_lib.train_config(cfg, 1536), 6144)
    text = planner.report(fit, over, skipped, topo, "llm_1b", Config(cfg, preset("llm_1b").train), 3, 1.0, 0.25,
                          "serial")
    assert "NOTE: 'flat' plans split FSDP's weights flat" in text
    assert "== run the best plan launch.train runs (tp_sp data:192,tensor:32):" in text
    assert "--strategy=tp_sp --impl=manual --mesh=data:192,tensor:32" in text


def test_tensor_gets_the_physical_axes_jax_gives_it():
    """Our layout rule against jax's own (mesh_utils, used by jax.make_mesh and
    twinshard.hardware.topology.mesh_devices on a TPU slice) for every (data, tensor) on 15 grids."""
    from jax._src import mesh_utils  # private: the function that assigns mesh axes to the torus

    grids = [(4, 4, 4), (2, 2, 4), (2, 2, 1), (2, 2, 2), (2, 4, 4), (4, 4, 8), (4, 8, 8), (8, 8, 16),
             (16, 16), (4, 4), (2, 4), (4, 8), (8, 16), (8, 8), (16, 16, 24)]
    for grid in grids:
        n = math.prod(grid)
        for t in (k for k in range(1, n + 1) if n % k == 0):
            _, assignment = mesh_utils._create_device_mesh_for_nd_torus(
                np.arange(n).reshape(grid), (n // t, t), allow_split_physical_axes=True)
            assert hardware_links.tensor_sides(grid, t) == tuple(int(a) for a in assignment[:, 1]), (grid, t)


def test_links_per_axis():
    gb = 1e9
    links = hardware_links.axis_links(hardware_links.parse_topology("v5p:4x4x4"), {"data": 16, "tensor": 4})
    assert links["tensor"].bytes_per_s == 2 * 90 * gb  # x, a whole torus side: both directions
    assert links["data"].bytes_per_s == 4 * 90 * gb  # y and z
    links = hardware_links.axis_links(hardware_links.parse_topology("v5p:4x4x4"), {"data": 32, "tensor": 2})
    assert links["tensor"].bytes_per_s == 90 * gb  # 2 of x's 4 chips: the ring folds back
    assert links["data"].bytes_per_s == 6 * 90 * gb  # strided over the whole of x, and y, z
    links = hardware_links.axis_links(hardware_links.parse_topology("v4:2x2x4"), {"data": 4, "tensor": 4})
    assert (links["tensor"].bytes_per_s, links["data"].bytes_per_s) == (2 * 45 * gb, 45 * gb)  # no torus
    # v5e:8x16: tensor on x, a side of 8 without wraparound (a line: 1 x); data on y, the side of 16
    # that wraps on its own (a ring: 2 x)
    links = hardware_links.axis_links(hardware_links.parse_topology("v5e:8x16"), {"data": 16, "tensor": 8})
    assert (links["tensor"].bytes_per_s, links["data"].bytes_per_s) == (45 * gb, 2 * 45 * gb)
    # GPU: a hierarchical ring, NVLink in a node and each GPU's own NIC across nodes, overlapped:
    # per byte of the array max((g-1)/(g 450 GB/s), (k-1)/(k g 50 GB/s)) for g GPUs in each of k nodes,
    # = ((n-1)/n) / bytes_per_s in the ledger's ring bytes
    links = hardware_links.axis_links(hardware_links.parse_topology("h100:8x8"), {"data": 16, "tensor": 4})
    assert links["tensor"].bytes_per_s == 450 * gb  # in a node
    assert links["data"].bytes_per_s == pytest.approx((15 / 16) / max(1 / 2 / (450 * gb), 7 / 8 / (2 * 50 * gb)))
    links = hardware_links.axis_links(hardware_links.parse_topology("h100:2x8"), {"data": 1, "tensor": 16})
    assert set(links) == {"tensor"}  # tensor across 2 nodes: NVLink's 7/8 sets the time, not the network's 1/2
    assert links["tensor"].bytes_per_s == pytest.approx((15 / 16) / max(7 / 8 / (450 * gb), 1 / 2 / (8 * 50 * gb)))
    # data:64 over 8 nodes: 7/8 of each byte through a node's 8 x 50 GB/s = 400 GB/s egress (the
    # scaling book's cross-node AllGather: bytes / W_node egress), not through one GPU's 50 GB/s
    links = hardware_links.axis_links(hardware_links.parse_topology("h100:8x8"), {"data": 64, "tensor": 1})
    assert links["data"].bytes_per_s == pytest.approx(63 / 64 / (7 / 8 / (400 * gb)), rel=1e-12)  # = 450 GB/s
    links = hardware_links.axis_links(hardware_links.parse_topology("h100:8x8"), {"data": 8, "tensor": 8})
    assert links["data"].bytes_per_s == pytest.approx(50 * gb, rel=1e-12)  # one GPU per node: its own NIC
    links = hardware_links.axis_links(hardware_links.parse_topology("h200:1x8"), {"data": 8, "tensor": 1})
    assert links["data"].bytes_per_s == 450 * gb  # one node: data on NVLink too


def test_the_inner_split_axis_gets_the_closest_chips_as_tensor_does():
    """jax.make_mesh on a mesh whose last split axis is expert (fsdp_ep's (data, expert, tensor 1); ep's
    (data, expert) is the (data, tensor) case above), context (fsdp_cp's (data, context, tensor 1)) or
    data (pp_fsdp's (stage, data, tensor 1)) gives it the physical axes it gives tensor of (data,
    tensor), the outer axis the rest, and so do the links."""
    from jax._src import mesh_utils

    for name in ("v5p:4x4x4", "v4:2x2x4", "v5p:4x4x8", "v5e:16x16", "v5e:4x8"):
        topo = hardware_links.parse_topology(name)
        n = topo.chips
        for e in (k for k in range(2, n + 1) if n % k == 0):
            _, assignment = mesh_utils._create_device_mesh_for_nd_torus(
                np.arange(n).reshape(topo.grid), (n // e, e, 1), allow_split_physical_axes=True)
            assert hardware_links.tensor_sides(topo.grid, e) == tuple(int(a) for a in assignment[:, 1]), (name, e)
            dense = hardware_links.axis_links(topo, {"data": n // e, "tensor": e})
            for outer, inner, mesh in (("data", "expert", {"data": n // e, "expert": e}),
                                       ("data", "expert", {"data": n // e, "expert": e, "tensor": 1}),
                                       ("data", "context", {"data": n // e, "context": e, "tensor": 1}),
                                       ("stage", "data", {"stage": n // e, "data": e, "tensor": 1})):
                assert hardware_links.axis_links(topo, mesh) == {
                    {"tensor": inner, "data": outer}[a]: link for a, link in dense.items()}, (name, mesh)


@pytest.mark.parametrize("topology, mesh, gb_s, factor", [
    # one physical axis of n chips: the mean hops n^2 / (4 (n - 1)) (even n)
    ("v5p:4x4x4", {"data": 16, "expert": 4}, 180, 16 / 12),  # x, a torus ring of 4: 4/3
    ("v5p:4x4x8", {"data": 16, "expert": 8}, 180, 64 / 28),  # z, a torus ring of 8: 16/7
    ("v5p:4x4x4", {"data": 32, "expert": 2}, 90, 1.0),  # 2 of x's 4 chips: one link, one hop
    ("v5e:16x16", {"data": 32, "expert": 8}, 45, 64 / 28),  # 8 of x's 16, a line: its middle link B 8/4 at 1 x
    ("v5e:2x3", {"data": 2, "expert": 3}, 45, 1.0),  # a line of 3: (n + 1)/4; each link carries 2B/3 = the ring bytes
    # several physical axes, each its own all-to-all at once: max_i [n_i^2/4 / (n_i k_i)] x K N / (N - 1)
    ("v5p:4x4x4", {"data": 4, "expert": 16}, 360, 0.5 * 4 * 16 / 15),  # x and y rings of 4: B/2 per link each
    ("v5p:4x4x4", {"data": 8, "expert": 8, "tensor": 1}, 270, 0.5 * 3 * 8 / 7),  # x ring of 4, 2 chips of y
    ("v4:2x2x4", {"data": 4, "expert": 4}, 90, 0.5 * 2 * 4 / 3),  # x and y, 2 chips each, no wraparound
    ("v5p:4x4x8", {"data": 4, "expert": 32}, 360, 1.0 * 4 * 32 / 31),  # rings of 4 (B/2) and 8 (B): z sets it
    ("v5e:16x16", {"data": 8, "expert": 32}, 135, 2.0 * 3 * 32 / 31),  # x's ring of 16 (2B), 2 chips of y (B/2)
    # a GPU's all-to-all inside a node leaves through its own NVLink port once: switched, factor 1
    ("h100:2x8", {"data": 2, "expert": 8, "tensor": 1}, 450, 1.0),
    # over 2 nodes: half of each GPU's B bytes goes to the other node through its 50 GB/s NIC, B/2 / 50e9
    # seconds, against the ring bytes' 15/16 B at the hierarchical ring's rate (NVLink-bound: 15/16 / (7/8 / 450))
    ("h100:2x8", {"data": 1, "expert": 16}, 15 / 16 / (7 / 8 / 450), (1 / 2 / 50) / (7 / 8 / 450)),
])
def test_the_all_to_all_factor_by_hand(topology, mesh, gb_s, factor):
    link = hardware_links.axis_links(hardware_links.parse_topology(topology), mesh)["expert"]
    assert link.bytes_per_s == pytest.approx(gb_s * 1e9, rel=1e-12)
    assert link.all_to_all == pytest.approx(factor, rel=1e-12)


def _busiest_link(sides: tuple[int, ...], wraps: tuple[bool, ...]) -> float:
    """Bytes on the busiest one-way link when each of the N chips of a sides[0] x sides[1] ... grid
    sends 1/N byte to every chip, routed one physical axis after another along a shortest path
    (a tie split between the two directions); an axis wraps around (a torus ring) or not (a line)."""
    n_all, load = math.prod(sides), defaultdict(float)
    for src, dst in itertools.product(itertools.product(*map(range, sides)), repeat=2):
        at = list(src)
        for i, (n, wrap) in enumerate(zip(sides, wraps)):
            ahead = (dst[i] - at[i]) % n if wrap else dst[i] - at[i]
            if wrap:
                routes = [(1, ahead), (-1, n - ahead)] if 2 * ahead == n else \
                    [(1, ahead)] if 2 * ahead < n else [(-1, n - ahead)]
            else:
                routes = [(1 if ahead > 0 else -1, abs(ahead))]
            for step, hops in routes:
                pos = at[i]
                for _ in range(hops):
                    load[(i, tuple(at[:i]), pos, step, tuple(at[i + 1:]))] += 1 / n_all / len(routes)
                    pos = (pos + step) % n
            at[i] = dst[i]
    return max(load.values())


@pytest.mark.parametrize("topology, expert, sides, wraps", [
    ("v5p:4x4x4", 4, (4,), (True,)), ("v5p:4x4x8", 8, (8,), (True,)), ("v5p:4x4x12", 12, (12,), (True,)),
    ("v5p:4x4x4", 2, (2,), (False,)), ("v5e:8x16", 8, (8,), (False,)), ("v5e:4x5", 5, (5,), (False,)),
    ("v5p:4x4x4", 16, (4, 4), (True, True)), ("v5p:4x4x4", 8, (4, 2), (True, False)),
    ("v5p:4x4x4", 32, (4, 4, 2), (True, True, False)), ("v4:2x2x4", 4, (2, 2), (False, False)),
    ("v5p:4x4x8", 32, (4, 8), (True, True)), ("v5e:16x16", 32, (16, 2), (True, False)),
])
def test_the_all_to_all_time_is_its_busiest_links(topology, expert, sides, wraps):
    """The planner's all-to-all time (ring bytes x factor / bandwidth) against routing every
    message over the chips the expert axis gets, link by link: the busiest link sets the time."""
    topo = hardware_links.parse_topology(topology)
    link = hardware_links.axis_links(topo, {"data": topo.chips // expert, "expert": expert})["expert"]
    one_way = topo.chip.ici_link_bytes_per_s
    planned = (expert - 1) / expert * link.all_to_all / (link.bytes_per_s / one_way)  # B = 1 byte, in 1/one_way
    assert planned == pytest.approx(_busiest_link(sides, wraps), rel=1e-12)


def test_a_tpu_row_by_hand():
    """llm_1b, dp on v5p:4x4x4, float32: every number from the chip table and the model's sizes."""
    v5p = chips.chip("v5p")
    B, T, n = 64, LLM_1B.context_length, 64
    p = plans_lib.evaluate(LLM_1B, hardware_links.parse_topology("v5p:4x4x4"), "dp", {"data": 64, "tensor": 1}, B)
    D, F, V, L, N = LLM_1B.d_model, LLM_1B.d_ff, LLM_1B.padded_vocab_size, LLM_1B.num_layers, LLM_1B.num_params()
    # MFU's FLOPs: causal attention (4 B T^2 D per layer forward: QK^T and PV) counted half
    flops = 3 * (2 * B * T * (L * (4 * D * D + 3 * D * F) + D * V) + L * 4 * B * T * T * D / 2)
    assert p.compute_s == pytest.approx(flops / n / (v5p.bf16 * 1e12))  # f32 on TPU: one bf16 pass
    # one all-reduce of every f32 gradient (N params) and of the f32 loss; the data axis spans
    # x, y and z of a torus: a bidirectional ring on each, 6 x 90 GB/s
    ring = 2 * (n - 1) / n * 4 * (N + 1)
    assert p.comm_s == {"data": pytest.approx(ring / (6 * v5p.ici_link_bytes_per_s)), "tensor": 0.0}
    m = p.cost.memory
    assert (m.params, m.grads, m.optimizer) == (4 * N, 4 * N, 8 * N)
    assert p.memory == 16 * N + m.activations + m.backward_layer and p.hbm_usable == 0.75 * 95 * 2**30 and p.fits
    assert p.serial_s == p.compute_s + p.comm_s["data"] and p.overlap_s == p.compute_s
    assert p.bound == "compute"
    # --optimizer: lion keeps one f32 moment per param (the same cost.memory the tests of twinshard/cost/ check)
    lion = plans_lib.evaluate(LLM_1B, hardware_links.parse_topology("v5p:4x4x4"), "dp", {"data": 64, "tensor": 1}, B,
                            optimizer="lion")
    assert lion.cost.memory.optimizer == 4 * N and lion.memory == p.memory - 4 * N
    # --param_dtype / --optimizer_dtype / --master_weights: mixed precision's bf16 params and gradients
    # (2 + 2 bytes), a float32 master copy (4) and AdamW's float32 moments (8); bf16 moments halve those
    mixed = plans_lib.evaluate(LLM_1B, hardware_links.parse_topology("v5p:4x4x4"), "dp", {"data": 64, "tensor": 1}, B,
                               precision=plans_lib.Precision("bfloat16", "float32", master=True))
    mm = mixed.cost.memory
    assert (mm.params, mm.grads, mm.master, mm.optimizer) == (2 * N, 2 * N, 4 * N, 8 * N)
    assert mixed.memory == p.memory and mm.temporaries == m.temporaries - 2 * N  # 16 bytes either way
    half = plans_lib.evaluate(LLM_1B, hardware_links.parse_topology("v5p:4x4x4"), "dp", {"data": 64, "tensor": 1}, B,
                              precision=plans_lib.Precision("bfloat16", "bfloat16"))
    assert (half.cost.memory.optimizer, half.cost.memory.master, half.memory) == (4 * N, 0, p.memory - 8 * N)


def test_a_gpu_row_by_hand():
    """gpt2_350m in bf16, fsdp_tp data:8 x tensor:8 on 8 H100 nodes: tensor on NVLink, data on IB."""
    cfg = dataclasses.replace(preset("gpt2_350m").model, dtype="bfloat16")
    mesh = {"data": 8, "tensor": 8}
    p = plans_lib.evaluate(cfg, hardware_links.parse_topology("h100:8x8"), "fsdp_tp", mesh, 64)
    c = cost.cost(cfg, "fsdp_tp", mesh, 64)
    ring = {axes: s["ring_bytes"] for axes, s in c.by_axes().items()}
    assert set(ring) == {("data",), ("tensor",), ("data", "tensor")}
    assert p.compute_s == pytest.approx(c.flops.model_per_device / 989.4e12)  # causal attention half
    # the gradient-norm scalar over (data, tensor) goes at the slower axis, the network: a few
    # bytes among megabytes, hence the tight tolerance
    assert p.comm_s["tensor"] == pytest.approx(ring[("tensor",)] / 450e9, rel=1e-12)
    assert p.comm_s["data"] == pytest.approx((ring[("data",)] + ring[("data", "tensor")]) / 50e9, rel=1e-12)
    # float32 runs at JAX's default matmul precision: TF32 on NVIDIA, one bf16 pass on TPU
    assert chips.matmul_peak_flops(chips.chip("H100"), "float32")[0] == 494.7e12
    assert chips.matmul_peak_flops(chips.chip("v5e"), "float32")[0] == 197e12
    assert p.bound == max(("compute", p.compute_s), ("comm data", p.comm_s["data"]),
                          ("comm tensor", p.comm_s["tensor"]), key=lambda kv: kv[1])[0]
    # dp over all 64 GPUs: the gradient all-reduce (N f32 gradients and the loss) as the scaling
    # book's cross-node AllReduce, 2 x (X-1)/X x bytes / W_node egress over X = 8 nodes of 400 GB/s
    dp = plans_lib.evaluate(cfg, hardware_links.parse_topology("h100:8x8"), "dp", {"data": 64, "tensor": 1}, 64)
    assert dp.comm_s["data"] == pytest.approx(2 * 7 / 8 * 4 * (cfg.num_params() + 1) / 400e9, rel=1e-12)


def test_cudnn_flash_attention_keeps_no_t_by_t_array_on_a_gpu():
    """Llama-3-8B (32 query heads and 8 key/value heads, T = 8192, bf16) under remat full on 16 H100
    nodes, fsdp data:128, 4 sequences per GPU. Attention "auto" is cuDNN flash attention there: the backward loop's working
    set is one layer's residuals alone. The recompute kernel (--attention=recompute, or float32 on
    the GPU, or any TPU) adds its recomputed probabilities and their gradient, 2 x [4, 32, 8192, 8192]
    f32 = 64 GiB, which no H100 holds: no fsdp plan fit before (pipelines, on micro-batches, did)."""
    cfg = dataclasses.replace(preset("llama3_8b").model, remat="full")
    topo, mesh, b, T, D, F, H = hardware_links.parse_topology("h100:16x8"), {"data": 128, "tensor": 1}, 4, 8192, 4096, \
        14336, 32
    flash = plans_lib.evaluate(cfg, topo, "fsdp", mesh, 512)
    kv = 8 * 128  # k and v: 8 heads of 128
    residuals = b * T * (6 * D + 3 * D + 2 * kv + 3 * F + 4 + H)  # one layer under remat none (cost/memory.py)
    assert flash.cost.memory.backward_layer == residuals * 2
    recompute = plans_lib.evaluate(dataclasses.replace(cfg, attention="recompute"), topo, "fsdp", mesh, 512)
    t_by_t = 2 * b * H * T * T * 4
    assert recompute.cost.memory.backward_layer == residuals * 2 + t_by_t and t_by_t == 64 * 2**30
    f32 = plans_lib.evaluate(dataclasses.replace(cfg, dtype="float32"), topo, "fsdp", mesh, 512)
    assert f32.cost.memory.backward_layer == residuals * 4 + t_by_t  # cuDNN's flash kernel is bf16/fp16 only
    tpu = plans_lib.evaluate(cfg, hardware_links.parse_topology("v5p:4x4x8"), "fsdp", mesh, 512)
    assert tpu.cost.memory.backward_layer == residuals * 2 + t_by_t
    assert flash.fits and not recompute.fits
    assert ("fsdp", mesh) in [(p.strategy, p.mesh) for p in plans_lib.rank(plans_lib.plan_all(cfg, topo, 512)[0],
                                                                             "serial")[0]]


def test_slices_are_data_parallel_over_the_data_center_network():
    """--slices=2 of v5p:4x4x4, llm_1b, 128 sequences: each slice plans 64 (the same compute, memory and
    ICI times as one slice of batch 64), and every chip all-reduces its gradients with its counterpart
    in the other slice over DCN: 2 (S-1)/S x its gradient bytes at its 50 Gb/s = 6.25 GB/s (Google's
    v5p figure; the scaling book's 25 GB/s per 4-chip host)."""
    one = hardware_links.parse_topology("v5p:4x4x4")
    two = hardware_links.with_slices(one, 2)
    assert two.describe() == "2 slices over DCN, each v5p:4x4x4 = 64 TPU v5p chips (torus)"
    N = LLM_1B.num_params()
    for strategy, grads in (("dp", 4 * N), ("fsdp", None)):
        mesh = {"data": 64, "tensor": 1}
        p, alone = (plans_lib.evaluate(LLM_1B, topo, strategy, mesh, batch) for topo, batch in ((two, 128), (one, 64)))
        grads = grads or alone.cost.memory.grads  # fsdp: this chip's 1/64 of the matrices + the norm gains
        assert p.comm_s["dcn"] == pytest.approx(2 * (2 - 1) / 2 * grads / 6.25e9, rel=1e-12)
        assert (p.compute_s, p.comm_s["data"], p.memory) == (alone.compute_s, alone.comm_s["data"], alone.memory)
        assert p.label() == f"dcn:2 x {alone.mesh_text()}" and not p.runnable
        # bf16 params: the gradients cross DCN in float32 all the same, as they cross the slice's ICI
        bf16 = plans_lib.evaluate(LLM_1B, two, strategy, mesh, 128, precision=plans_lib.Precision("bfloat16"))
        assert bf16.cost.memory.grads * 2 == p.cost.memory.grads
        assert (bf16.comm_s["dcn"], bf16.comm_s["data"]) == (p.comm_s["dcn"], p.comm_s["data"])
    fit, over = plans_lib.rank(plans_lib.plan_all(LLM_1B, two, 128)[0], "serial")
    text = planner.report(fit, over, [], two, "llm_1b", preset("llm_1b"), 3, 1.0, 0.25, "serial")
    assert "comm dcn" in text and "dcn=2: DCN 50 Gb/s per chip = 6.25 GB/s per chip" in text
    assert "a multi-slice run needs its data axis over the slices" in text and "gcloud" not in text
    for topology, slices, needle in (("h100:8x8", 2, "is a GPU cluster, whose nodes already share one network"),
                                     ("v6e:16x16", 2, "no data-center network bandwidth is known for v6e"),
                                     ("v5p:4x4x4", 0, "--slices=0 must be >= 1")):
        with pytest.raises(ValueError, match=needle):
            hardware_links.with_slices(hardware_links.parse_topology(topology), slices)
    with pytest.raises(ValueError, match="batch=127 does not split over 2 slices"):
        plans_lib.evaluate(LLM_1B, two, "dp", {"data": 64, "tensor": 1}, 127)


def test_plans_that_do_not_fit_are_excluded_for_memory():
    """llm_1b dp on v5e:4x4 at context 256: params, grads and activations fit 16 GiB, Adam's two
    moments do not (the issue's example); fsdp splits all three 16 ways and fits."""
    cfg = dataclasses.replace(LLM_1B, context_length=256)
    plans, _ = plans_lib.plan_all(cfg, hardware_links.parse_topology("v5e:4x4"), 16)
    fit, over = plans_lib.rank(plans, "serial")
    dp = next(p for p in over if p.strategy == "dp")
    m, usable = dp.cost.memory, 0.75 * 16 * 2**30
    assert m.total - m.optimizer < usable < m.total == dp.memory
    assert "fsdp" in {p.strategy for p in fit} and all(p.memory <= usable for p in fit)
    assert all(p.memory > usable for p in over)


def test_ranking():
    """llm_1b on v5p:4x4x4 with 64 sequences: every declared strategy on every mesh its declaration
    allows (a pipeline with its best micro-batch count per schedule), ranked by the serial step."""
    plans, skipped = plans_lib.plan_all(LLM_1B, hardware_links.parse_topology("v5p:4x4x4"), 64)
    fit, over = plans_lib.rank(plans, "serial")
    # at context 2, ulysses's 4 all-to-alls of half the heads move less than the ring's K and V hops;
    # zb_h1 (its W a weight gradient alone: pipeline_factor) and interleaved (V = 2 chunks of a stage's 10
    # layers; 20 / 4 = 5 layers split into no V <= 4) between tp_sp and them
    assert [(p.strategy, p.label()) for p in fit[:8]] == [
        ("dp", "data:64,tensor:1"), ("fsdp", "data:64,tensor:1"), ("pp_fsdp", "stage:2,data:32 M=2 gpipe"),
        ("pp_fsdp", "stage:4,data:16 M=4 gpipe"), ("tp_sp", "data:32,tensor:2"), ("pp_fsdp", "stage:2,data:32 M=2 zb_h1"),
        ("pp_fsdp", "stage:2,data:32 M=2 interleaved V=2"), ("fsdp_ulysses", "data:32,context:2")]
    # hsdp is a layout across slices only (launch.plan --slices: tests/test_plan_slices.py)
    assert {p.strategy for p in fit} == {"dp", "fsdp", "fsdp_tp", "tp_sp", "fsdp_tp_sp", "fsdp_cp", "fsdp_ulysses",
                                         "pp_fsdp"}
    assert [(p.strategy, p.label()) for p in over] == [("cp", "context:64")]  # every weight and Adam on each chip
    serial = [p.compute_s + sum(p.comm_s.values()) for p in fit]
    assert serial == sorted(serial)
    overlap, _ = plans_lib.rank(plans, "overlap")
    times = [max(p.compute_s, *p.comm_s.values()) for p in overlap]
    assert times == sorted(times)
    # on the same links, DP sends 2(n-1)/n x (the N f32 gradients + the loss); FSDP (n-1)/n x 3 x
    # each matrix (two gathers and a scatter; the embedding is not re-gathered), 2(n-1)/n x the
    # norm gains, the squared-norm scalar and the loss: about 1.5 x (1.46 with llm_1b's vocab)
    D, V, L, N = LLM_1B.d_model, LLM_1B.padded_vocab_size, LLM_1B.num_layers, LLM_1B.num_params()
    norms = (2 * L + 1) * D
    fsdp = 3 * (N - norms) - V * D + 2 * (norms + 2)
    assert fit[1].comm_s["data"] / fit[0].comm_s["data"] == pytest.approx(fsdp / (2 * (N + 1)))
    heads = "heads=16 is not divisible by mesh axis tensor="
    stages = "num_layers=20 does not split into stage={} equal stages"
    ulysses = "num_heads=16 does not split over context={} (ulysses's attention runs h/C heads per device)"
    assert {(s.strategy, s.mesh_text()): s.why for s in skipped} == {
        ("tp", "data:1,tensor:64"): heads + "64", ("fsdp_tp", "data:2,tensor:32"): heads + "32",
        ("tp_sp", "data:2,tensor:32"): heads + "32", ("tp_sp", "data:1,tensor:64"): heads + "64",
        ("fsdp_tp_sp", "data:2,tensor:32"): heads + "32",
        ("pp", "stage:64"): stages.format(64), **{("pp_fsdp", f"stage:{k},data:{64 // k}"): stages.format(k)
                                                 for k in (32, 16, 8)},
        ("ulysses", "context:64"): ulysses.format(64), ("fsdp_ulysses", "data:2,context:32"): ulysses.format(32)}


def test_pipelines_and_ring_attention_by_hand():
    """The strategies beyond data x tensor, one number each by hand (llm_1b, float32, v5p:4x4x4).

    pp_fsdp stage:2,data:32, M = 2 micro-batches of one sequence: GPipe runs M + S - 1 = 3 forward
    and 3 backward ticks of one micro-batch each, 3/2 of the stage's FLOPs at full use; 1F1B's
    table (pipeline.build("1f1b", 2, 2)) is, per tick, [F .] [F F] [. B] [B F] [. B] [B .]: 1 + 1 + 3
    + 3 + 3 + 3 = 14 units (a backward re-runs the stage's forward: 3) over 3 M = 6. Each hop
    carries one micro-batch [1, T, D] f32 to the neighbouring stage over one link, one way (90 GB/s).
    fsdp_cp data:32,context:2: ring attention computes (C+1)/(2C) = 3/4 of the attention scores;
    its 2 (C-1) L ring_shifts of a K or V block [2, H, T/2, dh] f32, forward and backward, each
    over one link of context's 2 chips of x."""
    topo = hardware_links.parse_topology("v5p:4x4x4")
    T, D, H, dh, L = LLM_1B.context_length, LLM_1B.d_model, LLM_1B.num_heads, LLM_1B.head_dim, LLM_1B.num_layers
    peak, one_way = 459e12, 90e9
    gpipe, f1b1 = (plans_lib.evaluate(LLM_1B, topo, "pp_fsdp", {"stage": 2, "data": 32}, 64, microbatches=2,
                                      schedule=s) for s in ("gpipe", "1f1b"))
    assert gpipe.compute_s == pytest.approx(gpipe.cost.flops.model_per_device / peak * 3 / 2, rel=1e-12)
    assert f1b1.compute_s == pytest.approx(gpipe.cost.flops.model_per_device / peak * 14 / 6, rel=1e-12)
    hops = sum(r.ring_bytes for r in gpipe.cost.collectives if r.op == "collective-permute")
    assert hops == 2 * 3 * T * D * 4  # 3 ticks forward, 3 back
    others = sum(r.ring_bytes for r in gpipe.cost.collectives if r.axes == ("stage",) and r.op != "collective-permute")
    assert gpipe.comm_s["stage"] == pytest.approx(hops / one_way + others / gpipe.links["stage"].bytes_per_s)
    assert (gpipe.links["stage"].hop_bytes_per_s, gpipe.links["stage"].bytes_per_s) == (one_way, 2 * one_way)
    cp = plans_lib.evaluate(LLM_1B, topo, "fsdp_cp", {"data": 32, "context": 2}, 64)
    f = cp.cost.flops
    assert cp.compute_s == pytest.approx((3 * f.forward_matmul + 3 * f.forward_attention * 3 / 4) / 64 / peak)
    ring = sum(r.ring_bytes for r in cp.cost.collectives if r.op == "collective-permute")
    assert ring == 2 * 2 * (2 - 1) * L * 2 * H * (T // 2) * dh * 4
    # the rest over context, and the means over (data, context): context's link is the slower
    rest = sum(r.ring_bytes for r in cp.cost.collectives if "context" in r.axes and r.op != "collective-permute")
    assert cp.links["context"].bytes_per_s == one_way < cp.links["data"].bytes_per_s  # 2 of x's 4 chips: 1 link
    assert cp.comm_s["context"] == pytest.approx(ring / one_way + rest / one_way)


def test_the_collective_matmul_is_tp_sps():
    """--collective_matmul decomposes tp_sp's sequence gathers (t-1 shifts beside the matmuls, each over
    one link); the other strategies plan without it, and tp_sp's launch line carries the flag."""
    cfg = dataclasses.replace(LLM_1B, collective_matmul=True)
    topo = hardware_links.parse_topology("v5p:4x4x4")
    plans, _ = plans_lib.plan_all(cfg, topo, 64)
    tp_sp = next(p for p in plans if p.strategy == "tp_sp" and p.mesh["tensor"] == 4)
    assert any(r.op == "collective-permute" and r.axes == ("tensor",) for r in tp_sp.cost.collectives)
    assert {p.strategy for p in plans} >= {"dp", "fsdp", "fsdp_tp"}
    train = dataclasses.replace(preset("llm_1b"), model=cfg)
    assert planner.train_flags(tp_sp, "llm_1b", train).endswith("--collective_matmul --distributed --workdir=WORKDIR")


def test_the_overlap_chunks_are_megatrons():
    """--tp_overlap_chunks=2 chunks tp's and fsdp_tp's all-reduces (twice as many, half the bytes each);
    the other strategies plan without it, and only the Megatron strategies' launch lines carry the flag."""
    cfg = dataclasses.replace(LLM_1B, tp_overlap_chunks=2)
    topo = hardware_links.parse_topology("v5p:4x4x4")
    plans, _ = plans_lib.plan_all(cfg, topo, 256)
    whole, _ = plans_lib.plan_all(LLM_1B, topo, 256)
    key = lambda p: (p.strategy, tuple(p.mesh.items()))  # noqa: E731
    unchunked = {key(p): p for p in whole}
    fsdp_tp = next(p for p in plans if p.strategy == "fsdp_tp")
    tensor = lambda p: [(r.count, r.bytes) for r in p.cost.collectives if r.what.startswith("Megatron g")]  # noqa: E731
    ((count, total),), ((count1, total1),) = tensor(fsdp_tp), tensor(unchunked[key(fsdp_tp)])
    assert (count, total) == (2 * count1, total1)
    assert {p.strategy for p in plans} >= {"dp", "fsdp", "fsdp_tp"}
    train = dataclasses.replace(preset("llm_1b"), model=cfg)
    assert "--tp_overlap_chunks=2" in planner.train_flags(fsdp_tp, "llm_1b", train)
    fsdp = next(p for p in plans if p.strategy == "fsdp")
    assert "tp_overlap_chunks" not in planner.train_flags(fsdp, "llm_1b", train)


def test_a_small_batch_spreads_over_the_sequence_and_the_layers():
    """16 sequences over 64 chips cap data at 16: dp and fsdp cannot use the slice (nor pp_fsdp, whose
    stages want M >= S micro-batches per data shard); the sequence (cp, fsdp_cp, fsdp_ulysses: ulysses
    alone would need context 64 over 16 heads) and Megatron (tp_sp, fsdp_tp, fsdp_tp_sp) can."""
    plans, _ = plans_lib.plan_all(LLM_1B, hardware_links.parse_topology("v5p:4x4x4"), 16)
    assert {p.strategy for p in plans} == {"fsdp_tp", "tp_sp", "fsdp_tp_sp", "cp", "fsdp_cp", "fsdp_ulysses"}
    assert all(p.mesh.get("data", 1) <= 16 for p in plans)


def _hand_axis_times(p: plans_lib.Plan, bw: dict[str, float], factor: float) -> dict[str, float]:
    """Each (op, axes) row's ring bytes at the slower axis's hand-set bandwidth, the all-to-all's x factor."""
    out = dict.fromkeys(p.mesh, 0.0)
    for (op, axes), s in p.cost.summary().items():
        slow = min(axes, key=bw.get)
        out[slow] += s["ring_bytes"] * (factor if op == "all-to-all" else 1) / bw[slow]
    return out


def test_a_mixture_of_experts_ranks_ep_and_fsdp_ep():
    """mixtral_8x7b (bf16) on v5p:4x4x4: dp, fsdp, ep and fsdp_ep meshes, no Megatron; each ep
    plan's expert-axis time by hand from the cost model's rows and the links' numbers."""
    topo = hardware_links.parse_topology("v5p:4x4x4")
    plans, skipped = plans_lib.plan_all(MIXTRAL, topo, 64)
    fit, over = plans_lib.rank(plans, "serial")
    assert [(p.strategy, p.mesh_text()) for p in fit] == [
        ("fsdp_ep", "data:8,expert:8"), ("fsdp_ep", "data:16,expert:4"), ("fsdp_ep", "data:32,expert:2"),
        ("fsdp", "data:64,tensor:1")]
    assert {p.strategy for p in plans} == {"dp", "fsdp", "ep", "fsdp_ep"}
    # resolve.check_experts: a mixture of experts runs under dp, fsdp, ep, fsdp_ep only
    assert plans_lib.runnable(MIXTRAL)[1].keys() == {"tp", "fsdp_tp", "tp_sp", "fsdp_tp_sp", "cp", "fsdp_cp",
                                                      "ulysses", "fsdp_ulysses", "pp", "pp_fsdp"}
    # E = 8 experts split over expert <= 8 (cost.cost does not check it; launch.train does)
    assert {(s.strategy, s.mesh_text()): s.why for s in skipped} == {
        (s, f"data:{64 // e},expert:{e}"): f"experts=8 is not divisible by mesh axis expert={e}"
        for s in ("ep", "fsdp_ep") for e in (16, 32, 64) if (s, e) != ("fsdp_ep", 64)}
    # ep keeps every weight but the experts whole on each chip: 16 bytes (f32 param, grad, Adam's 2
    # moments) x (N - experts + experts/8) = 108 GiB before activations, over any chip's HBM
    L, E, D, Fe, N = MIXTRAL.num_layers, MIXTRAL.num_experts, MIXTRAL.d_model, MIXTRAL.expert_ff, MIXTRAL.num_params()
    experts = 3 * L * E * D * Fe
    ep = {p.mesh["expert"]: p for p in over if p.strategy == "ep"}
    assert set(ep) == {2, 4, 8} and ep[8].cost.memory.params == 4 * (N - experts + experts // 8)
    # the links by hand (the module docstring): expert on x (a torus ring of 4), plus 2 of y's 4
    # chips for expert 8, or on 2 of x's 4 chips for expert 2; data on the rest
    gb, by_expert = 1e9, {8: ({"data": 360, "expert": 270}, 12 / 7), 4: ({"data": 360, "expert": 180}, 4 / 3),
                          2: ({"data": 540, "expert": 90}, 1.0)}
    for p in plans:
        if "expert" in p.mesh:
            bw, factor = by_expert[p.mesh["expert"]]
            want = _hand_axis_times(p, {a: bw.get(a, math.inf) * gb for a in p.mesh}, factor)
            assert p.comm_s == pytest.approx(want, rel=1e-12), (p.strategy, p.mesh)
    best = fit[0]
    a2a = best.cost.summary()[("all-to-all", ("expert",))]["ring_bytes"]
    assert a2a * (12 / 7 - 1) / (270 * gb) > 0.1 * best.comm_s["expert"]  # the hops are no rounding error
    assert planner.train_flags(ep[8], "mixtral_8x7b", preset("mixtral_8x7b")).startswith(
        "--preset=mixtral_8x7b --strategy=ep --impl=manual --mesh=data:8,expert:8 --distributed")


def test_the_launch_line_trains_the_planned_model():
    """Every model flag the plan was given that differs from the preset (a shape, the MoE layout, the
    kernel) is on the launch line: applied to the preset as launch.train applies it, it gives the
    model that was planned."""
    base = preset("tiny_moe")
    model = dataclasses.replace(base.model, first_dense_layers=1, num_kv_heads=2, context_length=64,
                                capacity_factor=2.0, scan_unroll=2, remat="full")
    cfg = dataclasses.replace(base, model=model)
    p = plans_lib.evaluate(model, hardware_links.parse_topology("v5p:2x2x2"), "fsdp_ep",
                           {"data": 2, "expert": 4}, base.train.batch_size)
    line = planner.train_flags(p, "tiny_moe", cfg)
    given = dict(re.findall(r"--(\w+)=(\S+)", line))
    assert {k: given[k] for k in ("first_dense_layers", "num_kv_heads", "context_length", "capacity_factor",
                                  "scan_unroll", "remat")} == {
        "first_dense_layers": "1", "num_kv_heads": "2", "context_length": "64", "capacity_factor": "2.0",
        "scan_unroll": "2", "remat": "full"}, line
    flags = dataclasses.make_dataclass("Flags", [(k, object, None) for k in common.MODEL_FLAGS])(
        **{k: type(getattr(base.model, k))(given[k]) for k in common.MODEL_FLAGS if k in given})
    assert common.with_model_flags(base, flags).model == model


def test_ep_fits_mixtral_with_factored_moments_on_h200():
    """ep replicates the dense weights: with Adafactor and 2048 tokens its 76.8 GiB (no [T, T] array:
    bf16 on a GPU is cuDNN flash attention) fit an H200's 105.75 usable (no TPU in the table has that
    much). fsdp's data:64 runs its gathers as a
    hierarchical ring at a node's 400 GB/s egress, fsdp_ep's data:8 (beside expert:8 in the node)
    through each GPU's 50 GB/s NIC: fsdp ranks first, ep last."""
    cfg = dataclasses.replace(MIXTRAL, context_length=2048)
    plans, _ = plans_lib.plan_all(cfg, hardware_links.parse_topology("h200:8x8"), 64, optimizer="adafactor")
    fit, _ = plans_lib.rank(plans, "serial")
    assert [(p.strategy, p.mesh_text()) for p in fit] == [
        ("fsdp", "data:64,tensor:1"), ("fsdp_ep", "data:32,expert:2"), ("fsdp_ep", "data:16,expert:4"),
        ("fsdp_ep", "data:8,expert:8"), ("ep", "data:8,expert:8")]
    assert fit[-1].memory / 2**30 == pytest.approx(76.8, abs=0.05)


def test_the_expert_axis_in_a_gpu_node_is_nvlink_at_factor_1():
    """fsdp_ep data:2 x expert:8 on 2 H100 nodes: the exchanges on NVLink, no hop factor; the
    (data, expert) means at the slower network."""
    p = plans_lib.evaluate(MIXTRAL, hardware_links.parse_topology("h100:2x8"), "fsdp_ep",
                         {"data": 2, "expert": 8, "tensor": 1}, 16)
    assert (p.links["expert"].bytes_per_s, p.links["expert"].all_to_all) == (450e9, 1.0)
    assert p.links["data"].bytes_per_s == 50e9
    assert p.comm_s == pytest.approx(_hand_axis_times(p, {"data": 50e9, "expert": 450e9, "tensor": math.inf}, 1.0),
                                     rel=1e-12)
    assert p.comm_s["expert"] > 0 and p.comm_s["tensor"] == 0


def test_readme_launch_lines_are_what_the_plan_prints():
    """Each `launch.plan` command of docs/multi-host.md, and the launch line it prints: the page
    shows that line (in a block test_readme does not run: gcloud, srun)."""
    text = (ROOT / "docs" / "multi-host.md").read_text()
    plans = re.findall(r"^uv run python -m launch\.plan (.*)$", text, re.M)
    shown = [line.strip() for line in text.splitlines()
             if re.match(r"(gcloud compute tpus tpu-vm ssh|srun) .*launch\.train", line.strip())]
    assert len(plans) == len(shown) == 2, (plans, shown)
    printed = []
    for args in plans:
        given = dict(re.findall(r"--(\w+)=(\S+)", args))
        cfg = preset(given["preset"])
        if "dtype" in given:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=given["dtype"]))
        topo = hardware_links.parse_topology(given["topology"])
        fit, _ = plans_lib.rank(plans_lib.plan_all(cfg.model, topo, cfg.train.batch_size)[0], "serial")
        printed += planner.launch_commands(fit[0], topo, given["preset"], cfg)
    assert printed == shown


def test_cli_prints_ranks_and_writes_json(tmp_path):
    proc = run("-m", "launch.plan", "--preset=llm_1b", "--topology=v5p:4x4x4", "--top=2", "--optimizer=lion",
               f"--json={tmp_path / 'plan.json'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    # (the 2 zb_h1 pipelines, 1 interleaved and 4 fsdp_tp_sp among them)
    assert "== plans that fit, ranked by the serial step time" in out and "... 28 more (--top)" in out
    assert re.search(r"^1 +dp +data:64,tensor:1 .* compute ", out, re.M), out
    assert "data=64: ICI x (4 chips, torus ring): 2 x 90 GB/s" in out
    assert "--strategy=dp --impl=manual --mesh=data:64,tensor:1 --optimizer=lion --distributed" in out
    assert re.search(r"params (\S+ GiB) \+ grads \1 \+ optimizer \1 \+", out), out  # lion: 1 f32 moment
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert [p["rank"] for p in doc["plans"]] == [*range(1, 31), None] and doc["chips"] == 64  # cp does not fit
    assert doc["plans"][0]["links"]["data"]["bytes_per_s"] == 540e9 and doc["chip"]["name"] == "v5p"
    assert doc["assumptions"]["optimizer"] == "lion (float32 state)"


def test_cli_plans_a_mixture_of_experts(tmp_path):
    proc = run("-m", "launch.plan", "--preset=mixtral_8x7b", "--topology=v5p:4x4x4", "--dtype=bfloat16", "--top=2",
               f"--json={tmp_path / 'plan.json'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    head = next(line for line in out.splitlines() if line.startswith("rank "))
    assert re.search(r"compute +comm data +comm expert +step overlap", head), head  # no tensor: none splits it
    assert re.search(r"^1 +fsdp_ep +data:8,expert:8 .* compute ", out, re.M), out
    assert "expert=8: ICI x (4 chips, torus ring): 2 x 90 GB/s, y (2 chips, part of a side of 4): 1 x 90 GB/s " \
           "= 270 GB/s per chip; all-to-all x 1.71" in out
    assert "ep data:4,expert:16: experts=8 is not divisible by mesh axis expert=16" in out
    assert "tp: --num_experts=8: a mixture of experts runs under dp, fsdp, ep, fsdp_ep" in out
    assert "--strategy=fsdp_ep --impl=manual --mesh=data:8,expert:8 --distributed" in out
    doc = json.loads((tmp_path / "plan.json").read_text())
    best = doc["plans"][0]
    assert best["mesh"] == {"data": 8, "expert": 8, "tensor": 1} and set(best["comm_s"]) == {"data", "expert", "tensor"}
    assert best["links"]["expert"]["all_to_all"] == pytest.approx(12 / 7)
    assert set(doc["refused"]) == {"tp", "fsdp_tp", "tp_sp", "fsdp_tp_sp", "cp", "fsdp_cp", "ulysses", "fsdp_ulysses",
                                   "pp", "pp_fsdp"}


def test_cli_errors_are_one_line():
    proc = run("-m", "launch.plan", "--preset=llm_1b", "--topology=v5p:4x4x4", "--batch_size=3",
               "--context_length=2047")
    assert_user_error(proc, "no strategy splits this model with batch 3 over 64 chips",
                      "batch=3 is not divisible by mesh axis data=64", "context_length=2047 does not split into 128",
                      "pass a --batch_size divisible")
    proc = run("-m", "launch.plan", "--topology=h100:1x8", "--compile")
    assert_user_error(proc, "--compile is not available for GPU topologies (h100:1x8)")
    proc = run("-m", "launch.plan", "--topology=h100:1x8", "--slices=2")
    assert_user_error(proc, "--slices=2: h100:1x8 is a GPU cluster, whose nodes already share one network")
    proc = run("-m", "launch.plan", "--topology=h100:1x8", "--master_weights")
    assert_user_error(proc, "--master_weights counts a float32 copy of narrower params: pass --param_dtype=bfloat16")


def test_the_default_mfu_is_the_chips_measured_matmul_efficiency(monkeypatch):
    """--mfu unset: the matmul efficiency measured on the chip (chips.EFFICIENCIES), named in the report;
    1.0 where none is measured, saying so; --mfu given wins. The compute column follows it."""
    v5e = chips.chip("v5e")
    monkeypatch.setitem(chips.EFFICIENCIES, "v5e", chips.Efficiency(matmul_efficiency=0.8, source="a large matmul on one v5e"))
    monkeypatch.delitem(chips.EFFICIENCIES, "v5p", raising=False)
    assert planner.matmul_fraction(v5e, None) == (0.8, "the matmul efficiency measured on v5e: a large matmul on one v5e")
    assert planner.matmul_fraction(v5e, 0.5) == (0.5, "given")
    mfu, why = planner.matmul_fraction(chips.chip("v5p"), None)
    assert mfu == 1.0 and why.startswith("no matmul efficiency measured on v5p: the datasheet peak")
    topo, cfg = hardware_links.parse_topology("v5e:4x4"), preset("gpt2_125m")
    mfu, why = planner.matmul_fraction(topo.chip, None)
    at_peak, _ = plans_lib.plan_all(cfg.model, topo, 16)
    measured, skipped = plans_lib.plan_all(cfg.model, topo, 16, mfu)
    assert [p.compute_s / 0.8 for p in at_peak] == pytest.approx([p.compute_s for p in measured])
    fit, over = plans_lib.rank(measured, "serial")
    text = planner.report(fit, over, skipped, topo, "gpt2_125m", cfg, 3, mfu, 0.25, "serial", mfu_why=why)
    assert "at --mfu=0.8 (the matmul efficiency measured on v5e: a large matmul on one v5e)" in text


def test_compile_refines_the_top_plans_with_the_compiled_step(tmp_path):
    """tiny on v5e:2x2 (4 chips, one host), --compile_top=2: both plans compiled for TPU, their
    collectives equal to the model as TPU prints it, then ranked by the step hlo.predict reads from each
    compiled program, with each mesh axis's exposed communication (the per-plan prediction's own numbers)."""
    proc = run("-m", "launch.plan", "--preset=tiny", "--topology=v5e:2x2", "--compile", "--compile_top=2",
               f"--json={tmp_path / 'plan.json'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    doc = json.loads((tmp_path / "plan.json").read_text())
    first_two = [(p["strategy"], p["mesh"]) for p in doc["plans"][:2]]
    compiled = doc["compiled"]
    assert sorted((c["strategy"], c["mesh"]) for c in compiled) == sorted(first_two)
    assert [c["plan_rank"] for c in compiled] != [] and {c["plan_rank"] for c in compiled} == {1, 2}
    steps = [c["predicted"]["step_s"] for c in compiled]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    for c in compiled:
        assert c["comparison"] and all(r["match"] for r in c["comparison"])
        pred = c["predicted"]
        assert pred["step_s"] == pytest.approx(pred["compute_s"] + pred["exposed_s"])
        assert pred["exposed_s"] == pytest.approx(sum(a["exposed_s"] for a in pred["axes"].values()))
        assert c["peak_bytes"] > 0 and c["compile_s"] > 0 and c["fits"]
        assert f"compiled ahead of time: {c['strategy']}/manual" in out
    assert "XLA's peak per chip" in out and ": fits (the model said" in out
    table = out[out.index("== the 2 best plans compiled, ranked by the compiled step's prediction"):]
    head, rows = table.splitlines()[1], table.splitlines()[3:5]
    axes = [a for a in ("data", "tensor") if any(a in c["predicted"]["axes"] for c in compiled)]
    assert all(f"exposed {a}" in head for a in axes) and "predicted step" in head
    for row, c in zip(rows, compiled):
        cells = row.split()
        assert cells[1] == str(c["plan_rank"]) and cells[2] == c["strategy"]
        assert planner._ms(c['predicted']['step_s']) in row


# ----------------------------------------------------------------------------- the scaling book's LLaMA-3-70B


def llama3_70b_rows() -> dict[str, tuple[float | str, float | str, float | str, float]]:
    """docs/planning.md's table: the scaling book's LLaMA-3-70B worked example beside the planner.
    Row -> (the book's value, the reference the planner must reproduce: the book's value, or its
    formula with what the planner models besides, the planner's value, relative tolerance). The
    book's setting: T = 4096 (its 4M-token batch is 1024 x 4096), v5p's C = 4.59e14 FLOP/s and
    9e10 B/s one-way ICI links, bf16 weights and float32 Adam where memory counts."""
    m = dataclasses.replace(preset("llama3_70b").model, context_length=4096, remat="full")
    L, D, F, H, K, dh = m.num_layers, m.d_model, m.d_ff, m.num_heads, m.kv_heads, m.head_dim
    C, ici, book_precision = 4.59e14, 9e10, plans_lib.Precision("bfloat16", "float32")
    rows = {"parameters": (70.4e9, 70.4e9, m.num_params(), 0.005)}
    f = cost.flops(m, 1024, 4096)
    rows["training FLOPs per token"] = (4.2e11, 4.2e11, 3 * f.forward_matmul / (1024 * 4096), 0.01)
    # the pod's 8960 = 2^8 x 35 chips split 1120 sequences (1024 do not); the days do not depend on it
    pod = plans_lib.evaluate(m, hardware_links.parse_topology("v5p:16x20x28"), "fsdp_tp", {"data": 1120, "tensor": 8},
                             1120, mfu=0.4, precision=book_precision)
    matmuls = pod.compute_s * matmul_share(pod.cost.flops)
    rows["days for 15e12 tokens, 8960 chips, 40% MFU"] = (44.0, 44.0, matmuls * 15e12 / (1120 * 4096) / 86400, 0.01)
    one = cost.memory(m, "dp", {"data": 1, "tensor": 1}, 1, 4096, **book_precision.memory_kwargs())
    rows["params in bf16 (bytes)"] = (140e9, 140e9, one.params, 0.01)
    rows["Adam's moments in f32 (bytes)"] = (560e9, 560e9, one.optimizer, 0.01)
    # FSDP over the 3 axes of a torus, 3 x 2 x 9e10 B/s: compute-bound above C / W tokens per chip
    s16 = hardware_links.parse_topology("v5p:16x16x16")
    fsdp = plans_lib.evaluate(m, s16, "fsdp", {"data": 4096, "tensor": 1}, 4096)
    fsdp_matmuls = fsdp.compute_s * matmul_share(fsdp.cost.flops)
    rows["FSDP's critical batch per chip (tokens)"] = (850, C / (3 * 2 * ici), 4096 * fsdp.comm_s["data"] / fsdp_matmuls,
                                                      0.02)
    plans, _ = plans_lib.plan_all(m, s16, 1024, precision=book_precision)
    best = plans_lib.rank(plans, "serial")[0][0]
    rows["mesh for 1024 x 4096 tokens"] = ("data 1024 x tensor 4", "fsdp_tp data:1024,tensor:4",
                                           f"{best.strategy} {best.label()}", 0)
    # Megatron over one side of 16 (2 x 9e10 B/s): compute / comm goes as 1 / (Y - 1), 1 at the largest Y
    tp = plans_lib.evaluate(m, s16, "fsdp_tp", {"data": 256, "tensor": 16}, 1024)
    alpha = C / (2 * ici)
    tp_matmuls = tp.compute_s * matmul_share(tp.cost.flops)
    rows["TP's largest compute-bound Y, one axis"] = (F / alpha, 1 + (1.125 * F + 0.375 * 2 * dh * (H + K)) / alpha,
                                                     1 + 15 * tp_matmuls / tp.comm_s["tensor"], 0.02)
    # 2 slices over DCN, fsdp inside: the gradients' all-reduce against the backward pass's matmuls, in
    # float32 as the manual twin's (the book's are bf16: 2 N / M bytes per chip)
    dcn = plans_lib.evaluate(m, hardware_links.with_slices(s16, 2), "fsdp", {"data": 4096, "tensor": 1}, 8192,
                             precision=book_precision)
    backward = 2 / 3 * dcn.compute_s * matmul_share(dcn.cost.flops)
    each_chip = 2 * dcn.cost.memory.grads / (2 * f.matmul_params / 4096)  # its f32 bytes / the book's 2 N / M
    rows["DCN's critical batch per slice (tokens)"] = (C / 6.25e9, C / 6.25e9 * (2 - 1) / 2 * each_chip,
                                                      8192 * 4096 / 2 * dcn.comm_s["dcn"] / backward, 0.001)
    return rows


def _shown(x: float | str) -> str:
    """A table cell: 4 significant digits ('7.055e10', '40,131', '858.4')."""
    if isinstance(x, str):
        return x
    if x >= 1e6:
        exp = len(str(int(x))) - 1
        return f"{x / 10 ** exp:.4g}e{exp}"
    return f"{x:,.0f}" if x >= 1e4 else f"{x:.4g}"


def matmul_share(f) -> float:
    """The weight matmuls' share of the planner's compute (MFU's FLOPs: causal attention half)."""
    return f.forward_matmul / (f.forward_matmul + f.forward_attention / 2)


def test_the_scaling_books_llama3_70b():
    """Every row of docs/planning.md's LLaMA-3-70B table: the planner's value within the row's
    tolerance of the reference (the book's value, or its formula with what the planner models
    besides, stated in the row), and the page shows the planner's value as computed here."""
    text = (ROOT / "docs" / "planning.md").read_text()
    table = {cells[0]: cells for cells in (
        [c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| quantity"))}
    for name, (book, reference, planner, tolerance) in llama3_70b_rows().items():
        if tolerance:
            assert planner == pytest.approx(reference, rel=tolerance), name
        else:
            assert planner == reference, name
        row = table[name]
        assert (row[1], row[3], row[4]) == (_shown(book), _shown(reference), _shown(planner)), (name, row)
