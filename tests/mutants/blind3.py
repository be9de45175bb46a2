"""Bugs written blind, a third round: realistic bugs in the newest code (the pipeline's schedule tables
and their reader, the split backward, the fast path, the slices, the hsdp twins and their cost rows,
the pipeline stash's memory, a convolution's FLOPs, the benchmark report and the twins' notes), written
at commit 67b02dc by someone who read the mutated modules' source but not one test. Each mutant's
`tests` were chosen mechanically (`grep -l` of the module's import path or a function's name in
tests/test_*.py, at most 3 files), not by reading the tests, so a `missed` one is a gap the tests were
not written around. docs/mutation-testing.md, "Bugs written blind", records how many were caught. Two
snippets (the drawing's box call, the hsdp cost row) were re-anchored later, the same bug in the code as it
changed after they were written."""

from .base import ACCUM, COST, MEMORY, Mutant, SRC_COST_MEMORY, SRC_COST_ROWS, SRC_TRAINER

SRC_TICKS = "twinshard/hlo/pipeline_ticks.py"
SRC_EVALUATE = "twinshard/hlo/evaluate.py"
SRC_DRAW_PIPELINE = "twinshard/hlo/draw_pipeline.py"
SRC_MEGASCALE = "twinshard/hlo/megascale.py"
SRC_PIPELINE = "twinshard/parallel/pipeline.py"
SRC_ROUND_ROBIN = "twinshard/parallel/round_robin.py"
SRC_PP_SPLIT = "manual_parallel/pp_split.py"
SRC_MANUAL_PP = "manual_parallel/pp.py"
SRC_AUTO_PP = "auto_parallel/pp.py"
SRC_FAST_PATH = "twinshard/hardware/fast_path.py"
SRC_COMMON = "launch/common.py"
SRC_CHIPS = "twinshard/hardware/chips.py"
SRC_MAXTEXT_SLICES = "tools/maxtext_slices.py"
SRC_SLICES = "launch/slices.py"
SRC_MESH = "twinshard/parallel/mesh.py"
SRC_AUTO_HSDP = "auto_parallel/hsdp.py"
SRC_MATMUL_FLOPS = "twinshard/hlo/matmul_flops.py"
SRC_BENCH_REPORT = "launch/bench_report.py"
SRC_TWIN_NOTES = "launch/twin_notes.py"

PIPELINE_TICKS = "tests/test_pipeline_ticks.py"
PIPELINE = "tests/test_pipeline.py"
BF16_PARALLEL = "tests/test_bf16_parallel.py"
MEGASCALE = "tests/test_megascale.py"
MAXTEXT_SLICES = "tests/test_maxtext_slices.py"
PLAN_SLICES = "tests/test_plan_slices.py"
FAST_PATH = "tests/test_fast_path.py"
HSDP = "tests/test_hsdp.py"
MESH = "tests/test_mesh.py"
GRADIENT_BYTES = "tests/test_gradient_bytes.py"
EXPLICIT = "tests/test_explicit.py"
STEP_TIME_MODEL = "tests/test_step_time_model.py"
BENCH = "tests/test_bench.py"
TPU_BENCH = "tests/test_tpu_bench.py"
COLLECTIVES_CLI = "tests/test_collectives_cli.py"
DRAWING_CLAIMS = "tests/test_drawing_claims.py"
SEQUENCE = "tests/test_sequence.py"
STRATEGIES = "tests/test_strategies.py"

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ the compiled step's ticks (hlo/pipeline_ticks.py, evaluate.py, draw_pipeline.py, megascale.py)
    Mutant("blind3-ticks-stage-partitions-unstrided", "blind3", SRC_TICKS,
           "partitions = [s * stride for s in range(stages)]",
           "partitions = [s for s in range(stages)]",
           (PIPELINE_TICKS,),
           "each stage's first partition id is s, not s x the axes after `stage` (pp_fsdp's data): stage 1 read as "
           "stage 0's second data shard"),
    Mutant("blind3-ticks-phase-by-jvp", "blind3", SRC_TICKS,
           'phases.add("backward" if "transpose(" in name else "forward")',
           'phases.add("backward" if "jvp(" in name else "forward")',
           (PIPELINE_TICKS,),
           "a branch's matmul is backward when its op_name holds jvp(: B's forward re-run counts as backward, so a B "
           "reads as W"),
    Mutant("blind3-ticks-gpipe-backward-not-reversed", "blind3", SRC_TICKS,
           "tick = trips - 1 - t if backward else t",
           "tick = t",
           (PIPELINE_TICKS,),
           "GPipe's transposed loop read forwards: its backward ticks in the forward's order (B0 first on the last stage)"),
    Mutant("blind3-ticks-w-from-earliest-write", "blind3", SRC_TICKS,
           "for before in range(t - 1, -1, -1):",
           "for before in range(t):",
           (PIPELINE_TICKS,),
           "a W's micro-batch is that of the EARLIEST B that wrote its stash slot, not the latest (a reused slot "
           "names an older micro-batch)"),
    Mutant("blind3-evaluate-lt-as-le", "blind3", SRC_EVALUATE,
           '"LT": np.less,',
           '"LT": np.less_equal,',
           (PIPELINE_TICKS,),
           "the evaluator computes compare LT as <=: JAX's negative-index wrap (select(i < 0, i + n, i)) fires at i = 0"),
    Mutant("blind3-draw-pipeline-tick-stage-swapped", "blind3", SRC_DRAW_PIPELINE,
           "out += [_box(t, s, row[s], y, ticks.virtual > 1) for t, row in enumerate(ticks.grid) if row[s] is not None]",
           "out += [_box(s, t, row[s], y, ticks.virtual > 1) for t, row in enumerate(ticks.grid) if row[s] is not None]",
           (PIPELINE_TICKS,),
           "a box is drawn with its tick and stage swapped (x at the stage's column, data-tick the stage)"),
    Mutant("blind3-megascale-slices-inside", "blind3", SRC_MEGASCALE,
           "return math.prod(n for a, n in zip(spec.names, spec.shape) if a in axes)",
           "return math.prod(n for a, n in zip(spec.names, spec.shape) if a not in axes)",
           (MEGASCALE, MAXTEXT_SLICES),
           "the slice count of a DCN record is the product of the axes INSIDE a slice: its group and ring bytes "
           "are the slice's chips'"),
    # ------------------------------------------------------------------ the schedule tables (parallel/pipeline.py, round_robin.py)
    Mutant("blind3-bubble-over-microbatches", "blind3", SRC_PIPELINE,
           "return (stages - 1) / ticks(microbatches, stages)",
           "return (stages - 1) / microbatches",
           (PIPELINE,),
           "GPipe's bubble fraction (S-1)/M (the bubble over the useful time), not (S-1)/(M+S-1)"),
    Mutant("blind3-in-flight-freed-by-b", "blind3", SRC_PIPELINE,
           "held += {FORWARD: 1, BACKWARD: -1, INPUT: 0, WEIGHT: -1}[a.kind]",
           "held += {FORWARD: 1, BACKWARD: -1, INPUT: -1, WEIGHT: 0}[a.kind]",
           (PIPELINE, PIPELINE_TICKS, MEMORY),
           "zb_h1's activations are counted freed at B (the input gradient), not at W: its in-flight count "
           "is 1F1B's"),
    Mutant("blind3-place-same-tick", "blind3", SRC_PIPELINE,
           "return a if dep is None or done.get(dep, t) < t else None",
           "return a if dep is None or done.get(dep, t) <= t else None",
           (PIPELINE, PIPELINE_TICKS, MEMORY),
           "an op may run in the same tick as the op it waits for (the hand-off's one tick dropped)"),
    Mutant("blind3-buffers-slot-reused-in-its-last-tick", "blind3", SRC_PIPELINE,
           "n = next((n for n, last in enumerate(used) if last < start), len(used))",
           "n = next((n for n, last in enumerate(used) if last <= start), len(used))",
           (PIPELINE, BF16_PARALLEL, MEMORY),
           "a ring slot is handed to a value that arrives in the tick its last reader reads it: the arrival, "
           "written at the end of the tick before, overwrites what that reader needs"),
    Mutant("blind3-round-robin-chunk-major", "blind3", SRC_ROUND_ROBIN,
           "        return device, local, layer\n",
           "        return local, device, layer\n",
           (PIPELINE,),
           "interleaved layers stored chunk-major (local chunk, then device), not device-major: the split over "
           "stage hands device 0 the chunks of devices 0 and 1"),
    # ------------------------------------------------------------------ the split backward and the scheduled loop (pp_split.py, pp.py, auto pp)
    Mutant("blind3-pp-head-backward-on-first", "blind3", SRC_MANUAL_PP,
           "return lax.cond(last, head_backward, lambda o, head: (ring_grad, head), out, head)",
           "return lax.cond((lax.axis_index(STAGE) == 0) & (chunk == 0), head_backward, "
           "lambda o, head: (ring_grad, head), out, head)",
           (PIPELINE, BF16_PARALLEL, MEMORY),
           "the head's backward (the ln_final and lm_head gradient, the output's gradient) runs on the first "
           "virtual stage, not the last"),
    Mutant("blind3-split-w-overwrites-the-sum", "blind3", SRC_PP_SPLIT,
           "return lax.dynamic_update_slice_in_dim(s, lax.dynamic_slice_in_dim(s, start, k, 0) + d.astype(s.dtype),",
           "return lax.dynamic_update_slice_in_dim(s, d.astype(s.dtype),",
           (PIPELINE, BF16_PARALLEL),
           "W (and an interleaved chunk's backward: one add_rows) writes each layer's weight gradient over its sum "
           "instead of adding it: the blocks keep the last micro-batch's gradient alone"),
    Mutant("blind3-pp-out-grad-last-stage-any-chunk", "blind3", SRC_MANUAL_PP,
           "last = (lax.axis_index(STAGE) == lax.axis_size(STAGE) - 1) & (chunk == v - 1)",
           "last = lax.axis_index(STAGE) == lax.axis_size(STAGE) - 1",
           (PIPELINE, BF16_PARALLEL),
           "the last DEVICE's every chunk runs the head's backward for its output gradient, not only the last "
           "virtual stage's (interleaved: its earlier chunks lose the gradient sent back from stage 0)"),
    Mutant("blind3-pp-stash-kept-at-w", "blind3", SRC_MANUAL_PP,
           "keep_at = into([[r if k == pipeline.INPUT else -1 for k, r in zip(kr, rr)]",
           "keep_at = into([[r if k == pipeline.WEIGHT else -1 for k, r in zip(kr, rr)]",
           (PIPELINE, BF16_PARALLEL, PIPELINE_TICKS),
           "zb_h1's stash is written to its slot at W's tick, not B's: W reads a slot no B wrote"),
    Mutant("blind3-pp-loss-not-averaged", "blind3", SRC_MANUAL_PP,
           "        return lax.psum(loss, STAGE) / m, sums\n",
           "        return lax.psum(loss, STAGE), sums\n",
           (PIPELINE, BF16_PARALLEL),
           "the scheduled pipeline's loss is the SUM of its micro-batches' mean losses (the / M dropped; the "
           "gradient keeps its 1/M seed)"),
    Mutant("blind3-auto-circular-first-output-dropped", "blind3", SRC_AUTO_PP,
           "return (state, self._per_stage(jnp.where(row(0) & (j >= 0), arrived, queue), 2)), None",
           "return (state, self._per_stage(jnp.where(row(0) & (j > 0), arrived, queue), 2)), None",
           (PIPELINE, BF16_PARALLEL),
           "the circular pipeline never stores the last stage's first output (j > 0): micro-batch 0's loss reads "
           "its input"),
    # ------------------------------------------------------------------ the fast path (hardware/fast_path.py, launch/common.py)
    Mutant("blind3-fast-given-batch-ignored", "blind3", SRC_FAST_PATH,
           'batch = t.batch_size if "batch_size" in given else best or t.batch_size',
           "batch = best or t.batch_size",
           (FAST_PATH,),
           "a given --batch_size is split by the preset's measured batch, not its own"),
    Mutant("blind3-fast-micro-tokens-strict", "blind3", SRC_FAST_PATH,
           "and n * m.context_length <= MICRO_BATCH_TOKENS), default=1)",
           "and n * m.context_length < MICRO_BATCH_TOKENS), default=1)",
           (FAST_PATH,),
           "a micro-batch of exactly MICRO_BATCH_TOKENS tokens (4 x 2048) is refused: half the measured best"),
    Mutant("blind3-fast-hbm-share-dropped", "blind3", SRC_FAST_PATH,
           "    if need <= HBM_SHARE * hbm:\n",
           "    if need <= hbm:\n",
           (FAST_PATH,),
           "remat none chosen where the memory model fits the WHOLE HBM, not HBM_SHARE of it"),
    Mutant("blind3-common-grad-accum-not-given", "blind3", SRC_COMMON,
           'given = {n: getattr(FLAGS, n) for n in (*MODEL_FLAGS, "batch_size", "grad_accum", "grad_accum_dtype")',
           'given = {n: getattr(FLAGS, n) for n in (*MODEL_FLAGS, "batch_size", "grad_accum_dtype")',
           (FAST_PATH,),
           "the launchers do not pass --grad_accum as given: the fast path's micro-batching overrules the flag"),
    Mutant("blind3-common-tokenizer-not-shape", "blind3", SRC_COMMON,
           'for n in (*SHAPE_FLAGS, *MOE_FLAGS, "tokenizer"))',
           "for n in (*SHAPE_FLAGS, *MOE_FLAGS))",
           (FAST_PATH,),
           "a --tokenizer (a new vocabulary) leaves the preset's measured batch in force"),
    # ------------------------------------------------------------------ across slices (chips.py, tools/maxtext_slices.py, launch/slices.py, mesh.py, hsdp)
    Mutant("blind3-v5e-dcn-per-host", "blind3", SRC_CHIPS,
           "V5E_DCN_BYTES_PER_S = 2 * 100 * _GBIT / 8\n",
           "V5E_DCN_BYTES_PER_S = 2 * 100 * _GBIT\n",
           (MAXTEXT_SLICES, MEGASCALE),
           "v5e's DCN rate per chip is the whole host's two NICs (not shared by its 8 chips): 8x too fast"),
    Mutant("blind3-maxtext-ring-growth-hops", "blind3", SRC_MAXTEXT_SLICES,
           "return ((slices - 1) / slices) / ((compiled - 1) / compiled)",
           "return (slices - 1) / (compiled - 1)",
           (MAXTEXT_SLICES,),
           "a ring all-reduce's bytes grow with the hop count N-1, not the share (N-1)/N"),
    Mutant("blind3-slices-batch-not-over-dcn", "blind3", SRC_SLICES,
           'batch_axes = (DCN_AXIS, run.placed.activations["batch"])',
           'batch_axes = run.placed.activations["batch"]',
           (MAXTEXT_SLICES, PLAN_SLICES),
           "across slices the batch is split inside a slice only: every slice computes the same rows, and no "
           "gradient crosses DCN"),
    Mutant("blind3-hybrid-default-inner-all-devices", "blind3", SRC_MESH,
           'mesh_spec = ",".join(f"{a}:{max(n_devices // slices, 1) if a == inner[0] else 1}" for a in inner)',
           'mesh_spec = ",".join(f"{a}:{n_devices if a == inner[0] else 1}" for a in inner)',
           (HSDP, MESH, MEGASCALE),
           "--dcn_mesh without --mesh: the axis inside a slice defaults to every device, not a slice's"),
    Mutant("blind3-auto-hsdp-sum-over-slices", "blind3", SRC_AUTO_HSDP,
           "jax.lax.with_sharding_constraint(jnp.mean(g, axis=0), s)",
           "jax.lax.with_sharding_constraint(jnp.sum(g, axis=0), s)",
           (HSDP,),
           "the GSPMD hsdp twin sums the slices' gradients instead of averaging them"),
    Mutant("blind3-cost-hsdp-whole-gradient", "blind3", SRC_COST_ROWS,
           'across = [row(ctx, "backward", "all-reduce", ("data",), r.count, r.bytes // r.count, '
           'f"hsdp_gather backward: pmean over "',
           'across = [row(ctx, "backward", "all-reduce", ("data",), r.count, r.bytes * ctx.mesh["fsdp"] // r.count, '
           'f"hsdp_gather backward: pmean over "',
           (HSDP, COST, MEGASCALE),
           "the cost model's hsdp all-reduce across slices carries each matrix's whole gradient, not its 1/fsdp shard"),
    # ------------------------------------------------------------------ gradient cast, pipeline stash, conv FLOPs, bench report, notes, fsdp_tp_sp
    Mutant("blind3-accum-cast-before-divide", "blind3", SRC_TRAINER,
           "jax.tree.map(lambda g, p: per_token(g, total).astype(p.dtype), grad_sum, params)",
           "jax.tree.map(lambda g, p: per_token(g.astype(p.dtype), total), grad_sum, params)",
           (ACCUM, GRADIENT_BYTES, EXPLICIT),
           "the float32 gradient sum cast to the weight dtype BEFORE the division by the token count "
           "(bf16: an extra rounding; the divisor's float32 promotes the result back to float32)"),
    Mutant("blind3-memory-stash-no-spare", "blind3", SRC_COST_MEMORY,
           'return backward + rings, rows, (sizes["res"] + 1) * split_stash(cfg, rows * seq, stages, dtype_bytes)',
           'return backward + rings, rows, sizes["res"] * split_stash(cfg, rows * seq, stages, dtype_bytes)',
           (MEMORY, PIPELINE),
           "zb_h1's stash ring counted without its spare slot (the one the ticks without a B write)"),
    Mutant("blind3-conv-feature-groups", "blind3", SRC_MATMUL_FLOPS,
           'groups = int(instr.attrs.get("batch_group_count", "1"))',
           'groups = int(instr.attrs.get("feature_group_count", "1"))',
           (STEP_TIME_MODEL,),
           "a convolution's FLOPs divide its batch by feature_group_count, not batch_group_count (a weight "
           "gradient's batch of groups counted whole)"),
    Mutant("blind3-bench-step-column-compile", "blind3", SRC_BENCH_REPORT,
           "f\"{r['tokens_per_s']:,.0f}\", f\"{vs['step_time']:.2f}\" if vs else \"-\",",
           "f\"{r['tokens_per_s']:,.0f}\", f\"{vs['compile_time']:.2f}\" if vs else \"-\",",
           (BENCH, TPU_BENCH),
           "the benchmark table's 'step / single' column shows the compile-time ratio"),
    Mutant("blind3-twin-notes-cpu-or", "blind3", SRC_TWIN_NOTES,
           'if platform == "cpu" and has_reduce_scatter else [])',
           'if platform == "cpu" or has_reduce_scatter else [])',
           (COLLECTIVES_CLI, DRAWING_CLAIMS),
           "the XLA:CPU reduce-scatter note printed on a TPU too, and on CPU for a strategy with no reduce-scatter"),
    Mutant("blind3-cost-fsdp-tp-sp-batch-not-split", "blind3", SRC_COST_ROWS,
           "sequence = repeated(ctx.k, _tp_sp_micro_batch_rows(ctx, ctx.batch // ctx.d // ctx.k))",
           "sequence = repeated(ctx.k, _tp_sp_micro_batch_rows(ctx, ctx.batch // ctx.k))",
           (SEQUENCE, COST, STRATEGIES),
           "fsdp_tp_sp's sequence gathers and scatters priced on the whole batch, not each data shard's B/data rows"),
]
