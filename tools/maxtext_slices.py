"""MaxText's published 32 x v5e-256 results beside the step this project predicts for its equivalents
across slices: the single-slice cases of tools/maxtext_predict.py, data parallel over the data-center
network (DCN), compiled ahead of time for N slices and priced with v5e's DCN bandwidth.

    uv run --extra tpu python tools/maxtext_slices.py --compile=16b --slices=32   # one case a process
    uv run --extra tpu python tools/maxtext_slices.py                             # the table (markdown)

The published figures: MaxText's "TPU v5e" table (the module docstring of tools/maxtext_predict.py
names it), its 32 x v5e-256 row beside the 1 x v5e-256 one; MaxText ran those with
dcn_data_parallelism over the slices and its ici axes inside each.

The layout (HSDP, launch/slices.py): the case's single-slice mesh inside each slice (fsdp over `data`, 256
chips), and a `dcn` axis outermost over the slices (jax.experimental.mesh_utils.create_hybrid_device_mesh),
the batch split over both and the weights replicated over `dcn`. The step is the auto twin's (GSPMD) own
train step with those shardings: XLA derives the one collective across slices, each chip's gradient shards
all-reduced with its counterparts. A program compiled for several slices is one slice's program with
that all-reduce as a megascale transfer (twinshard/hlo/megascale.py); the prediction (twinshard.hlo.predict)
prices it at `chips.V5E_DCN_BYTES_PER_S` and hides what the schedule overlaps with compute.

Scaling to 32 slices from a compile of N: everything but the DCN all-reduce is one slice's program, the
same at every N; the all-reduce sends 2 (N-1)/N x the gradient shards' bytes, so its time grows by
(31/32) / ((N-1)/N), and the compiled schedule, priced again with that time, hides what its window's
compute covers (`predicted` with `slices`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import maxtext_predict as single  # noqa: E402  (tools/ is not a package)
from launch.slices import DCN_AXIS, hybrid_devices, links_of, step_lowered  # noqa: E402

SLICES = 32
# MaxText's v5e table, its 32 x v5e-256 row (the 1 x v5e-256 row: maxtext_predict.PUBLISHED)
PUBLISHED_32 = {"16b": 0.5465, "32b": 0.6040, "64b": 0.5018, "128b": 0.4625}


def check_slices(slices: int) -> None:
    """One line naming the value and the fix, before anything compiles."""
    if not 2 <= slices <= SLICES:
        raise ValueError(f"--slices={slices} must be in [2, {SLICES}]: one slice is tools/maxtext_predict.py's "
                         f"table, and MaxText published {SLICES}")


# ----------------------------------------------------------------------------- compile


def paths(out: str, case: str, slices: int) -> tuple[str, str]:
    return tuple(os.path.join(out, f"{case}x{slices}.{ext}") for ext in ("hlo.gz", "json"))


def compile_case(p: single.Published, slices: int, out: str, force: bool) -> dict:
    """Compile the case's preset AOT for `slices` x TOPOLOGY (HSDP, `hsdp_lowered`); write CASExN.hlo.gz and .json."""
    from twinshard import hlo
    from twinshard.config import preset
    from twinshard.hardware import topology

    check_slices(slices)
    hlo_path, json_path = paths(out, p.case, slices)
    if not force and any(os.path.exists(x) for x in (hlo_path, json_path)):
        raise ValueError(f"{hlo_path} or {json_path} exists; pass --force to compile it again")
    os.makedirs(out, exist_ok=True)
    topology.default_to_cpu()
    cfg = preset(p.preset)
    t0 = time.perf_counter()
    lowered, mesh = step_lowered(cfg, p.strategy, p.our_mesh, hybrid_devices(single.TOPOLOGY, slices))
    t1 = time.perf_counter()
    compiled = topology.compile_for_pod(lowered)
    text = compiled.as_text()
    with gzip.open(hlo_path, "wt") as f:
        f.write(text)
    dcn = hlo.ledger(text, mesh).filter(axes=DCN_AXIS)
    doc = {"case": p.case, "slices": slices, "preset": p.preset, "strategy": p.strategy, "mesh": mesh,
           "topology": single.TOPOLOGY, "compile_s": time.perf_counter() - t1, "lower_and_compile_s":
           time.perf_counter() - t0, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "dcn_bytes": sum(r.bytes * r.multiplicity for r in dcn), "dcn_ops": sorted({r.op for r in dcn}),
           "memory_analysis": _memory(compiled), "commit": single._commit()}
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def _memory(compiled) -> dict:
    from twinshard.hardware import measure

    return measure.memory_analysis(compiled)


# ----------------------------------------------------------------------------- the table


def slice_links(mesh: dict[str, int], slices: int | None = None):
    """mesh axis -> Link: one slice's axes on its ICI (TOPOLOGY), the `dcn` axis on v5e's DCN. `slices`: price
    the DCN all-reduce as it runs on that many slices, not mesh['dcn'] (`ring_growth`; 1: free)."""
    from twinshard.hardware import links

    compiled = mesh[DCN_AXIS]
    out = links_of(links.with_slices(links.parse_topology(single.TOPOLOGY), compiled), mesh)
    dcn = out[DCN_AXIS]
    if slices == 1:  # one slice: nothing crosses DCN
        out[DCN_AXIS] = links.Link(math.inf, "none: one slice")
    elif slices not in (None, compiled):
        grow = ring_growth(compiled, slices)
        out[DCN_AXIS] = links.Link(dcn.bytes_per_s / grow, f"{dcn.what}, its {compiled}-slice ring's bytes x "
                                   f"{grow:.4g} ({slices} slices)")
    return out


def ring_growth(compiled: int, slices: int) -> float:
    """An all-reduce's ring bytes on `slices` slices over those on `compiled`: 2 (N-1)/N of the same shard."""
    return ((slices - 1) / slices) / ((compiled - 1) / compiled)


def predicted(out: str, p: single.Published, compiled: int, slices: int | None = None) -> dict | None:
    """The predicted step of the case compiled for `compiled` slices at v5e's measured rates, run on
    `slices` (default: `compiled`): one slice's program is the same at every count, only the DCN
    all-reduce's bytes grow, and the schedule hides what its window's compute covers. None where the
    case is not compiled."""
    from twinshard.hardware import step_time

    hlo_path, json_path = paths(out, p.case, compiled)
    if not os.path.exists(hlo_path):
        return None
    with open(json_path) as f:
        doc = json.load(f)
    with gzip.open(hlo_path, "rt") as f:
        text = f.read()
    pred = step_time.predict_step(text, "v5e", doc["mesh"], slice_links(doc["mesh"], slices))
    dcn = pred.axes.get(DCN_AXIS)
    return {"step_s": pred.step_s, "compute_s": pred.compute_s, "exposed_s": pred.exposed_s,
            "dcn_s": dcn.comm_s if dcn else 0.0, "dcn_exposed_s": dcn.exposed_s if dcn else 0.0,
            "compiled": compiled, "slices": slices or compiled, "compile": doc, "table": pred.table()}


def rows(out: str) -> list[dict]:
    """Per case: the published MFU at 1 and 32 slices, and the prediction of the largest slice count
    compiled under `out`: at 1 slice (the same program, its DCN transfers free: one slice's program
    without them), at the count compiled, and at 32."""
    table = []
    for r in single.rows(out):
        p = r["published"]
        names = os.listdir(out) if os.path.isdir(out) else []
        counts = sorted((int(n[len(p.case) + 1:-len(".hlo.gz")]) for n in names
                         if n.startswith(p.case + "x") and n.endswith(".hlo.gz")), reverse=True)
        at = {k: predicted(out, p, counts[0], k) for k in (1, counts[0], SLICES)} if counts else {}
        table.append({**r, "published_32": PUBLISHED_32[p.case], "at": at, "dcn_term_s": dcn_term(p)})
    return table


def dcn_term(p: single.Published) -> float:
    """launch.plan's DCN term of the case at 32 slices: each chip's float32 gradient shards all-reduced
    over the slices at v5e's DCN rate (the manual twin's reduction, which the planner models)."""
    from twinshard.config import preset
    from twinshard.hardware import links, plan

    cfg = preset(p.preset)
    topo = links.with_slices(links.parse_topology(single.TOPOLOGY), SLICES)
    return plan.evaluate(cfg.model, topo, p.strategy, dict(p.our_mesh), cfg.train.batch_size * SLICES).comm_s["dcn"]


def markdown(table: list[dict]) -> str:
    mfu = lambda r, k: r["ours_flops"] / r["at"][k]["step_s"] / single.PEAK_V5E  # noqa: E731
    lines = ["| case | MaxText 1 x v5e-256 | MaxText 32 x | MaxText's drop | the manual twin's 1 x + the planner's "
             "DCN term exposed: 32 x (drop), against MaxText | predicted 1 x | predicted 32 x: step (DCN all-reduce, "
             "exposed) | predicted drop | 32 x against MaxText | compiled for |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        p, at, one = r["published"], r["at"], r["pred"]
        cells = [p.case, f"{p.mfu:.2%}", f"{r['published_32']:.2%}", f"{(p.mfu - r['published_32']) * 100:.2f} points"]
        if one:
            bound = r["ours_flops"] / (one["step_s"] + r["dcn_term_s"]) / single.PEAK_V5E
            drop = r["ours_flops"] / one["step_s"] / single.PEAK_V5E - bound
            cells.append(f"{bound:.1%} ({drop * 100:.2f} points, +{r['dcn_term_s']:.2f} s), "
                         f"{bound / r['published_32'] - 1:+.1%}")
        else:
            cells.append("not compiled")
        if at:
            top = at[SLICES]
            cells += [f"{mfu(r, 1):.1%} ({at[1]['step_s']:.2f} s)",
                      f"{mfu(r, SLICES):.1%} ({top['step_s']:.2f} s: {top['dcn_s']:.3f} s, "
                      f"{top['dcn_exposed_s']:.3f} s)",
                      f"{(mfu(r, 1) - mfu(r, SLICES)) * 100:.2f} points",
                      f"{mfu(r, SLICES) / r['published_32'] - 1:+.1%}",
                      f"{top['compiled']} slices, {top['compile']['compile_s']:.0f} s"]
        else:
            cells += ["not compiled"] + ["-"] * 4
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", choices=list(single.CASES), help="compile one case AOT for --slices x "
                        f"{single.TOPOLOGY}; write CASExN.hlo.gz and CASExN.json under --out")
    parser.add_argument("--slices", type=int, default=SLICES, help="slices to compile for (2 to 32)")
    parser.add_argument("--out", default=".hlo", help="directory of the compiled cases (the single-slice ones too)")
    parser.add_argument("--force", action="store_true", help="overwrite a compiled case already in --out")
    args = parser.parse_args(argv)
    try:
        check_slices(args.slices)
        if args.compile:
            print(json.dumps(compile_case(single.CASES[args.compile], args.slices, args.out, args.force), indent=1))
        else:
            print(markdown(rows(args.out)))
    except ValueError as e:
        parser.exit(2, f"maxtext_slices: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
