"""MaxText's published TPU v5e-256 training results beside what this project predicts for its
closest equivalents: the planner's figure, and the step predicted from the compiled program.

    uv run --extra tpu python tools/maxtext_predict.py --compile=16b --out=.hlo   # AOT on this CPU, one case per run
    uv run --extra tpu python tools/maxtext_predict.py --compile=16b --maxtext_flags   # with MaxText's XLA flags
    uv run --extra tpu python tools/maxtext_predict.py --compile=16b --auto            # the auto twin (GSPMD)
    uv run --extra tpu python tools/maxtext_predict.py --out=.hlo                 # the table (markdown)

The published figures: MaxText's "TPU v5e" performance table (README.md's "Runtime Performance
Results" from commit f70c643b0 to e7829012d; src/maxtext/configs/tpu/v5e/README.md today), one
v5e-256 pod, run by the 16b.sh / 32b.sh / 64b.sh / 128b.sh of MaxText/configs/largest_job/ at
commit e47fa1b5d (2023-11-01, "Modify results table"): global_parameter_scale 16 .. 128, per-device
batch 6 / 4 / 2 / 1, sequence 2048, remat full, synthetic data, Pallas flash attention, and
LIBTPU_INIT_ARGS that turn on async collective fusion and data-parallel all-reduce overlap.

Their model then (base.yml, pyconfig.py and layers.py at e47fa1b5d): a T5X-style decoder, emb 2560,
8 heads x 256, a relu MLP of 8192, 16 layers, vocab 32768 with the logits through the (tied)
embedding, each scaled by pyconfig's get_individual_scales; RMS-style LayerNorms, dropout rate 0;
params float32, activations bfloat16, AdamW; fully sharded over ici_fsdp (the 128B: fsdp 16 x
tensor 16). With enable_flash_attention its attention is the Pallas flash kernel called with
causal=False and no bias: the whole T x T, no mask, no position information (the relative position
biases and the query/key LayerNorms sit on the other path). Their TFLOP/s: (6 N T + 12 H L dh T^2)
per sequence (train.py's calculate_training_tflops then: N every parameter, the whole T x T, which
that kernel computed) / step time; MFU = TFLOP/s / 197.

The project's equivalent (twinshard.config's maxtext_v5e_* presets, `equivalent` below): the same D,
layers, head_dim, vocab, sequence and batch, a llama-style layer (RoPE, RMSNorm, SwiGLU, untied
lm_head, causal splash attention). Its q/k/v/o are [D, D] where MaxText's are [D, H dh] (H dh is
not D), so d_ff is set so that one layer has MaxText's matmul parameters: the same 6 N T of a layer,
the same FSDP bytes per layer. `differences` names the rest. Each side's MFU counts the attention
its kernel computes: MaxText's the whole T x T, the project's the causal half
(twinshard.cost.flops' model_total).

The compile (--compile) runs launch.collectives' AOT compile of the manual twin for v5e:16x16 and
writes CASE.hlo.gz (the optimized HLO) and CASE.json (compile seconds, the process's peak RSS, XLA's
memory analysis) under --out; a case is one process, so the peak RSS is that compile's. The table
reads them back; the compiled-program prediction is twinshard.hardware.step_time.predict_step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import re
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOPOLOGY = "v5e:16x16"
PEAK_V5E = 197e12  # the bf16 peak MaxText divides by (and twinshard/hardware/chips.py's v5e)
SEQ = 2048

# MaxText's base.yml at e47fa1b5d: the dims global_parameter_scale multiplies
BASE = {"emb": 2560, "heads": 8, "head_dim": 256, "mlp": 8192, "layers": 16, "vocab": 32768}


@dataclasses.dataclass(frozen=True)
class Published:
    """One published MaxText run on one v5e-256 (the module docstring's sources)."""

    case: str
    scale: int  # global_parameter_scale
    per_device_batch: int
    tflops: float  # TFLOP/s per chip, MaxText's count
    mfu: float
    mesh: dict[str, int]  # MaxText's ici axes, as this project's mesh
    remat: str  # MaxText's remat_policy
    preset: str  # the project's equivalent (twinshard.config)
    ours: dict[str, int] | None = None  # the equivalent's mesh where it is not MaxText's (`differences` says why)

    @property
    def our_mesh(self) -> dict[str, int]:
        return self.ours or self.mesh

    @property
    def strategy(self) -> str:
        """The project's strategy on `our_mesh`: fsdp, or fsdp_tp_sp (MaxText's sequence-split residuals) where it
        has a tensor axis."""
        return "fsdp_tp_sp" if self.our_mesh["tensor"] > 1 else "fsdp"


PUBLISHED = (
    Published("16b", 16, 6, 120, 0.6110, {"data": 256, "tensor": 1}, "full", "maxtext_v5e_16b"),
    Published("32b", 32, 4, 132, 0.6686, {"data": 256, "tensor": 1}, "full", "maxtext_v5e_32b"),
    Published("64b", 64, 2, 118, 0.5990, {"data": 256, "tensor": 1}, "full", "maxtext_v5e_64b"),
    # fsdp_tp_sp, MaxText's layout: fsdp_tp on 16 x 16 kept each tensor shard's [16, T, D] residuals of all 64
    # layers (81.6 GiB a chip by the cost model); on sequence shards they are 1/16 of that
    Published("128b", 128, 1, 110, 0.5606, {"data": 16, "tensor": 16}, "full", "maxtext_v5e_128b"),
)
CASES = {p.case: p for p in PUBLISHED}
# MaxText's LIBTPU_INIT_ARGS in every one of those scripts, as compile options, whose names libtpu
# checks (twinshard.hardware.topology.compile_for_pod)
MAXTEXT_XLA_FLAGS = {flag: "true" for flag in (
    "xla_tpu_enable_data_parallel_all_reduce_opt", "xla_tpu_data_parallel_opt_different_sized_ops",
    "xla_tpu_enable_async_collective_fusion", "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
    "xla_tpu_enable_async_collective_fusion_multiple_steps", "xla_tpu_overlap_compute_collective_tc",
    "xla_enable_async_all_gather")}
SOURCE = ("github.com/AI-Hypercomputer/maxtext README.md (\"TPU v5e\" table, 1x v5e-256 row; commits "
          "f70c643b0..e7829012d), configs in MaxText/configs/largest_job/ at e47fa1b5d")



# ----------------------------------------------------------------------------- MaxText's model


def individual_scales(scale: int) -> tuple[int, int, int, int]:
    """pyconfig.get_individual_scales: (emb, heads, mlp, layers) log2 multipliers; doubling rotates
    over heads+mlp, emb, layers."""
    log2 = int(math.log2(scale))
    if 2 ** log2 != scale:
        raise ValueError(f"global_parameter_scale={scale} must be a power of 2")
    base, rem = divmod(log2, 3)
    heads = base + int(rem > 0)
    return base + int(rem > 1), heads, heads, base


def maxtext_dims(scale: int) -> dict[str, int]:
    """MaxText's model at `scale`: emb D, heads H, head_dim dh, mlp F, layers L, vocab V."""
    emb, heads, mlp, layers = individual_scales(scale)
    return {"emb": BASE["emb"] << emb, "heads": BASE["heads"] << heads, "head_dim": BASE["head_dim"],
            "mlp": BASE["mlp"] << mlp, "layers": BASE["layers"] << layers, "vocab": BASE["vocab"]}


def maxtext_layer_params(d: dict[str, int]) -> int:
    """A layer's matmul parameters: q, k, v, o [D, H dh] and the relu MLP's wi, wo [D, F]."""
    return 4 * d["emb"] * d["heads"] * d["head_dim"] + 2 * d["emb"] * d["mlp"]


def maxtext_params(d: dict[str, int]) -> int:
    """N as MaxText counted it, less the norms and relative position biases (< 0.01%): layers + the tied embedding."""
    return d["layers"] * maxtext_layer_params(d) + d["vocab"] * d["emb"]


def maxtext_step_flops(n: int, heads: int, layers: int, head_dim: int, batch: int, seq: int = SEQ) -> float:
    """MaxText's FLOPs of one step on `batch` sequences (train.py at e47fa1b5d): 6 N T + 12 H L dh T^2 each."""
    return batch * (6 * n * seq + 12 * heads * layers * head_dim * seq ** 2)


def equivalent(p: Published):
    """The project's closest ModelConfig: MaxText's D, L, dh, V, T; d_ff (a multiple of 64) giving a
    layer MaxText's matmul parameters with [D, D] attention projections."""
    from twinshard.config import ModelConfig

    d = maxtext_dims(p.scale)
    emb = d["emb"]
    d_ff = 64 * round((maxtext_layer_params(d) - 4 * emb * emb) / (3 * emb * 64))
    return ModelConfig(vocab_size=d["vocab"], context_length=SEQ, d_model=emb, num_layers=d["layers"],
                       num_heads=emb // head_dim(p), d_ff=d_ff, dtype="bfloat16", remat="full",
                       attention_block=512)


def head_dim(p: Published) -> int:
    """MaxText's head_dim, halved until the D / head_dim heads split over the case's tensor axis."""
    dh = maxtext_dims(p.scale)["head_dim"]
    while (maxtext_dims(p.scale)["emb"] // dh) % p.our_mesh["tensor"]:
        dh //= 2
    return dh


# What differs in every case (MaxText's side from the module docstring's sources)
COMMON_DIFFERENCES = (
    "RoPE (MaxText's flash path: no position information)",
    "causal splash attention, blocks 512, computing half the T x T (MaxText: the Pallas flash kernel with "
    "causal=False, blocks 512, the whole T x T)",
    "the manual twin's shard_map FSDP (MaxText: GSPMD)",
    "'compiled': XLA's default TPU flags; the last column: MaxText's LIBTPU_INIT_ARGS as compile options",
)


def differences(p: Published, cfg) -> str:
    """What differs between MaxText's model and the project's equivalent beyond COMMON_DIFFERENCES."""
    d = maxtext_dims(p.scale)
    ours = 4 * cfg.d_model ** 2 + 3 * cfg.d_model * cfg.d_ff
    return "; ".join([
        f"attention {d['heads']} x {d['head_dim']} ([D, {d['heads'] * d['head_dim']}] projections) against "
        f"{cfg.num_heads} x {cfg.head_dim} ([D, D]): attention scores {cfg.d_model / (d['heads'] * d['head_dim']):.2f}x "
        f"as wide",
        f"relu MLP {d['mlp']} (2 matrices) against SwiGLU {cfg.d_ff} (3): a layer's matmul params "
        f"{ours / maxtext_layer_params(d) - 1:+.2%}",
        f"untied lm_head: +{d['vocab'] * d['emb'] / 1e6:.0f}M params, N {cfg.num_params() / maxtext_params(d):.3f}x",
    ] + ([f"vocabulary tiling in {cfg.loss_chunks} chunks"] if cfg.loss_chunks else [])
      + ([f"mesh data:{p.our_mesh['data']} (MaxText: fsdp {p.mesh['data']} x tensor {p.mesh['tensor']})"]
         if p.ours else [])
      + ([f"head_dim {cfg.head_dim} (MaxText: {d['head_dim']}): {cfg.num_heads} heads split over tensor "
          f"{p.our_mesh['tensor']}"] if cfg.head_dim != d["head_dim"] else []))


# ----------------------------------------------------------------------------- compile


# How a case is compiled: file suffix -> (twin, MaxText's XLA flags as compile options or not)
VARIANTS = {"": ("manual", False), "+flags": ("manual", True), "+auto": ("auto", False)}


def compile_case(p: Published, out: str, force: bool, variant: str = "") -> dict:
    """Compile the case's preset AOT for TOPOLOGY (launch.collectives, the variant's twin and flags);
    write CASE{variant}.hlo.gz and .json."""
    from launch import collectives as collectives_cli
    from twinshard.config import preset
    from twinshard.hardware import topology
    from twinshard.parallel import mesh as mesh_lib

    impl, maxtext_flags = VARIANTS[variant]
    paths = [os.path.join(out, f"{p.case}{variant}.{ext}") for ext in ("hlo.gz", "json")]
    if not force and any(os.path.exists(x) for x in paths):
        raise ValueError(f"{paths[0]} or {paths[1]} exists; pass --force to compile it again")
    os.makedirs(out, exist_ok=True)
    topology.default_to_cpu()
    cfg = preset(p.preset)
    devices = topology.devices(TOPOLOGY)
    t0 = time.perf_counter()
    options = MAXTEXT_XLA_FLAGS if maxtext_flags else None
    res = collectives_cli.collectives(p.strategy, impl, mesh_lib.mesh_str(p.our_mesh, p.strategy), cfg, devices,
                                      compiler_options=options)
    wall = time.perf_counter() - t0
    with gzip.open(paths[0], "wt") as f:
        f.write(res["hlo"])
    doc = {"case": p.case + variant, "preset": p.preset,
           "compiler_options": options or {}, "strategy": p.strategy, "impl": impl, "mesh": res["mesh"],
           "topology": TOPOLOGY, "compile_s": res["compile_s"], "lower_and_compile_s": wall,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "memory_analysis": res["memory"]["analysis"], "commit": _commit()}
    with open(paths[1], "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def _commit() -> str:
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    git = lambda *args: subprocess.run(["git", "-C", here, *args], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


# ----------------------------------------------------------------------------- the table


def planner(cfg, p: Published, batch: int) -> dict[str, float]:
    """launch.plan's figures for the case's mesh at --mfu=1: compute, communication, serial and overlap steps."""
    from twinshard.hardware import links, plan

    topo = links.parse_topology(TOPOLOGY)
    got = plan.evaluate(cfg, topo, p.strategy, dict(p.our_mesh), batch)
    return {"compute_s": got.compute_s, "comm_s": sum(got.comm_s.values()), "serial_s": got.serial_s,
            "overlap_s": got.overlap_s}


def predicted(out: str, p: Published, variant: str = "", matmul_efficiency: float | None = None) -> dict | None:
    """The compiled program's predicted step (twinshard.hardware.step_time), or None where the case is not compiled;
    matmul_efficiency: the matmuls' share of the peak in place of the chip's measured one (chips.efficiency)."""
    from twinshard.hardware import chips, links, step_time

    path = os.path.join(out, f"{p.case}{variant}.hlo.gz")
    if not os.path.exists(path):
        return None
    with open(path.removesuffix(".hlo.gz") + ".json") as f:
        doc = json.load(f)
    with gzip.open(path, "rt") as f:
        text = f.read()
    topo = links.parse_topology(TOPOLOGY)
    eff = chips.efficiency(topo.chip)
    if matmul_efficiency is not None:
        eff = dataclasses.replace(eff, matmul_efficiency=matmul_efficiency,
                                  source=f"matmul {matmul_efficiency:g} given; the rest: {eff.source}")
    pred = step_time.predict_step(text, topo.chip, doc["mesh"], links.axis_links(topo, doc["mesh"]), efficiency=eff)
    return {"step_s": pred.step_s, "compute_s": pred.compute_s, "exposed_s": pred.exposed_s,
            "compile": doc, "table": pred.table(), "efficiency": eff, "program": hash(program_text(text))}


def program_text(hlo_text: str) -> str:
    """The HLO without what names where it came from (op metadata, the stack-frame tables), so two
    compiles of one program from different call paths compare equal."""
    text = re.sub(r", metadata=\{[^}]*\}", "", hlo_text)
    return "\n".join(line for line in text.splitlines()
                     if not re.match(r"(\d+ [{\"]|FileNames|FunctionNames|FileLocations|StackFrames)", line))


def rows(out: str, matmul_efficiency: float | None = None) -> list[dict]:
    from twinshard import cost
    from twinshard.config import preset

    table = []
    for p in PUBLISHED:
        cfg = preset(p.preset).model
        batch = p.per_device_batch * math.prod(p.mesh.values())
        d = maxtext_dims(p.scale)
        theirs = maxtext_step_flops(maxtext_params(d), d["heads"], d["layers"], d["head_dim"], p.per_device_batch)
        ours = cost.flops(cfg, batch, SEQ, math.prod(p.mesh.values())).model_per_device  # causal attention half
        table.append({"published": p, "cfg": cfg, "theirs_step_s": theirs / (p.tflops * 1e12), "ours_flops": ours,
                      "plan": planner(cfg, p, batch), "differences": differences(p, cfg),
                      **{f"pred{v}": predicted(out, p, v, matmul_efficiency) for v in VARIANTS}})
    return table


def _compiled_cells(pred: dict | None, flops: float) -> list[str]:
    """(step (compute + exposed), MFU) and (compile seconds, peak RSS, XLA's peak per chip) of one compiled case."""
    if pred is None:
        return ["not compiled", "-"]
    c, ma = pred["compile"], pred["compile"]["memory_analysis"]
    peak = (ma["argument_size_in_bytes"] + ma["output_size_in_bytes"] - ma["alias_size_in_bytes"]
            + ma["temp_size_in_bytes"])
    return [f"{pred['step_s']:.2f} s ({pred['compute_s']:.2f} + {pred['exposed_s']:.2f}), "
            f"{flops / pred['step_s'] / PEAK_V5E:.1%}",
            f"{c['compile_s']:.0f} s, {c['peak_rss_bytes'] / 2**30:.1f} GiB, {peak / 2**30:.1f} GiB"]


def markdown(table: list[dict]) -> str:
    mfu = lambda flops, s: f"{flops / s / PEAK_V5E:.1%}"  # noqa: E731
    lines = ["| case | published: TFLOP/s, MFU, step | planner serial: step, MFU | planner overlap: step, MFU "
             "| compiled: step (compute + exposed), MFU | compile s, peak RSS, XLA's peak per chip "
             "| compiled with MaxText's XLA flags: step, MFU | the auto twin (GSPMD): step, MFU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        p, plan, f = r["published"], r["plan"], r["ours_flops"]
        cells = [f"{p.case} ({r['cfg'].num_params() / 1e9:.1f}B, {p.per_device_batch}/chip)",
                 f"{p.tflops:.0f}, {p.mfu:.2%}, {r['theirs_step_s']:.2f} s",
                 f"{plan['serial_s']:.2f} s, {mfu(f, plan['serial_s'])}",
                 f"{plan['overlap_s']:.2f} s, {mfu(f, plan['overlap_s'])}",
                 *_compiled_cells(r["pred"], f), _compiled_cells(r["pred+flags"], f)[0],
                 _compiled_cells(r["pred+auto"], f)[0]]
        if r["pred"] and r["pred+flags"] and r["pred"]["program"] == r["pred+flags"]["program"]:
            cells[-2] += " (the same program)"
        lines.append("| " + " | ".join(cells) + " |")
    effs = {f"matmul {e.matmul_efficiency:g}, HBM {e.hbm_efficiency:g}, splash {e.splash_efficiency:g} of the "
            f"peaks ({e.source})" for e in (r[k]["efficiency"] for r in table for k in ("pred", "pred+flags", "pred+auto") if r[k])}
    lines += [""] + [f"Compiled programs priced at {e}." for e in sorted(effs)]
    lines += ["", "Published: MaxText's TFLOP/s and MFU, the step their FLOPs over that rate imply (their "
              "attention the whole T x T). The rest: the equivalent's FLOPs (twinshard.cost.flops' model_total, "
              "causal attention half) over the step, of 197 TFLOP/s.", ""]
    lines += [f"- every case: {'; '.join(COMMON_DIFFERENCES)}."]
    for r in table:
        lines.append(f"- {r['published'].case}: {r['differences']}.")
    for r in table:  # the predictor's own account of each compiled program
        same = r["pred"] and r["pred+flags"] and r["pred"]["program"] == r["pred+flags"]["program"]
        for key, label in (("pred", ""), ("pred+flags", ", MaxText's XLA flags"), ("pred+auto", ", the auto twin")):
            if r[key] and not (same and key == "pred+flags"):
                lines += ["", f"{r['published'].case}{label}:", "```", r[key]["table"], "```"]
    return "\n".join(lines)


def main(argv=None) -> int:
    # argparse, not absl: launch.collectives, imported to compile, defines absl flags of its own
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", choices=list(CASES), help=f"compile one case AOT for {TOPOLOGY}; write "
                        "CASE.hlo.gz and CASE.json under --out")
    parser.add_argument("--out", default=".hlo", help="directory of the compiled cases")
    parser.add_argument("--force", action="store_true", help="overwrite a compiled case already in --out")
    parser.add_argument("--matmul_efficiency", type=float, help="the table: price matmuls at this share of the "
                        "peak (default: the chip's measured efficiencies, twinshard.hardware.chips.efficiency)")
    parser.add_argument("--maxtext_flags", action="store_true", help="with --compile: compile with MaxText's "
                        "XLA flags (CASE+flags.hlo.gz)")
    parser.add_argument("--auto", action="store_true", help="with --compile: the auto twin (GSPMD, as MaxText) "
                        "in place of the manual one (CASE+auto.hlo.gz)")
    args = parser.parse_args(argv)
    if args.maxtext_flags and args.auto:
        parser.error("--maxtext_flags and --auto are two variants of a case: compile each in its own run")
    if args.matmul_efficiency is not None and not 0 < args.matmul_efficiency <= 1:
        parser.error(f"--matmul_efficiency={args.matmul_efficiency} must be in (0, 1]: a share of the peak")
    try:
        if args.compile:
            variant = "+flags" if args.maxtext_flags else "+auto" if args.auto else ""
            print(json.dumps(compile_case(CASES[args.compile], args.out, args.force, variant), indent=1))
        else:
            print(markdown(rows(args.out, args.matmul_efficiency)))
    except ValueError as e:
        parser.exit(2, f"maxtext_predict: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
