"""Bugs written blind, a sixth round: realistic bugs in the code that trains across TPU slices and a few
newer modules that the earlier rounds barely touched: the AOT topology helpers (hardware/topology.py), the
multi-process join (launch/distributed.py), the multi-slice compile (launch/slices.py), the chips' DCN rates
(hardware/chips.py), the DCN mesh, hybrid mesh and slice granules (parallel/mesh.py), the run's resolution
across slices (parallel/resolve.py), the megascale transfers' reader (hlo/megascale.py), the trace-event writer
(hlo/trace.py), the model's base hooks (model/hooks.py), the cost model's entry points (cost/__init__.py) and
its hsdp and DCN rows (cost/communication.py), the planner's --slices ranking (hardware/plan.py, launch/plan.py),
the two hsdp twins (manual_parallel/hsdp.py with collectives.hsdp_gather, auto_parallel/hsdp.py),
launch.compare and hardware/measure.py. Written at commit 0820709 by someone who read the mutated modules'
source but not one test. Each mutant's `tests` were chosen mechanically (`grep -l` of the module's import path
or a function's name in tests/test_*.py, at most 3 files), not by reading the tests, so a `missed` one is a
gap the tests were not written around. docs/mutation-testing.md, "Bugs written blind", records how many were
caught."""

from .base import ACCUM, COST, EXPLICIT, MEMORY, Mutant, PLAN, SRC_PLAN, SRC_RESOLVE, SRC_COST_ROWS, TPU

SRC_TOPOLOGY = "twinshard/hardware/topology.py"
SRC_DISTRIBUTED = "launch/distributed.py"
SRC_SLICES = "launch/slices.py"
SRC_CHIPS = "twinshard/hardware/chips.py"
SRC_MESH = "twinshard/parallel/mesh.py"
SRC_MEGASCALE = "twinshard/hlo/megascale.py"
SRC_TRACE = "twinshard/hlo/trace.py"
SRC_HOOKS = "twinshard/model/hooks.py"
SRC_COST = "twinshard/cost/__init__.py"
SRC_LAUNCH_PLAN = "launch/plan.py"
SRC_MANUAL_HSDP = "manual_parallel/hsdp.py"
SRC_AUTO_HSDP = "auto_parallel/hsdp.py"
SRC_COLLECTIVES = "manual_parallel/collectives.py"
SRC_COMPARE = "launch/compare.py"
SRC_MEASURE = "twinshard/hardware/measure.py"

MULTIPROCESS = "tests/test_multiprocess.py"
PLAN_SLICES = "tests/test_plan_slices.py"
MAXTEXT_SLICES = "tests/test_maxtext_slices.py"
MEGASCALE = "tests/test_megascale.py"
PLAN_RANKING = "tests/test_plan_ranking.py"
HSDP = "tests/test_hsdp.py"
MESH = "tests/test_mesh.py"
TIMELINE_CLI = "tests/test_timeline_cli.py"
XLA_OPTIONS = "tests/test_xla_options.py"
LOSS_CHUNKS = "tests/test_loss_chunks.py"
COLLECTIVES_CLI = "tests/test_collectives_cli.py"
WEIGHT_DTYPE = "tests/test_weight_dtype.py"
SEQUENCE = "tests/test_sequence.py"
CONTEXT = "tests/test_context.py"
STRATEGIES = "tests/test_strategies.py"
MEMORY_FIT = "tests/test_memory_fit.py"
README = "tests/test_readme.py"
CLI_ERRORS = "tests/test_cli_errors.py"
BENCH = "tests/test_bench.py"
TRAIN = "tests/test_train.py"

TOPOLOGY_TESTS = (TPU, MEMORY)  # `chips_per_host`, `argument_bytes`, `tpu_expected`
SLICES_TESTS = (PLAN_SLICES, MAXTEXT_SLICES)  # `launch.slices`, `compile_step`, `compiled_report`
DCN_RATE_TESTS = (MAXTEXT_SLICES, MEGASCALE)  # `V5E_DCN`, `dcn_bytes_per_s`
HYBRID_TESTS = (HSDP, MESH)  # `hybrid_mesh`, `parallel.mesh`
GRANULE_TESTS = (MULTIPROCESS, HSDP)  # `granules`, `hybrid_mesh`
MEGASCALE_TESTS = (MEGASCALE, MAXTEXT_SLICES)  # `hlo.megascale`, `megascale`
TRACE_TESTS = (TIMELINE_CLI, XLA_OPTIONS)  # `--trace`, `beside(`
HOOKS_TESTS = (EXPLICIT, LOSS_CHUNKS)  # `row_parallel`, `column_parallel`, `token_loss`
HSDP_COST_TESTS = (HSDP, MEGASCALE, ACCUM)  # `hsdp` with `twinshard.cost`
PLANNER_TESTS = (PLAN_SLICES, PLAN, PLAN_RANKING)  # `hardware.plan`, `launch.plan`
COMPARE_TESTS = (MEMORY_FIT, README, CLI_ERRORS)  # `launch.compare`
MEASURE_TESTS = (BENCH, TRAIN, PLAN)  # `hardware.measure`, `p25`, `matmul_peak`

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ AOT topology helpers (hardware/topology.py)
    Mutant("blind6-topology-chips-per-host-divides-inverted", "blind6", SRC_TOPOLOGY,
           "x, y, z = (b if g % b == 0 else 1 for b, g in zip(DEFAULT_CHIPS_PER_HOST, grid))",
           "x, y, z = (b if b % g == 0 else 1 for b, g in zip(DEFAULT_CHIPS_PER_HOST, grid))",
           TOPOLOGY_TESTS,
           "chips per host kept where the grid divides the bound, not the bound the grid: v5e:4x4 gets 1x1x1 hosts"),
    Mutant("blind6-topology-padded-bytes-round-down", "blind6", SRC_TOPOLOGY,
           "[-(-a // b) * b for a, b in zip(phys[len(phys) - k:], tile)]",
           "[a // b * b for a, b in zip(phys[len(phys) - k:], tile)]",
           TOPOLOGY_TESTS,
           "padded_bytes rounds the minor dims down to the tile, not up: a small shard pads to nothing"),
    Mutant("blind6-topology-first-batch-arg-is-a-counter", "blind6", SRC_TOPOLOGY,
           'part = ("batch" if i >= n_state',
           'part = ("batch" if i > n_state',
           TOPOLOGY_TESTS,
           "argument_bytes counts the first batch array (x) as a state counter: off by one at the state's end"),
    Mutant("blind6-topology-tpu-expected-rs-bytes-not-scaled", "blind6", SRC_TOPOLOGY,
           'rs["bytes"] -= b // d',
           'rs["bytes"] -= b',
           (TPU,),
           "tpu_expected takes the all-reduce's full bytes off the reduce-scatter row, not 1/|data| of them"),
    # ------------------------------------------------------------------ the multi-process join (launch/distributed.py)
    Mutant("blind6-distributed-coordinator-alone-does-not-join", "blind6", SRC_DISTRIBUTED,
           "if not (FLAGS.distributed or FLAGS.coordinator_address):",
           "if not FLAGS.distributed:",
           (MULTIPROCESS,),
           "--coordinator_address without --distributed no longer joins: each process trains alone"),
    Mutant("blind6-distributed-lost-task-regex-misspelt", "blind6", SRC_DISTRIBUTED,
           'ids = re.findall(r"task:(\\d+)", unhealthy.group(1))',
           'ids = re.findall(r"task_(\\d+)", unhealthy.group(1))',
           (MULTIPROCESS,),
           "the lost peer's task id selector matches nothing: the line names every number of the status instead"),
    # ------------------------------------------------------------------ the multi-slice compile (launch/slices.py)
    Mutant("blind6-slices-hybrid-devices-dcn-inner", "blind6", SRC_SLICES,
           "grid = mesh_utils.create_hybrid_device_mesh((1, per_slice), (slices, 1), devices)",
           "grid = mesh_utils.create_hybrid_device_mesh((per_slice, 1), (1, slices), devices)",
           SLICES_TESTS,
           "the [slices, chips] grid built with the DCN axis innermost: each row mixes chips of every slice"),
    Mutant("blind6-slices-across-weights-dcn-inner", "blind6", SRC_SLICES,
           'params = {k: (DCN_AXIS, a) if across and a == "data" else a',
           'params = {k: (a, DCN_AXIS) if across and a == "data" else a',
           SLICES_TESTS,
           "across=True splits the weights over (data, dcn), DCN inner, not (dcn, data)"),
    Mutant("blind6-slices-global-batch-per-slice", "blind6", SRC_SLICES,
           "batch_size=cfg.train.batch_size // topo.slices))",
           "batch_size=cfg.train.batch_size))",
           SLICES_TESTS,
           "compile_step gives every slice the global batch, not batch / slices"),
    Mutant("blind6-slices-dcn-bytes-without-multiplicity", "blind6", SRC_SLICES,
           '"dcn_bytes": sum(r.bytes * r.multiplicity for r in led.filter(axes=DCN_AXIS))',
           '"dcn_bytes": sum(r.bytes for r in led.filter(axes=DCN_AXIS))',
           SLICES_TESTS,
           "the compiled report's DCN bytes count each transfer once, not once per loop trip"),
    # ------------------------------------------------------------------ the chips' DCN rates (hardware/chips.py)
    Mutant("blind6-chips-v5e-dcn-gbit-read-as-gbyte", "blind6", SRC_CHIPS,
           "V5E_DCN_BYTES_PER_S = 2 * 100 * _GBIT / 8",
           "V5E_DCN_BYTES_PER_S = 2 * 100 * 1e9 / 8",
           DCN_RATE_TESTS,
           "v5e's per-host NICs read as 100 GB/s, not 100 Gb/s: DCN 8x too fast per chip"),
    Mutant("blind6-chips-v5p-dcn-per-host", "blind6", SRC_CHIPS,
           "_V5P_DCN = 50 * _GBIT  # per chip",
           "_V5P_DCN = 50 * _GBIT / 4  # per chip",
           (*DCN_RATE_TESTS, PLAN),
           "v5p's 50 Gb/s per chip divided again by the 4 chips of a host (per host read as per chip twice)"),
    # ------------------------------------------------------------------ the DCN mesh (parallel/mesh.py)
    Mutant("blind6-mesh-hybrid-spec-every-device-per-slice", "blind6", SRC_MESH,
           "max(n_devices // slices, 1) if a == inner[0]",
           "max(n_devices, 1) if a == inner[0]",
           HYBRID_TESTS,
           "--dcn_mesh without --mesh: the default inner axis gets every device, not a slice's"),
    Mutant("blind6-mesh-hybrid-mesh-shapes-swapped", "blind6", SRC_MESH,
           "return mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=",
           "return mesh_utils.create_hybrid_device_mesh(outer, inner, devices, process_is_granule=",
           GRANULE_TESTS,
           "hybrid_mesh passes the DCN shape as the ICI one and back (slice_index and process granules)"),
    Mutant("blind6-mesh-granules-slice-index-from-process", "blind6", SRC_MESH,
           'indices = sorted({getattr(d, "slice_index", 0) for d in devices})',
           'indices = sorted({getattr(d, "process_index", 0) for d in devices})',
           GRANULE_TESTS,
           "granules reads each device's slice from process_index: processes taken for TPU slices"),
    Mutant("blind6-mesh-simulated-slices-round-robin", "blind6", SRC_MESH,
           "wrapped = [_SimulatedSlice(d, i // per_slice) for i, d in enumerate(devices)]",
           "wrapped = [_SimulatedSlice(d, i % math.prod(outer)) for i, d in enumerate(devices)]",
           (HSDP,),
           "simulated slices dealt round-robin (device i to slice i mod N), not in order"),
    Mutant("blind6-mesh-hybrid-inner-not-divided", "blind6", SRC_MESH,
           "inner = [shape[a] // dcn.get(a, 1) for a in names]",
           "inner = [shape[a] for a in names]",
           (HSDP,),
           "hybrid_mesh's per-slice shape keeps the DCN axes' whole sizes"),
    # ------------------------------------------------------------------ the run across slices (parallel/resolve.py)
    Mutant("blind6-resolve-run-forgets-dcn", "blind6", SRC_RESOLVE,
           "None if devices is None else tuple(devices), MappingProxyType(dcn))",
           "None if devices is None else tuple(devices), MappingProxyType({}))",
           (MEGASCALE, HSDP),
           "the resolved Run drops its DCN axes: launchers then treat a multi-slice run as one slice"),
    Mutant("blind6-resolve-hybrid-spec-slices-twice", "blind6", SRC_RESOLVE,
           "mesh_spec = mesh_lib.hybrid_spec(strategy, dcn, mesh_spec, len(found))",
           "mesh_spec = mesh_lib.hybrid_spec(strategy, dcn, mesh_spec, len(found) // math.prod(dcn.values()))",
           (HSDP, MEGASCALE),
           "hybrid_spec handed the devices of one slice, which it divides by the slices again"),
    Mutant("blind6-resolve-mesh-flat-skips-mlp", "blind6", SRC_RESOLVE,
           'if not (flat_weights and k == "embed")',
           'if not (flat_weights and k == "mlp")',
           (PLAN, MESH),
           "resolve_mesh's flat weights lift the d_ff check, not d_model's: flat plans refused"),
    # ------------------------------------------------------------------ megascale transfers (hlo/megascale.py)
    Mutant("blind6-megascale-payload-largest", "blind6", SRC_MEGASCALE,
           "return min(reversed(seen), key=lambda s: s.bytes)",
           "return max(reversed(seen), key=lambda s: s.bytes)",
           MEGASCALE_TESTS,
           "a transfer's payload taken as the largest array along the views: the padded buffer"),
    Mutant("blind6-megascale-dcn-axes-one-too-many", "blind6", SRC_MEGASCALE,
           "            return spec.names[:k]\n",
           "            return spec.names[:k + 1]\n",
           MEGASCALE_TESTS,
           "dcn_axes returns the leading axes plus the first axis inside the slice"),
    Mutant("blind6-megascale-ops-gather-scatter-swapped", "blind6", SRC_MEGASCALE,
           '"ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter"',
           '"ALL_GATHER": "reduce-scatter", "REDUCE_SCATTER": "all-gather"',
           MEGASCALE_TESTS,
           "megascale ALL_GATHER and REDUCE_SCATTER transfers named each other's op"),
    # ------------------------------------------------------------------ the trace-event writer (hlo/trace.py)
    Mutant("blind6-trace-ts-in-milliseconds", "blind6", SRC_TRACE,
           '"ts": start / 1e3,',
           '"ts": start / 1e6,',
           TRACE_TESTS,
           "an event's start written in ms (ns / 1e6), its duration in µs"),
    Mutant("blind6-trace-last-iteration-dropped", "blind6", SRC_TRACE,
           "for k in range(trips):",
           "for k in range(trips - 1):",
           TRACE_TESTS,
           "a loop's unrolled events stop one iteration short"),
    Mutant("blind6-trace-beside-pid-collides", "blind6", SRC_TRACE,
           "after = 1 + max((int(e[\"pid\"])",
           "after = max((int(e[\"pid\"])",
           TRACE_TESTS,
           "beside() numbers the prediction's processes from the last measured pid, not after it: pids collide"),
    # ------------------------------------------------------------------ the base hooks (model/hooks.py)
    Mutant("blind6-hooks-row-parallel-without-g", "blind6", SRC_HOOKS,
           "return self.exit_tensor_parallel(layers.linear(x, w, self.flat_rows))",
           "return layers.linear(x, w, self.flat_rows)",
           HOOKS_TESTS,
           "row_parallel skips Megatron's g: the row-parallel partial sums are never reduced"),
    Mutant("blind6-hooks-column-parallel-without-f", "blind6", SRC_HOOKS,
           "        x = self.enter_tensor_parallel(x)\n",
           "",
           HOOKS_TESTS,
           "column_parallel skips Megatron's f: the input's gradient is not summed over tensor"),
    # ------------------------------------------------------------------ the cost model's entry points (cost/__init__.py)
    Mutant("blind6-cost-of-run-accum-bytes-swapped", "blind6", SRC_COST,
           'accum_bytes=w if t.grad_accum_dtype == "weight" else 4',
           'accum_bytes=4 if t.grad_accum_dtype == "weight" else w',
           (ACCUM,),
           "of_run prices the gradient accumulator in float32 under --grad_accum_dtype=weight and back"),
    Mutant("blind6-cost-compare-counts-only", "blind6", SRC_COST,
           '"match": got["count"] == want["count"] and got["bytes"] == want["bytes"]',
           '"match": got["count"] == want["count"]',
           (COST, COLLECTIVES_CLI, ACCUM),
           "compare calls a row a match on its count alone: bytes that differ pass"),
    Mutant("blind6-cost-param-bytes-compute-dtype", "blind6", SRC_COST,
           "param_bytes = DTYPE_BYTES[cfg.weight_dtype] if param_bytes is None else param_bytes",
           "param_bytes = DTYPE_BYTES[cfg.dtype] if param_bytes is None else param_bytes",
           (COST, WEIGHT_DTYPE, PLAN),
           "cost's default param bytes from the compute dtype, not the weight dtype"),
    # ------------------------------------------------------------------ hsdp and DCN rows (cost/communication.py)
    Mutant("blind6-comm-hsdp-dcn-each-is-total", "blind6", SRC_COST_ROWS,
           'row(ctx, "backward", "all-reduce", ("data",), r.count, r.bytes // r.count,',
           'row(ctx, "backward", "all-reduce", ("data",), r.count, r.bytes,',
           HSDP_COST_TESTS,
           "hsdp's DCN all-reduce rows take the scatter row's total bytes as each collective's"),
    Mutant("blind6-comm-hsdp-norm-gains-over-both", "blind6", SRC_COST_ROWS,
           'across += [row(ctx, "backward", "all-reduce", ("data",), w.leaves,',
           'across += [row(ctx, "backward", "all-reduce", ("data", "fsdp"), w.leaves,',
           HSDP_COST_TESTS,
           "hsdp's norm gains modelled as one all-reduce over data,fsdp, not a mean across slices after the slice's"),
    Mutant("blind6-comm-hsdp-grad-norm-across-slices", "blind6", SRC_COST_ROWS,
           'return fsdp + across + [norm_row(ctx, ("fsdp",)),',
           'return fsdp + across + [norm_row(ctx, ("data", "fsdp")),',
           HSDP_COST_TESTS,
           "hsdp's global gradient norm modelled as a psum over data,fsdp (across DCN), not inside the slice"),
    Mutant("blind6-comm-hsdp-fsdp-rows-over-data", "blind6", SRC_COST_ROWS,
           'fsdp = fsdp_rows(ctx, tensor_shards=1, axis="fsdp")',
           "fsdp = fsdp_rows(ctx, tensor_shards=1)",
           HSDP_COST_TESTS,
           "hsdp's gathers and scatters modelled over data (DCN), fsdp_rows' default axis, not over fsdp"),
    Mutant("blind6-comm-ring-shifts-per-layer-c", "blind6", SRC_COST_ROWS,
           "n = 2 * (c - 1) * ctx.L",
           "n = 2 * c * ctx.L",
           (COST, CONTEXT, SEQUENCE),  # grep's hits for the ring's rows (first selection: SEQUENCE, STRATEGIES)
           "ring attention modelled with C K/V shifts each per layer, not C - 1"),
    # ------------------------------------------------------------------ the --slices ranking (hardware/plan.py)
    Mutant("blind6-plan-dcn-all-reduce-once", "blind6", SRC_PLAN,
           "sent = 2 * share * grads",
           "sent = share * grads",
           PLANNER_TESTS,
           "the DCN all-reduce priced as (N-1)/N x the gradient bytes, not 2 (N-1)/N (reduce-scatter + all-gather)"),
    Mutant("blind6-plan-dcn-grads-in-param-dtype", "blind6", SRC_PLAN,
           "grads = inside.memory.grads * F32 // DTYPE_BYTES[precision.params]",
           "grads = inside.memory.grads",
           PLANNER_TESTS,
           "DCN's gradient bytes in --param_dtype (bf16: half), not the float32 the twins all-reduce"),
    Mutant("blind6-plan-dcn-gather-whole-shard", "blind6", SRC_PLAN,
           'sent += sum(share * s["bytes"] / chips for',
           'sent += sum(share * s["bytes"] for',
           PLANNER_TESTS,
           "across: each weight gather's DCN bytes the whole gathered bytes, not the M-chip shard's"),
    Mutant("blind6-plan-dcn-across-not-passed", "blind6", SRC_PLAN,
           'comm["dcn"] = dcn_seconds(c, topo.slices, links["dcn"], precision, across)',
           'comm["dcn"] = dcn_seconds(c, topo.slices, links["dcn"], precision, False)',
           PLANNER_TESTS,
           "evaluate does not pass `across` to dcn_seconds: fsdp over every chip pays no weight gathers on DCN"),
    Mutant("blind6-plan-layout-hsdp-when-across", "blind6", SRC_PLAN,
           'return "hsdp" if self.slices > 1 and self.strategy == "fsdp" and not self.across else self.strategy',
           'return "hsdp" if self.slices > 1 and self.strategy == "fsdp" else self.strategy',
           PLANNER_TESTS,
           "fsdp over every slice's chips is labelled hsdp too"),
    # ------------------------------------------------------------------ the planner's report (launch/plan.py)
    Mutant("blind6-launch-plan-dcn-column-from-three", "blind6", SRC_LAUNCH_PLAN,
           '["dcn"] * (topo.slices > 1)',
           '["dcn"] * (topo.slices > 2)',
           PLANNER_TESTS,
           "the plan table's DCN column shown from 3 slices on: --slices=2 hides it"),
    Mutant("blind6-launch-plan-compiled-misfits-first", "blind6", SRC_LAUNCH_PLAN,
           'compiled.sort(key=lambda c: (not c[2]["fits"], c[2]["predicted"]["step_s"]))',
           'compiled.sort(key=lambda c: (c[2]["fits"], c[2]["predicted"]["step_s"]))',
           PLANNER_TESTS,
           "--compile's re-ranking puts the plans that do not fit first"),
    Mutant("blind6-launch-plan-dcn-link-size-one", "blind6", SRC_LAUNCH_PLAN,
           "{axis}={best.mesh.get(axis, best.slices)}",
           "{axis}={best.mesh.get(axis, 1)}",
           PLANNER_TESTS,
           "the best plan's links name the DCN axis as dcn=1, not the slice count"),
    Mutant("blind6-launch-plan-refined-no-dcn-column", "blind6", SRC_LAUNCH_PLAN,
           'for a in (*mesh_lib.ORDER, "dcn")',
           "for a in mesh_lib.ORDER",
           PLANNER_TESTS,
           "--compile's re-ranked table drops the exposed DCN column"),
    # ------------------------------------------------------------------ the hsdp twins
    Mutant("blind6-hsdp-manual-gather-axes-swapped", "blind6", SRC_MANUAL_HSDP,
           "return hsdp_gather(w, SLICE_AXIS, dim, DCN_AXIS)",
           "return hsdp_gather(w, DCN_AXIS, dim, SLICE_AXIS)",
           (HSDP,),
           "manual hsdp gathers each weight over data (DCN) and averages over fsdp: the axes' pairing swapped"),
    Mutant("blind6-hsdp-manual-tokens-not-over-data", "blind6", SRC_MANUAL_HSDP,
           "TOKEN_AXES = (DCN_AXIS, SLICE_AXIS)",
           "TOKEN_AXES = (SLICE_AXIS,)",
           (HSDP,),
           "manual hsdp's token axes omit data: norm gains and the loss are not averaged across slices"),
    Mutant("blind6-hsdp-gather-sums-across-slices", "blind6", SRC_COLLECTIVES,
           "return (lax.pmean(shard, across),)",
           "return (lax.psum(shard, across),)",
           (HSDP, MEGASCALE),
           "hsdp_gather's backward sums the shard across slices instead of averaging it"),
    Mutant("blind6-hsdp-auto-slice-batch-over-data", "blind6", SRC_AUTO_HSDP,
           'hooks.rules = {**self.rules, "batch": SLICE_AXIS}',
           'hooks.rules = {**self.rules, "batch": DCN_AXIS}',
           (HSDP,),
           "auto hsdp's per-slice hooks pin the slice's batch over data (the vmapped axis), not fsdp"),
    Mutant("blind6-hsdp-auto-sums-slices", "blind6", SRC_AUTO_HSDP,
           "jax.lax.with_sharding_constraint(jnp.mean(g, axis=0), s)",
           "jax.lax.with_sharding_constraint(jnp.sum(g, axis=0), s)",
           (HSDP,),
           "auto hsdp sums the slices' gradients instead of averaging them"),
    Mutant("blind6-hsdp-auto-accum-dtype-not-passed", "blind6", SRC_AUTO_HSDP,
           "xs, ys, k,\n                                                    sum_dtype=self.cfg.train.grad_accum_dtype)",
           "xs, ys, k)",
           (ACCUM, HSDP),
           "auto hsdp does not pass --grad_accum_dtype to the accumulation: always the default"),
    # ------------------------------------------------------------------ launch.compare
    Mutant("blind6-compare-dcn-mesh-not-passed", "blind6", SRC_COMPARE,
           "common.resolve_run(strategy, impl, mesh_spec, cfg, devices, dcn_spec=dcn_spec)",
           "common.resolve_run(strategy, impl, mesh_spec, cfg, devices)",
           COMPARE_TESTS,
           "launch.compare drops --dcn_mesh: the twins run one slice's mesh"),
    Mutant("blind6-compare-max-diff-is-min", "blind6", SRC_COMPARE,
           "return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))",
           "return min(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))",
           COMPARE_TESTS,
           "the largest difference reported is the smallest leaf's largest"),
    # ------------------------------------------------------------------ hardware/measure.py
    Mutant("blind6-measure-p25-exclusive", "blind6", SRC_MEASURE,
           'statistics.quantiles(times, n=4, method="inclusive")[0]',
           "statistics.quantiles(times, n=4)[0]",
           MEASURE_TESTS,
           "p25 reverts to the exclusive quantile, which extrapolates below the fastest sample"),
    Mutant("blind6-measure-matmul-flops-halved", "blind6", SRC_MEASURE,
           '"flops_per_s": 2 * n ** 3 / fast,',
           '"flops_per_s": n ** 3 / fast,',
           MEASURE_TESTS,
           "the matmul peak counts n^3 FLOPs, not 2 n^3 (a multiply-add taken as one)"),
]
