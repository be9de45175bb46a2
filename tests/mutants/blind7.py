"""Bugs written blind, a seventh round: realistic bugs in the code the project's trust rests on when it reads
a compiled program and plans a run: the HLO schedule reader (hlo/schedule.py) and the call graph's
multiplicities (hlo/loops.py), the step-time model (hlo/timing.py, hardware/step_time.py) and its links
(hardware/links.py), the timeline drawing (hlo/draw.py) and launch.collectives' side-by-side table and
--timeline, the XLA options (train/xla_options.py), int8 (model/quantize.py, model/matmuls.py), the assertion
API (testing.py, hlo/records.py, hlo/groups.py), the planner (hardware/plan.py, launch/plan.py) and the flags'
precedence (launch/common.py, launch/fit.py). Written at commit 5c80521 by someone who read the mutated modules'
source but not one test. Each mutant's `tests` were chosen mechanically (`grep -l` of the module's import path
or a function's name in tests/test_*.py, at most 3 files), not by reading the tests, so a `missed` one is a
gap the tests were not written around. docs/mutation-testing.md, "Bugs written blind", records how many were
caught."""

from .base import EXPLICIT, HLO, HLO_INPUT, Mutant, PLAN, QUANTIZATION, SRC_FIT, SRC_HLO_GROUPS, SRC_HLO_LOOPS, \
    SRC_HLO_RECORDS, SRC_HLO_TIMING, SRC_MATMULS, SRC_PLAN, SRC_QUANTIZE, SRC_XLA_OPTIONS, TPU

SRC_SCHEDULE = "twinshard/hlo/schedule.py"
SRC_STEP_TIME = "twinshard/hardware/step_time.py"
SRC_LINKS = "twinshard/hardware/links.py"
SRC_DRAW = "twinshard/hlo/draw.py"
SRC_TESTING = "twinshard/testing.py"
SRC_LAUNCH_PLAN = "launch/plan.py"
SRC_COLLECTIVES_CLI = "launch/collectives.py"
SRC_COMMON = "launch/common.py"

SCHEDULE = "tests/test_schedule.py"
SCHEDULE_READER = "tests/test_schedule_reader.py"
MEGASCALE = "tests/test_megascale.py"
STEP_TIME_MODEL = "tests/test_step_time_model.py"
DRAWING_CLAIMS = "tests/test_drawing_claims.py"
TIMELINE_CLI = "tests/test_timeline_cli.py"
HLO_API = "tests/test_hlo_api.py"
HLO_SELECTORS = "tests/test_hlo_selectors.py"
LAYERS_RULE = "tests/test_layers_rule.py"
CONTEXT = "tests/test_context.py"
COLLECTIVES_CLI = "tests/test_collectives_cli.py"
INT8_EDGES = "tests/test_int8_edges.py"
LAYERS = "tests/test_layers.py"
XLA_OPTIONS = "tests/test_xla_options.py"
OPTIONS = "tests/test_options.py"
SPEED_OPTIONS = "tests/test_speed_options.py"
PLAN_RANKING = "tests/test_plan_ranking.py"
PLAN_SLICES = "tests/test_plan_slices.py"
FLAG_PRECEDENCE = "tests/test_flag_precedence.py"
MEMORY_FIT = "tests/test_memory_fit.py"
CLI_ERRORS = "tests/test_cli_errors.py"
BENCH = "tests/test_bench.py"
GQA = "tests/test_gqa.py"

SCHEDULE_TESTS = (SCHEDULE_READER, SCHEDULE, MEGASCALE)  # `hlo.schedule`
LOOPS_TESTS = (HLO, SCHEDULE_READER, TPU)  # `multiplicities`, `trip_count`
TIMING_TESTS = (STEP_TIME_MODEL, DRAWING_CLAIMS, SCHEDULE)  # `predict(`, `hlo.timing`, `step_time`
SPLASH_TIMING_TESTS = (SCHEDULE, STEP_TIME_MODEL)  # `splash_share`, `predict(`
STEP_TIME_TESTS = (STEP_TIME_MODEL, SCHEDULE, MEGASCALE)  # `step_time`, `predict_step`
DRAW_TESTS = (SCHEDULE, DRAWING_CLAIMS, TIMELINE_CLI)  # `hlo.draw`, `timeline_svg`, `--timeline`
API_TESTS = (HLO_API, HLO_SELECTORS, HLO)  # `twinshard.testing`, `expect_collectives`, `max_count`
SHARDING_API_TESTS = (EXPLICIT, HLO_SELECTORS, LAYERS_RULE)  # `expect_sharding`
RECORDS_TESTS = (HLO, HLO_API, HLO_SELECTORS)  # `hlo.records`, `ring_bytes`, `reduction=`
GROUPS_TESTS = (HLO, CONTEXT, HLO_INPUT)  # `shift_pairs`, `ring_step`, `mesh_spec`
QUANTIZE_TESTS = (QUANTIZATION, INT8_EDGES, HLO)  # `quantize`
XLA_TESTS = (XLA_OPTIONS, OPTIONS, SPEED_OPTIONS)  # `xla_options`, `compiler_options`, `async_collectives`
PLANNER_TESTS = (PLAN_RANKING, PLAN, PLAN_SLICES)  # `hardware.plan`, `plan_all`
LAUNCH_PLAN_TESTS = (PLAN, PLAN_RANKING, FLAG_PRECEDENCE)  # `launch.plan`, `train_flags`, `matmul_efficiency`
FIT_TESTS = (MEMORY_FIT, FLAG_PRECEDENCE, CLI_ERRORS)  # `device_memory_gib`, `check_model`, `compile_checked`
SIDE_BY_SIDE_TESTS = (COLLECTIVES_CLI, DRAWING_CLAIMS)  # `side_by_side`
TIMELINE_FLAG_TESTS = (TIMELINE_CLI, CLI_ERRORS, COLLECTIVES_CLI)  # `--timeline`
FLAGS_TESTS = (FLAG_PRECEDENCE, CLI_ERRORS, GQA)  # `config_from_flags`, `with_model_flags`, `--vocab_size`

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ the schedule reader (hlo/schedule.py)
    Mutant("blind7-schedule-window-bytes-of-first-record", "blind7", SRC_SCHEDULE,
           "return sum(r.bytes for r in self.records)",
           "return self.records[0].bytes",
           SCHEDULE_TESTS,
           "a window of a tuple all-reduce reports the bytes of its first operand, not of all of them"),
    Mutant("blind7-schedule-tpu-window-closed-at-a-start", "blind7", SRC_SCHEDULE,
           'lambda i: i.opcode == "fusion" and any(c in dones for c in calls(i))',
           'lambda i: i.opcode == "fusion" and any(c in starts for c in calls(i))',
           SCHEDULE_TESTS,
           "a TPU async collective fusion's window waits for a start fusion, not its done: never closed, carried"),
    Mutant("blind7-schedule-continuation-not-chained", "blind7", SRC_SCHEDULE,
           "        elif is_link(instr):\n            chain.add(instr.name)\n            links.append(instr.name)\n",
           "        elif is_link(instr):\n            links.append(instr.name)\n",
           SCHEDULE_TESTS,
           "a continuation is listed but not followed: a done that reads the continuation's state is not found"),
    # ------------------------------------------------------------------ multiplicities (hlo/loops.py)
    Mutant("blind7-loops-branches-not-call-edges", "blind7", SRC_HLO_LOOPS,
           'for key in ("branch_computations", "called_computations"):',
           'for key in ("called_computations",):',
           LOOPS_TESTS,
           "a conditional's branch_computations are no call edges: its branches have no caller (counted once, "
           "no stream)"),
    Mutant("blind7-loops-bound-read-from-the-counter", "blind7", SRC_HLO_LOOPS,
           "bound = _constant(named.get(i.operands[1]))",
           "bound = _constant(named.get(i.operands[0]))",
           LOOPS_TESTS,
           "the inferred trip count reads the bound from the compare's first operand (the counter): unknown, once"),
    Mutant("blind7-loops-done-edges-added-to-start-edges", "blind7", SRC_HLO_LOOPS,
           "callers.setdefault(callee, sites)",
           "callers.setdefault(callee, []).extend(sites)",
           LOOPS_TESTS,
           "a computation called by an async start and its done counts both call sites: twice the runs"),
    # ------------------------------------------------------------------ the step-time model (hlo/timing.py)
    Mutant("blind7-timing-splash-share-smallest-head-dim", "blind7", SRC_HLO_TIMING,
           "return below[-1] if below else above[0] if above else self.splash_efficiency",
           "return below[0] if below else above[0] if above else self.splash_efficiency",
           SPLASH_TIMING_TESTS,
           "the splash kernel's efficiency is the smallest listed head_dim's, not the nearest one below"),
    Mutant("blind7-timing-splash-always-causal", "blind7", SRC_HLO_TIMING,
           "return matmuls * 2.0 * b * h * t * t * dh * (0.5 if self.causal else 1.0)",
           "return matmuls * 2.0 * b * h * t * t * dh * 0.5",
           SPLASH_TIMING_TESTS,
           "causal_attention=False is ignored: a full-mask splash kernel is priced at half its FLOPs"),
    Mutant("blind7-timing-matmul-dtype-of-result", "blind7", SRC_HLO_TIMING,
           'dtype = _HLO_TO_JNP.get(lhs.dtype, "bfloat16")',
           'dtype = _HLO_TO_JNP.get(res.dtype, "bfloat16")',
           TIMING_TESTS,
           "a dot is priced at the peak of its result's dtype (bf16 x bf16 -> f32 at the f32 peak, int8 -> s32 at "
           "bf16's), not its operands'"),
    Mutant("blind7-timing-splash-share-at-seq-len", "blind7", SRC_HLO_TIMING,
           "peak_share = r.splash_share(self._splash_q(instr).dims[-1])",
           "peak_share = r.splash_share(self._splash_q(instr).dims[-2])",
           SPLASH_TIMING_TESTS,
           "the splash kernel's efficiency is looked up at the sequence length, not the head_dim"),
    # ------------------------------------------------------------------ rates of a named chip (hardware/step_time.py)
    Mutant("blind7-step-time-no-int8-peak", "blind7", SRC_STEP_TIME,
           'for d in ("bfloat16", "float32", "int8")}',
           'for d in ("bfloat16", "float32")}',
           STEP_TIME_TESTS,
           "the chip's int8 peak is left out of its Rates: int8 dots priced at the bfloat16 peak"),
    Mutant("blind7-step-time-causal-not-passed", "blind7", SRC_STEP_TIME,
           "collective_seconds(op, axes, ring_bytes, known), causal_attention)",
           "collective_seconds(op, axes, ring_bytes, known))",
           STEP_TIME_TESTS,
           "predict_step drops causal_attention: a full-mask attention step is priced as causal"),
    # ------------------------------------------------------------------ links (hardware/links.py)
    Mutant("blind7-links-dcn-rate-read-as-bits", "blind7", SRC_LINKS,
           'return Link(rate, f"DCN {rate * 8 / 1e9:g} Gb/s per chip")',
           'return Link(rate / 8, f"DCN {rate * 8 / 1e9:g} Gb/s per chip")',
           (MEGASCALE, PLAN_SLICES),
           "the DCN rate, already in bytes/s, is divided by 8 again: DCN transfers take 8x as long"),
    Mutant("blind7-links-gpu-strides-reversed", "blind7", SRC_LINKS,
           "strides = {a: math.prod(mesh[b] for b in order[i + 1:]) for i, a in enumerate(order)}",
           "strides = {a: math.prod(mesh[b] for b in order[:i]) for i, a in enumerate(order)}",
           (PLAN, STEP_TIME_MODEL, PLAN_RANKING),
           "a GPU mesh axis's stride is the product of the axes outside it, not inside: data laid on NVLink"),
    Mutant("blind7-links-chips-count-every-slice", "blind7", SRC_LINKS,
           "        return math.prod(self.grid)\n",
           "        return math.prod(self.grid) * self.slices\n",
           (PLAN_SLICES, PLAN, MEGASCALE),
           "Topology.chips counts every slice's chips: a plan's mesh over one slice is asked to cover them all"),
    # ------------------------------------------------------------------ the timeline drawing (hlo/draw.py)
    Mutant("blind7-draw-exposed-in-ms", "blind7", SRC_DRAW,
           '("exposed-us", f"{c.exposed_s * 1e6:.4g}")',
           '("exposed-us", f"{c.exposed_s * 1e3:.4g}")',
           DRAW_TESTS,
           "a collective's exposed-us attribute (and its red strip) is in milliseconds: 1000x too short"),
    Mutant("blind7-draw-axis-of-shortest-twin", "blind7", SRC_DRAW,
           "span = max((length for *_, length in placed), default=0.0) or 1e-9",
           "span = min((length for *_, length in placed), default=0.0) or 1e-9",
           DRAW_TESTS,
           "the shared time axis spans the shorter twin: the longer one's boxes run off the right edge"),
    Mutant("blind7-draw-length-not-collapsed", "blind7", SRC_DRAW,
           "    return at(pred.sequence_s[seq.name]) - offset\n",
           "    return pred.sequence_s[seq.name]\n",
           DRAW_TESTS,
           "a sequence's drawn length is its full time, loops inside not collapsed to one iteration"),
    # ------------------------------------------------------------------ the assertion API (testing.py)
    Mutant("blind7-api-max-count-exclusive", "blind7", SRC_TESTING,
           "max_count is not None and n > max_count",
           "max_count is not None and n >= max_count",
           API_TESTS,
           "max_count is exclusive: exactly max_count collectives fails the assertion"),
    Mutant("blind7-api-no-collective-any-axes", "blind7", SRC_TESTING,
           "found = [r for r in ledger.filter(op=op, axes=axes, **select)",
           "found = [r for r in ledger.filter(op=op, **select)",
           API_TESTS,
           "expect_no_collective ignores axes=: any such op on another axis fails it"),
    Mutant("blind7-api-sharding-size-one-axes-kept", "blind7", SRC_TESTING,
           "return tuple(a for a in found if sizes.get(a, 2) > 1)",
           "return tuple(a for a in found if sizes.get(a, 2) >= 1)",
           SHARDING_API_TESTS,
           "expect_sharding keeps mesh axes of size 1: P('data') on data:1 no longer equals P(None)"),
    # ------------------------------------------------------------------ the ledger (hlo/records.py)
    Mutant("blind7-records-reduction-not-through-convert", "blind7", SRC_HLO_RECORDS,
           'while node.opcode in ("convert", "copy", "bitcast") and node.operands',
           'while node.opcode in ("copy", "bitcast") and node.operands',
           RECORDS_TESTS,
           "a reduction computation that adds in f32 and converts back is recorded as reduction 'convert'"),
    Mutant("blind7-records-summary-bytes-once", "blind7", SRC_HLO_RECORDS,
           's["bytes"] += r.bytes * r.multiplicity',
           's["bytes"] += r.bytes',
           (HLO, HLO_API, COLLECTIVES_CLI),
           "Ledger.summary's bytes count a collective in a loop once, not once per run (its count is per run)"),
    Mutant("blind7-records-group-size-is-group-count", "blind7", SRC_HLO_RECORDS,
           "n = max(len(g) for g in pos_groups)",
           "n = len(pos_groups)",
           RECORDS_TESTS,
           "a collective's group size is the number of groups, not their size: ring bytes and group_size wrong"),
    Mutant("blind7-records-source-line-prefix", "blind7", SRC_HLO_RECORDS,
           "not want_line or line == want_line)",
           "not want_line or line.startswith(want_line))",
           RECORDS_TESTS,
           "source='tp.py:4' selects line 42 too: the line matched as a prefix"),
    # ------------------------------------------------------------------ replica groups (hlo/groups.py)
    Mutant("blind7-groups-every-axis-varies", "blind7", SRC_HLO_GROUPS,
           "vary = [i for i in range(len(mesh.shape)) if len(set(coords[i])) > 1]",
           "vary = [i for i in range(len(mesh.shape)) if len(set(coords[i])) >= 1]",
           GROUPS_TESTS,
           "classify counts an axis a group holds constant as varying: every collective over every axis"),
    Mutant("blind7-groups-line-shift-wraps", "blind7", SRC_HLO_GROUPS,
           "((target >= 0) & (target < size)).all(0)",
           "((target >= 0) & (target < size)).any(0)",
           GROUPS_TESTS,
           "shift_pairs keeps a device that falls off the end while another coordinate is in range: a line "
           "becomes a ring on a mesh of two or more axes"),
    Mutant("blind7-groups-tie-wraps", "blind7", SRC_HLO_GROUPS,
           "return (w, True) if abs(w) < abs(d) else (d, False)",
           "return (w, True) if abs(w) <= abs(d) else (d, False)",
           GROUPS_TESTS,
           "an irregular permute's pair half-way round is read as wrapping (the tie goes the other way)"),
    # ------------------------------------------------------------------ int8 (model/quantize.py, model/matmuls.py)
    Mutant("blind7-int8-scale-in-compute-dtype", "blind7", SRC_QUANTIZE,
           "absmax = jnp.max(jnp.abs(v), axis=reduce, keepdims=True).astype(jnp.float32)",
           "absmax = jnp.max(jnp.abs(v), axis=reduce, keepdims=True)",
           QUANTIZE_TESTS,
           "the absmax (and so the scale) is left in the operand's dtype: bf16 scales, not float32"),
    Mutant("blind7-int8-dx-scales-per-column", "blind7", SRC_QUANTIZE,
           "gq = quantized(g * s_w.astype(g.dtype), (g.ndim - 1,))",
           "gq = quantized(g * s_w.astype(g.dtype), (0,))",
           QUANTIZE_TESTS,
           "dx's g s_w is quantized with its absmax over the first (batch) axis, not per token over `out`"),
    Mutant("blind7-matmul-int8-dw-forward-unquantized", "blind7", SRC_MATMULS,
           'if quantization == "none":',
           'if quantization != "int8":',
           (QUANTIZATION, INT8_EDGES, EXPLICIT),
           "int8_dw runs the forward (and dx) unquantized: only dW in int8"),
    Mutant("blind7-matmul-cotangent-psum-axes-reversed", "blind7", SRC_MATMULS,
           "if extra := tuple(sorted(varying_axes(ct) - varying_axes(primal))):",
           "if extra := tuple(sorted(varying_axes(primal) - varying_axes(ct))):",
           (EXPLICIT, LAYERS),
           "cotangent_like psums over the axes only the primal varies over, not those only the cotangent does"),
    # ------------------------------------------------------------------ XLA options (train/xla_options.py)
    Mutant("blind7-xla-vmem-in-mib", "blind7", SRC_XLA_OPTIONS,
           '"xla_tpu_scoped_vmem_limit_kib": "32768",',
           '"xla_tpu_scoped_vmem_limit_kib": "32",',
           XLA_TESTS,
           "the async collectives' scoped VMEM limit written in MiB into a KiB option: 32 KiB"),
    Mutant("blind7-xla-vmem-smaller-of-two", "blind7", SRC_XLA_OPTIONS,
           'vmem = max(cfg.xla_tpu_scoped_vmem_limit_kib, int(options.get("xla_tpu_scoped_vmem_limit_kib", 0)))',
           'vmem = min(cfg.xla_tpu_scoped_vmem_limit_kib, int(options.get("xla_tpu_scoped_vmem_limit_kib", 0)))',
           XLA_TESTS,
           "the scoped VMEM limit is the smaller of the config's and the async options' (0 without them)"),
    # ------------------------------------------------------------------ the planner (hardware/plan.py)
    Mutant("blind7-plan-axis-last-collective-wins", "blind7", SRC_PLAN,
           "        out[axis] += seconds\n",
           "        out[axis] = seconds\n",
           PLANNER_TESTS,
           "an axis's communication time is its last (op, axes) row's, not the sum of them"),
    Mutant("blind7-plan-interleaved-factor-per-stage", "blind7", SRC_PLAN,
           "for row in kinds) / (3 * microbatches * virtual)",
           "for row in kinds) / (3 * microbatches)",
           PLANNER_TESTS,
           "interleaved's ticks (each 1/V of a stage) are counted as whole-stage ticks: its factor V times too big"),
    Mutant("blind7-plan-fewer-microbatches-than-stages", "blind7", SRC_PLAN,
           "counts = [m for m in range(stages, rows + 1) if rows % m == 0]",
           "counts = [m for m in range(1, rows + 1) if rows % m == 0]",
           PLANNER_TESTS,
           "the planner tries fewer micro-batches than stages (launch.train refuses them)"),
    Mutant("blind7-plan-across-one-slice-batch", "blind7", SRC_PLAN,
           "c, flat = _across(cfg, topo, batch * topo.slices, optimizer, precision)",
           "c, flat = _across(cfg, topo, batch, optimizer, precision)",
           PLANNER_TESTS,
           "fsdp across slices is costed on one slice's batch over every chip: 1/N of the activations"),
    # ------------------------------------------------------------------ launch.plan
    Mutant("blind7-launch-plan-optimizer-not-in-launch-line", "blind7", SRC_LAUNCH_PLAN,
           '        ("optimizer", cfg.train.optimizer, base.train.optimizer),\n',
           "",
           LAUNCH_PLAN_TESTS,
           "the launch line drops --optimizer: launch.train trains with the preset's optimizer, not the planned one"),
    Mutant("blind7-launch-plan-mfu-is-hbm-efficiency", "blind7", SRC_LAUNCH_PLAN,
           "return measured.matmul_efficiency, f\"the matmul efficiency measured on",
           "return measured.hbm_efficiency, f\"the matmul efficiency measured on",
           LAUNCH_PLAN_TESTS,
           "the default --mfu is the chip's measured HBM efficiency, not its matmul efficiency"),
    Mutant("blind7-launch-plan-dtypes-swapped", "blind7", SRC_LAUNCH_PLAN,
           "precision = Precision(FLAGS.param_dtype, FLAGS.optimizer_dtype, FLAGS.master_weights)",
           "precision = Precision(FLAGS.optimizer_dtype, FLAGS.param_dtype, FLAGS.master_weights)",
           LAUNCH_PLAN_TESTS,
           "--param_dtype sets the optimizer state's bytes and --optimizer_dtype the params'"),
    # ------------------------------------------------------------------ does it fit (launch/fit.py)
    Mutant("blind7-fit-device-memory-in-gb", "blind7", SRC_FIT,
           'return int(gib * GIB), f"--device_memory_gib={gib:g}"',
           'return int(gib * 1e9), f"--device_memory_gib={gib:g}"',
           FIT_TESTS,
           "--device_memory_gib is read as GB, not GiB: 7% less memory than asked"),
    Mutant("blind7-fit-host-memory-not-shared", "blind7", SRC_FIT,
           "return total // len(local), f\"this host's",
           "return total, f\"this host's",
           FIT_TESTS,
           "on a CPU each simulated device is given the whole host's memory, not its share"),
    Mutant("blind7-fit-sure-discount-on-activations", "blind7", SRC_FIT,
           "surely = need.total - (1 - SURE) * need.temporaries",
           "surely = need.total - (1 - SURE) * need.activations",
           FIT_TESTS,
           "the sure part discounts only the activations, not every temporary: steps refused that may fit"),
    # ------------------------------------------------------------------ launch.collectives (side by side, --timeline)
    Mutant("blind7-side-by-side-totals-per-op", "blind7", SRC_COLLECTIVES_CLI,
           "acc = totals.setdefault(axes, [dict(zero) for _ in range(len(cells) + 1)])[i]",
           "acc = totals.setdefault(op, [dict(zero) for _ in range(len(cells) + 1)])[i]",
           SIDE_BY_SIDE_TESTS,
           "the side-by-side TOTAL rows sum per op, not per mesh axes (and print the op as the axes)"),
    Mutant("blind7-timeline-first-twin-only", "blind7", SRC_COLLECTIVES_CLI,
           'svgs.append(draw.timeline_svg([(res["impl"], res["prediction"]) for res in results], _title(pod, results)))',
           'svgs.append(draw.timeline_svg([(res["impl"], res["prediction"]) for res in results[:1]], _title(pod, results)))',
           TIMELINE_FLAG_TESTS,
           "--timeline with --impl=auto,manual draws only the first twin"),
    Mutant("blind7-timeline-pipeline-needs-topology", "blind7", SRC_COLLECTIVES_CLI,
           'if getattr(FLAGS, flag) and not FLAGS.topology and not (flag == "timeline" and pipeline):',
           "if getattr(FLAGS, flag) and not FLAGS.topology:",
           TIMELINE_FLAG_TESTS,
           "a pipeline's --timeline (its ticks, no chip timing) is refused without --topology"),
    # ------------------------------------------------------------------ flags and their precedence (launch/common.py)
    Mutant("blind7-flags-warmup-longer-than-steps", "blind7", SRC_COMMON,
           'overrides["warmup_steps"] = min(train.warmup_steps, overrides["steps"])',
           'overrides["warmup_steps"] = max(train.warmup_steps, overrides["steps"])',
           FLAGS_TESTS,
           "--steps sets the warmup to the larger of the preset's and the steps: a short run never leaves warmup"),
    Mutant("blind7-flags-vocab-equal-refused", "blind7", SRC_COMMON,
           "FLAGS.vocab_size < (ids := tokenizer_vocab(cfg.train.tokenizer)):",
           "FLAGS.vocab_size <= (ids := tokenizer_vocab(cfg.train.tokenizer)):",
           FLAGS_TESTS,
           "--vocab_size equal to the tokenizer's id count is refused (off by one)"),
    Mutant("blind7-flags-async-collectives-pinned-on", "blind7", SRC_COMMON,
           'define(flags.DEFINE_bool, "async_collectives", None,',
           'define(flags.DEFINE_bool, "async_collectives", True,',
           (FLAG_PRECEDENCE, OPTIONS, XLA_OPTIONS),
           "--async_collectives defaults to True, not the preset's: the flag overrides a preset (and the fast "
           "path) that sets it off"),
    Mutant("blind7-flags-output-refused-without-force-flag", "blind7", SRC_COMMON,
           "if force is False and os.path.exists(path):",
           "if not force and os.path.exists(path):",
           (BENCH, CLI_ERRORS, COLLECTIVES_CLI),
           "an existing output file is refused by launchers that have no --force (force=None) too"),
]
