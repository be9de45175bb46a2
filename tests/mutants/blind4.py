"""Bugs written blind, a fourth round: realistic bugs in the code that changed after the third round
(commit 67b02dc): the tick loop priced trip by trip and the step-time model around it, the ticks reader's
chunks, pred conditionals and circular loop, the peeled loop counter, the drawing's chunks, the planner's
interleaved V and its schedule section, the bf16 gradient sum (--grad_accum_dtype) from the flag through the
fast path, the trainer, each twin's runner, the cost model and the memory model, the hsdp twins' per-layer
mean across slices and its cost rows, the circular schedule's table, and the resume's model check. Written
at commit 8d4715e by someone who read the mutated modules' source but not one test. Each mutant's `tests`
were chosen mechanically (`grep -l` of the module's import path or a function's name in tests/test_*.py,
at most 3 files), not by reading the tests, so a `missed` one is a gap the tests were not written around.
docs/mutation-testing.md, "Bugs written blind", records how many were caught."""

from .base import (ACCUM, COST, EXPLICIT, GRADIENT_BYTES, HLO, MEMORY, Mutant, OPTIONS, PLAN, SCHEDULE,
                   SRC_COST_MEMORY, SRC_COST_ROWS, SRC_CONFIG, SRC_HLO_LOOPS, SRC_HLO_TIMING, SRC_PLAN, SRC_TRAINER,
                   SRC_FSDP, TRAIN, TPU)

SRC_TICK_TIMING = "twinshard/hlo/tick_timing.py"
SRC_TICKS = "twinshard/hlo/pipeline_ticks.py"
SRC_DRAW_PIPELINE = "twinshard/hlo/draw_pipeline.py"
SRC_LAUNCH_PLAN = "launch/plan.py"
SRC_FAST_PATH = "twinshard/hardware/fast_path.py"
SRC_COST_INIT = "twinshard/cost/__init__.py"
SRC_MANUAL_HSDP = "manual_parallel/hsdp.py"
SRC_MANUAL_COLLECTIVES = "manual_parallel/collectives.py"
SRC_AUTO_HSDP = "auto_parallel/hsdp.py"
SRC_AUTO_RUNNER = "auto_parallel/runner.py"
SRC_MANUAL_RUNNER = "manual_parallel/runner.py"
SRC_PIPELINE = "twinshard/parallel/pipeline.py"
SRC_LAUNCH_TRAIN = "launch/train.py"
SRC_COMMON = "launch/common.py"
SRC_BENCH = "launch/bench.py"

TICK_PRICES = "tests/test_tick_prices.py"
STEP_TIME_MODEL = "tests/test_step_time_model.py"
PIPELINE_TICKS = "tests/test_pipeline_ticks.py"
PIPELINE = "tests/test_pipeline.py"
STRATEGIES = "tests/test_strategies.py"
SCHEDULE_READER = "tests/test_schedule_reader.py"
PLAN_RANKING = "tests/test_plan_ranking.py"
FAST_PATH = "tests/test_fast_path.py"
BENCH = "tests/test_bench.py"
FLAG_PRECEDENCE = "tests/test_flag_precedence.py"
GQA = "tests/test_gqa.py"
MEMORY_FIT = "tests/test_memory_fit.py"
HSDP = "tests/test_hsdp.py"
MEGASCALE = "tests/test_megascale.py"

TICK_TESTS = (TICK_PRICES, STEP_TIME_MODEL, HLO)  # tick_timing; `tick_s`; `tick_loop`
TICKS_TESTS = (PIPELINE_TICKS, TICK_PRICES, PIPELINE)  # hlo.pipeline_ticks
CIRCULAR_TESTS = (PIPELINE_TICKS, PIPELINE, STRATEGIES)  # `circular`
TIMING_TESTS = (STEP_TIME_MODEL, TICK_PRICES, SCHEDULE)  # hlo.timing; `tick_s`
PLANNER_TESTS = (PLAN_RANKING, PLAN)  # `schedule_choices`, `pipeline_schedules`, `pipeline_factor`, `train_flags`
ACCUM_SUM_TESTS = (ACCUM, EXPLICIT, GRADIENT_BYTES)  # `accumulated_value_and_grad`
ACCUM_FLAG_TESTS = (ACCUM, OPTIONS, GQA)  # `grad_accum_dtype`
HSDP_TESTS = (HSDP, MEGASCALE)  # `hsdp`, `hsdp_gather`

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ the tick loop priced trip by trip (hlo/tick_timing.py)
    Mutant("blind4-tick-loop-first-trip-dropped", "blind4", SRC_TICK_TIMING,
           "columns.append([_run(mod, frames.at(t), switch) for t in range(trips)])",
           "columns.append([_run(mod, frames.at(t), switch) for t in range(1, trips)])",
           TICK_TESTS,
           "the tick loop read from trip 1: its first trip (the first forward) neither read nor priced"),
    Mutant("blind4-tick-slowest-is-fastest", "blind4", SRC_TICK_TIMING,
           "return max(range(len(self.cell_s[t])), key=lambda s: self.cell_s[t][s])",
           "return min(range(len(self.cell_s[t])), key=lambda s: self.cell_s[t][s])",
           TICK_TESTS,
           "TickPrices.slowest names the FASTEST stage of a trip: the critical path's rows count the idle stages' branches"),
    Mutant("blind4-tick-share-over-stages", "blind4", SRC_TICK_TIMING,
           "return {seq: runs.get(seq, 0) / len(prices.tick_s) for seq in under}",
           "return {seq: runs.get(seq, 0) / len(prices.loop.runs[0]) for seq in under}",
           TICK_TESTS,
           "a branch's critical share divided by the stage count, not the trip count"),
    Mutant("blind4-tick-trip-switch-not-matched", "blind4", SRC_TICK_TIMING,
           "lambda i, d=tick: d if i.name == loop.switch else None",
           "lambda i, d=tick: d if i.name == loop.body else None",
           TICK_TESTS,
           "the trip's switch matched by the body's name (which no instruction has): every trip priced at the "
           "longest branch"),
    Mutant("blind4-tick-choices-not-nested", "blind4", SRC_TICK_TIMING,
           "out += [(cond.name, branches(cond)[k])] + _choices(mod, inner)",
           "out += [(cond.name, branches(cond)[k])]",
           TICK_TESTS,
           "the conditionals inside a taken branch (the loss's cond inside the last stage's head) are not "
           "evaluated: priced at their longest"),
    Mutant("blind4-tick-collectives-not-on-critical-path", "blind4", SRC_TICK_TIMING,
           "return [scaled(o, o.computation) for o in ops], [scaled(c, c.window.computation) for c in colls]",
           "return [scaled(o, o.computation) for o in ops], colls",
           TICK_TESTS,
           "the collectives under the switch count every trip, the ops only their critical share: "
           "compute_s + exposed_s != step_s"),
    # ------------------------------------------------------------------ the compiled step's ticks (hlo/pipeline_ticks.py)
    Mutant("blind4-ticks-virtual-off-by-one", "blind4", SRC_TICKS,
           "return 1 + max((c.chunk for row in self.grid for c in row if c is not None), default=0)",
           "return max((c.chunk for row in self.grid for c in row if c is not None), default=1)",
           TICKS_TESTS,
           "Ticks.virtual is the highest chunk read, not one more: V=2 reads as 1, its labels lose their chunk"),
    Mutant("blind4-ticks-chunk-from-rings", "blind4", SRC_TICKS,
           "if frames.carried_unchanged(j) and size < rows}",
           "if not frames.carried_unchanged(j) and size < rows}",
           TICKS_TESTS,
           "a branch's chunk read from the carried rings it slices (the loop rewrites them), not the invariant "
           "stacked weights"),
    Mutant("blind4-ticks-slice-rows-of-operand", "blind4", SRC_TICKS,
           "slices[j] = (int(f.value(i.operands[1])), parse_shape(i.shape_text).dims[0], rows)",
           "slices[j] = (int(f.value(i.operands[1])), rows, rows)",
           TICKS_TESTS,
           "a dynamic-slice's rows taken from its operand, not its result: no slice is narrower than its array, "
           "every chunk reads 0"),
    Mutant("blind4-ticks-circular-chunk-microbatch-swapped", "blind4", SRC_TICKS,
           'Cell("B" if backward else "F", (tick - s) % m, (tick - s) // m)',
           'Cell("B" if backward else "F", (tick - s) // m, (tick - s) % m)',
           CIRCULAR_TESTS,
           "the circular loop's cell names the chunk as its micro-batch and the micro-batch as its chunk"),
    Mutant("blind4-ticks-circular-ops-off-by-one", "blind4", SRC_TICKS,
           "ops = loops[0][1] - (stages - 1)  # each stage's useful ticks in the forward loop: V M",
           "ops = loops[0][1] - stages  # each stage's useful ticks in the forward loop: V M",
           CIRCULAR_TESTS,
           "a stage's useful forward ticks are the loop's ticks less S, not S - 1 (V M - 1: not a multiple of M)"),
    Mutant("blind4-ticks-pred-true-is-branch-one", "blind4", SRC_TICKS,
           "        k = 0 if k else 1\n",
           "        k = 1 if k else 0\n",
           TICKS_TESTS,
           "a pred conditional's true taken as branch 1 (its false computation): lax.cond's branches read "
           "inverted"),
    Mutant("blind4-ticks-ring-reads-of-invariants", "blind4", SRC_TICKS,
           "            if not frames.carried_unchanged(j)}",
           "            if frames.carried_unchanged(j)}",
           TICKS_TESTS,
           "a W's ring reads taken from the loop's invariant arrays (the weights), not the rings it rewrites: no "
           "B wrote them"),
    # ------------------------------------------------------------------ a peeled loop's counter (hlo/loops.py)
    Mutant("blind4-loops-peeled-start-added", "blind4", SRC_HLO_LOOPS,
           "return max(bound - _start(w, named.get(i.operands[0]), mod), 0), False",
           "return max(bound + _start(w, named.get(i.operands[0]), mod), 0), False",
           (HLO, SCHEDULE_READER, TPU),
           "a loop whose counter starts at 1 (XLA peeled its first iteration) counted L + 1 trips, not L - 1"),
    # ------------------------------------------------------------------ the step-time model around the tick loop (hlo/timing.py)
    Mutant("blind4-timing-tick-body-not-mean", "blind4", SRC_HLO_TIMING,
           "seconds[seq.name] = ticks.loop_s / len(ticks.trip_s)",
           "seconds[seq.name] = ticks.loop_s",
           TIMING_TESTS,
           "the tick loop's body stored as the whole loop, not its mean trip: the while multiplies it by the "
           "trips again"),
    Mutant("blind4-timing-branch-prices-not-passed", "blind4", SRC_HLO_TIMING,
           "ticks = price(loop, lambda name, took: _simulate(sched.sequences[name], sched, pricer, seconds, took=took))",
           "ticks = price(loop, lambda name, took: _simulate(sched.sequences[name], sched, pricer, seconds))",
           TIMING_TESTS,
           "price's per-trip seconds not passed to the simulation: every trip and Run priced at the longest "
           "branch"),
    Mutant("blind4-timing-compiled-as-text", "blind4", SRC_HLO_TIMING,
           "        compiled_or_hlo_text = full_text(compiled_or_hlo_text)\n",
           "        compiled_or_hlo_text = compiled_or_hlo_text.as_text()\n",
           TIMING_TESTS,
           "a Compiled read with as_text(), whose tick tables are elided: the tick loop is unreadable and priced "
           "as any loop"),
    Mutant("blind4-timing-ticks-dict-swapped", "blind4", SRC_HLO_TIMING,
           '"ticks": None if self.ticks is None else {"tick_s": self.ticks.tick_s, "trip_s": self.ticks.trip_s,',
           '"ticks": None if self.ticks is None else {"tick_s": self.ticks.trip_s, "trip_s": self.ticks.tick_s,',
           TIMING_TESTS,
           "as_dict's ticks: the switch's seconds and the whole trip's swapped"),
    Mutant("blind4-timing-tick-table-in-us", "blind4", SRC_HLO_TIMING,
           "f\"{min(self.ticks.tick_s) * 1e3:.3f}-{max(self.ticks.tick_s) * 1e3:.3f} ms; slowest stage \"",
           "f\"{min(self.ticks.tick_s) * 1e6:.3f}-{max(self.ticks.tick_s) * 1e6:.3f} ms; slowest stage \"",
           TIMING_TESTS,
           "the table's tick range printed in microseconds, labelled ms"),
    # ------------------------------------------------------------------ the pipeline drawing's chunks (hlo/draw_pipeline.py)
    Mutant("blind4-draw-chunk-attribute-microbatch", "blind4", SRC_DRAW_PIPELINE,
           "f'data-chunk=\"{cell.chunk}\"><title>",
           "f'data-chunk=\"{cell.microbatch}\"><title>",
           (PIPELINE_TICKS,),
           "a box's data-chunk carries its micro-batch"),
    Mutant("blind4-draw-label-without-chunk", "blind4", SRC_DRAW_PIPELINE,
           "f'{cell.label(chunked)}</text></g>')",
           "f'{cell.label()}</text></g>')",
           (PIPELINE_TICKS,),
           "an interleaved box is labelled F0, not F0.1: its chunk only in the title"),
    # ------------------------------------------------------------------ the planner's interleaved V (hardware/plan.py)
    Mutant("blind4-plan-virtual-max-excluded", "blind4", SRC_PLAN,
           "for v in (range(2, MAX_VIRTUAL + 1) if s in pipeline.INTERLEAVED else (1,)) if per_stage % v == 0]",
           "for v in (range(2, MAX_VIRTUAL) if s in pipeline.INTERLEAVED else (1,)) if per_stage % v == 0]",
           PLANNER_TESTS,
           "interleaved tried for V in 2 ... MAX_VIRTUAL - 1: V = 4 never planned"),
    Mutant("blind4-plan-virtual-splits-the-model", "blind4", SRC_PLAN,
           "for v in (range(2, MAX_VIRTUAL + 1) if s in pipeline.INTERLEAVED else (1,)) if per_stage % v == 0]",
           "for v in (range(2, MAX_VIRTUAL + 1) if s in pipeline.INTERLEAVED else (1,)) if num_layers % v == 0]",
           PLANNER_TESTS,
           "a V is tried where it splits the model's L layers, not a stage's L/S"),
    Mutant("blind4-plan-interleaved-m-multiple-of-v", "blind4", SRC_PLAN,
           "for m in (m for m in counts if virtual == 1 or m % stages == 0):",
           "for m in (m for m in counts if virtual == 1 or m % virtual == 0):",
           PLANNER_TESTS,
           "interleaved's M searched over multiples of V, not of S (M = 6 on 4 stages planned)"),
    Mutant("blind4-plan-bubble-without-virtual", "blind4", SRC_PLAN,
           'return pipeline.build(self.schedule, self.mesh["stage"], self.microbatches, self.virtual).bubble()',
           'return pipeline.build(self.schedule, self.mesh["stage"], self.microbatches).bubble()',
           PLANNER_TESTS,
           "Plan.bubble builds interleaved's table with V = 1"),
    Mutant("blind4-plan-factor-without-virtual", "blind4", SRC_PLAN,
           'compute *= pipeline_factor(microbatches, mesh["stage"], schedule, virtual)',
           'compute *= pipeline_factor(microbatches, mesh["stage"], schedule)',
           PLANNER_TESTS,
           "an interleaved plan's compute factor from V = 1's table"),
    Mutant("blind4-plan-memory-without-virtual", "blind4", SRC_PLAN,
           "schedule=schedule, gpu=not topo.chip.is_tpu, flat_weights=flat, virtual_stages=virtual,",
           "schedule=schedule, gpu=not topo.chip.is_tpu, flat_weights=flat,",
           PLANNER_TESTS,
           "an interleaved plan's cost (its sends, its activations in flight) priced at V = 1"),
    Mutant("blind4-plan-schedules-of-every-mesh", "blind4", SRC_PLAN,
           "key = lambda p: (p.strategy, p.mesh, p.slices, p.across)  # noqa: E731",
           "key = lambda p: (p.strategy, p.slices, p.across)  # noqa: E731",
           PLANNER_TESTS,
           "pipeline_schedules lists the schedules of every mesh of the best pipeline strategy, not its best mesh's"),
    # ------------------------------------------------------------------ launch.plan's schedule section and flags
    Mutant("blind4-launch-plan-section-factor-v1", "blind4", SRC_LAUNCH_PLAN,
           "f\"{pipeline_factor(p.microbatches, p.mesh['stage'], p.schedule, p.virtual):.3f}\",",
           "f\"{pipeline_factor(p.microbatches, p.mesh['stage'], p.schedule):.3f}\",",
           PLANNER_TESTS,
           "the schedule section's 'compute x' column of an interleaved row is V = 1's"),
    Mutant("blind4-launch-plan-flags-without-virtual", "blind4", SRC_LAUNCH_PLAN,
           '        ("schedule", plan.schedule, base.train.schedule),\n'
           '        ("virtual_stages", plan.virtual, base.train.virtual_stages)) if v != d]',
           '        ("schedule", plan.schedule, base.train.schedule)) if v != d]',
           PLANNER_TESTS,
           "the launch line of an interleaved plan has no --virtual_stages: launch.train runs V = 1"),
    # ------------------------------------------------------------------ the fast path's gradient sum (hardware/fast_path.py)
    Mutant("blind4-fast-accum-sum-judged-before-choices", "blind4", SRC_FAST_PATH,
           "candidates += _accum_sum(apply(cfg, [c for c in candidates if c.name not in given]))",
           "candidates += _accum_sum(cfg)",
           (FAST_PATH, BENCH),
           "grad_accum_dtype judged on the preset before the fast path's bf16 weights and micro-batching: never chosen"),
    Mutant("blind4-fast-shape-accum-given-by-batch", "blind4", SRC_FAST_PATH,
           '    if "grad_accum" not in given:\n        micro = max(',
           '    if "batch_size" not in given:\n        micro = max(',
           (FAST_PATH, BENCH),
           "a shape no preset measured: its micro-batching skipped where --batch_size was given, kept where "
           "--grad_accum was"),
    Mutant("blind4-fast-shape-state-float32", "blind4", SRC_FAST_PATH,
           'grad_accum=accum, remat="none", param_bytes=weight_bytes, state_bytes=weight_bytes, tpu=True).total',
           'grad_accum=accum, remat="none", param_bytes=weight_bytes, tpu=True).total',
           (FAST_PATH, BENCH),
           "the remat choice's memory model prices AdamW's moments in float32 under bf16 weights"),
    # ------------------------------------------------------------------ the gradient sum (train/trainer.py, config.py, the twins' runners)
    Mutant("blind4-trainer-step-sum-dtype-dropped", "blind4", SRC_TRAINER,
           "                                           grad_accum=train_cfg.grad_accum, sum_dtype=train_cfg.grad_accum_dtype,\n",
           "                                           grad_accum=train_cfg.grad_accum,\n",
           ACCUM_SUM_TESTS,
           "train_step's default value_and_grad sums in float32 whatever --grad_accum_dtype says"),
    Mutant("blind4-trainer-single-sum-dtype-dropped", "blind4", SRC_TRAINER,
           "            grad_accum=train_cfg.grad_accum, sum_dtype=train_cfg.grad_accum_dtype))",
           "            grad_accum=train_cfg.grad_accum))",
           ACCUM_SUM_TESTS,
           "SingleDevice.loss_and_grads (the reference) sums in float32 whatever --grad_accum_dtype says"),
    Mutant("blind4-trainer-loss-mean-of-sums", "blind4", SRC_TRAINER,
           "return jnp.sum(loss_sums) / total, jax.tree.map(",
           "return jnp.mean(loss_sums) / total, jax.tree.map(",
           ACCUM_SUM_TESTS,
           "the accumulated loss is the mean of the micro-batches' summed losses over ALL tokens: 1/K of the loss"),
    Mutant("blind4-config-default-weight-sum", "blind4", SRC_CONFIG,
           'grad_accum_dtype: str = "float32"  # their sum',
           'grad_accum_dtype: str = "weight"  # their sum',
           (ACCUM, FAST_PATH, FLAG_PRECEDENCE),  # the same grep's hits; first run with ACCUM_FLAG_TESTS: missed
           "the default gradient sum is the weight dtype: bf16 weights sum in bf16 unless the flag says float32"),
    Mutant("blind4-manual-runner-sum-dtype-dropped", "blind4", SRC_MANUAL_RUNNER,
           "return accumulated_value_and_grad(local, params, x, y, self.cfg.train.grad_accum,\n"
           "                                          sum_dtype=self.cfg.train.grad_accum_dtype)",
           "return accumulated_value_and_grad(local, params, x, y, self.cfg.train.grad_accum)",
           ACCUM_FLAG_TESTS,
           "the manual twin sums in float32 whatever --grad_accum_dtype says"),
    Mutant("blind4-auto-runner-shard-sum-dtype-dropped", "blind4", SRC_AUTO_RUNNER,
           "per_shard = jax.vmap(functools.partial(accumulated_value_and_grad, self.shard_loss, shared, grad_accum=k,\n"
           "                                               sum_dtype=self.cfg.train.grad_accum_dtype),",
           "per_shard = jax.vmap(functools.partial(accumulated_value_and_grad, self.shard_loss, shared, grad_accum=k),",
           ACCUM_FLAG_TESTS,
           "the GSPMD twin's per-shard accumulation (data > 1) sums in float32 whatever --grad_accum_dtype says"),
    Mutant("blind4-auto-hsdp-sum-dtype-dropped", "blind4", SRC_AUTO_HSDP,
           "loss, grads = accumulated_value_and_grad(self.slice_loss, params, xs, ys, k,\n"
           "                                                    sum_dtype=self.cfg.train.grad_accum_dtype)",
           "loss, grads = accumulated_value_and_grad(self.slice_loss, params, xs, ys, k)",
           (HSDP, ACCUM),
           "the GSPMD hsdp twin sums each slice's micro-batches in float32 whatever --grad_accum_dtype says"),
    # ------------------------------------------------------------------ the sum's bytes (cost/__init__.py, cost/memory.py)
    Mutant("blind4-cost-accum-bytes-inverted", "blind4", SRC_COST_INIT,
           'accum_bytes=w if t.grad_accum_dtype == "weight" else 4)',
           'accum_bytes=4 if t.grad_accum_dtype == "weight" else w)',
           (ACCUM, COST, MEMORY_FIT),
           "a resolved run's accumulator bytes inverted: the weight sum priced float32, the float32 sum in the "
           "weight dtype"),
    Mutant("blind4-cost-accum-bytes-not-passed", "blind4", SRC_COST_INIT,
           "remat, schedule, gpu, param_bytes, state_bytes, master, virtual, tpu=tpu,\n"
           "                       accum_bytes=accum_bytes), notes)",
           "remat, schedule, gpu, param_bytes, state_bytes, master, virtual, tpu=tpu), notes)",
           (ACCUM, COST, MEMORY_FIT),
           "_priced does not pass accum_bytes on: the memory model's accumulator always float32"),
    Mutant("blind4-memory-fsdp-accumulator-float32", "blind4", SRC_COST_MEMORY,
           "accumulator = sum(w.count * local_bytes(cfg, w, mesh, t, accum_bytes) for w in weights(cfg))",
           "accumulator = sum(w.count * local_bytes(cfg, w, mesh, t, F32) for w in weights(cfg))",
           (ACCUM, MEMORY),
           "under FSDP the (whole matrices') accumulator priced in float32 whatever --grad_accum_dtype says"),
    Mutant("blind4-memory-accumulator-of-stored-params", "blind4", SRC_COST_MEMORY,
           "accumulator = masters * accum_bytes // F32",
           "accumulator = params * accum_bytes // F32",
           (ACCUM, MEMORY),
           "the accumulator scaled from the params' stored bytes, not float32's: bf16 weights count it twice over"),
    # ------------------------------------------------------------------ the hsdp twins (manual hsdp.py, collectives.py, fsdp.py, cost rows)
    Mutant("blind4-hsdp-gather-sum-across-slices", "blind4", SRC_MANUAL_COLLECTIVES,
           "    return (lax.pmean(shard, across),)  # across slices",
           "    return (lax.psum(shard, across),)  # across slices",
           HSDP_TESTS,
           "hsdp_gather's backward sums each matrix's gradient shard over the slices instead of averaging it"),
    Mutant("blind4-hsdp-matrix-keeps-data-drops-fsdp", "blind4", SRC_MANUAL_HSDP,
           "lambda s, axes: tuple(a for a in axes if a != DCN_AXIS) if SLICE_AXIS in sharded_axes(s) else axes,",
           "lambda s, axes: tuple(a for a in axes if a != SLICE_AXIS) if SLICE_AXIS in sharded_axes(s) else axes,",
           HSDP_TESTS,
           "a matrix's token axes drop fsdp, not data: its gradient, already averaged across slices, is pmeaned "
           "over data again after the backward (a second DCN all-reduce)"),
    Mutant("blind4-fsdp-weight-bypasses-the-hook", "blind4", SRC_FSDP,
           "                full = self.gather_weight(w, dim)\n",
           "                full = fsdp_gather(w, self.AXIS, dim)\n",
           HSDP_TESTS,
           "FSDP's weight() gathers with fsdp_gather, not the gather_weight hook: hsdp's matrices are never "
           "averaged across slices"),
    Mutant("blind4-cost-hsdp-across-per-leaf", "blind4", SRC_COST_ROWS,
           'across = [row(ctx, "backward", "all-reduce", ("data",), r.count, r.bytes // r.count, f"hsdp_gather backward',
           'across = [row(ctx, "backward", "all-reduce", ("data",), w.leaves, r.bytes // r.count, f"hsdp_gather backward',
           (HSDP, MEGASCALE, HLO),
           "the cost model's DCN all-reduces of a stacked matrix counted once per leaf, not once per layer "
           "(its reduce-scatters' count)"),
    Mutant("blind4-cost-hsdp-gains-float32", "blind4", SRC_COST_ROWS,
           'across += [row(ctx, "backward", "all-reduce", ("data",), w.leaves, w.layers * w.size * ctx.w,',
           'across += [row(ctx, "backward", "all-reduce", ("data",), w.leaves, w.layers * w.size * F32,',
           (HSDP, MEGASCALE, HLO),
           "the cost model's DCN mean of the norm gains priced in float32 whatever --weight_dtype"),
    # ------------------------------------------------------------------ the circular schedule's table (parallel/pipeline.py)
    Mutant("blind4-circular-chunks-stage-major", "blind4", SRC_PIPELINE,
           "forwards = [Action(FORWARD, k % microbatches, k // microbatches * stages + s)",
           "forwards = [Action(FORWARD, k % microbatches, s * virtual + k // microbatches)",
           CIRCULAR_TESTS,
           "pipeline.circular's virtual stages placed in blocks (device s runs s V ... s V + V - 1), not round-robin"),
    Mutant("blind4-circular-backward-not-reversed", "blind4", SRC_PIPELINE,
           "return forwards + [Action(BACKWARD, a.microbatch, a.stage) for a in reversed(forwards)]",
           "return forwards + [Action(BACKWARD, a.microbatch, a.stage) for a in forwards]",
           CIRCULAR_TESTS,
           "pipeline.circular's backward runs the forwards' order, not the transposed loop's (last first)"),
    # ------------------------------------------------------------------ the flag from the launchers, the resume's model check
    Mutant("blind4-common-accum-dtype-not-applied", "blind4", SRC_COMMON,
           '"grad_accum_dtype", "microbatches", "schedule", "virtual_stages", "cp_layout")',
           '"microbatches", "schedule", "virtual_stages", "cp_layout")',
           (FLAG_PRECEDENCE, FAST_PATH, BENCH),
           "launch.train's --grad_accum_dtype is defined but never set on the TrainConfig"),
    Mutant("blind4-bench-command-without-accum-dtype", "blind4", SRC_BENCH,
           '"seed", "grad_accum", "grad_accum_dtype", *common.MODEL_FLAGS, "matmul_size"',
           '"seed", "grad_accum", *common.MODEL_FLAGS, "matmul_size"',
           (BENCH, FLAG_PRECEDENCE),
           "the benchmark's recorded command drops --grad_accum_dtype: the record does not rerun as it ran"),
    Mutant("blind4-resume-fix-names-this-runs-value", "blind4", SRC_LAUNCH_TRAIN,
           'fix = " ".join(f"--{k}={was}" for k, (was, _) in diff.items()',
           'fix = " ".join(f"--{k}={was}" for k, (_, was) in diff.items()',
           (TRAIN,),
           "a resume into another model suggests this run's values as the fix, not the checkpoint's"),
]
