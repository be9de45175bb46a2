"""Bugs written blind, a fifth round: realistic bugs in the code that changed after the fourth round
(commit 8035c8b): the scheduled pipeline's in-place gradient sums (manual_parallel/pp.py: the chunk's rows,
the head's backward under its lax.cond, the embedding's gradient on virtual stage 0), zb_h1's split backward
reduced to the blocks (manual_parallel/pp_split.py: add_rows, W's layer rows), RoPE on (evens, odds) halves
(layers.apply_rope_halves, attention.project_heads, config.rope_on_halves, the fast path's line), the
layer-by-layer micro-batch gradient sum (trainer.sum_by_layer, unrolled_stacks), the memory model's table
schedules (the loss's float32 logits, the blocks-only stash), the HLO evaluator's async copies, the planner's
schedule section and the bench's recorded flags. Written at commit 2a8a43a by someone who read the mutated
modules' source but not one test. Each mutant's `tests` were chosen mechanically (`grep -l` of the module's
import path or a function's name in tests/test_*.py, at most 3 files), not by reading the tests, so a
`missed` one is a gap the tests were not written around. docs/mutation-testing.md, "Bugs written blind",
records how many were caught."""

from .base import ACCUM, EXPLICIT, GRADIENT_BYTES, LAYERS, MEMORY, Mutant, PLAN, SRC_ATTENTION, SRC_CONFIG, \
    SRC_COST_MEMORY, SRC_LAYERS, SRC_TRAINER

SRC_MANUAL_PP = "manual_parallel/pp.py"
SRC_PP_SPLIT = "manual_parallel/pp_split.py"
SRC_FAST_PATH = "twinshard/hardware/fast_path.py"
SRC_EVALUATE = "twinshard/hlo/evaluate.py"
SRC_LAUNCH_PLAN = "launch/plan.py"
SRC_BENCH = "launch/bench.py"

PIPELINE = "tests/test_pipeline.py"
BF16_PARALLEL = "tests/test_bf16_parallel.py"
SPEED_OPTIONS = "tests/test_speed_options.py"
FAST_PATH = "tests/test_fast_path.py"
BENCH = "tests/test_bench.py"
TICK_PRICES = "tests/test_tick_prices.py"
SCHEDULE_READER = "tests/test_schedule_reader.py"
PLAN_RANKING = "tests/test_plan_ranking.py"

PP_TESTS = (PIPELINE, BF16_PARALLEL, MEMORY)  # `manual_parallel.pp`, `pp_split`
ROPE_TESTS = (LAYERS, SPEED_OPTIONS)  # `apply_rope_halves`, `evens_then_odds`, `rope_on_halves`
HEADS_TESTS = (SPEED_OPTIONS, LAYERS)  # `project_heads`, `rope_on_halves`
SUM_BY_LAYER_TESTS = (ACCUM,)  # `sum_by_layer`, `unrolled_stacks`
ACCUM_SUM_TESTS = (ACCUM, EXPLICIT, GRADIENT_BYTES)  # `accumulated_value_and_grad`
STASH_TESTS = (MEMORY, PIPELINE, PLAN_RANKING)  # `stash`
EVALUATE_TESTS = (TICK_PRICES, SCHEDULE_READER, PIPELINE)  # `copy-start`, `hlo.evaluate`
PLANNER_TESTS = (PLAN_RANKING, PLAN)  # `schedule_section`, `pipeline_schedules`, `launch.plan`

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ the scheduled pipeline's sums (manual_parallel/pp.py)
    Mutant("blind5-pp-chunk-slice-not-scaled", "blind5", SRC_MANUAL_PP,
           "return jax.tree.map(lambda w: lax.dynamic_slice_in_dim(w, chunk * k, k, 0), layers)",
           "return jax.tree.map(lambda w: lax.dynamic_slice_in_dim(w, chunk, k, 0), layers)",
           PP_TESTS,
           "an interleaved chunk's layers sliced from row `chunk`, not chunk * L/(S V): chunks overlap"),
    Mutant("blind5-pp-chunk-add-not-scaled", "blind5", SRC_MANUAL_PP,
           "return pipeline_split.add_rows(sums, d_chunk, chunk * (jax.tree.leaves(sums)[0].shape[0] // v))",
           "return pipeline_split.add_rows(sums, d_chunk, chunk)",
           PP_TESTS,
           "an interleaved chunk's layer gradient added from row `chunk`, not chunk * L/(S V)"),
    Mutant("blind5-pp-chunk-add-v1-overwrites", "blind5", SRC_MANUAL_PP,
           "return jax.tree.map(lambda s, d: s + d.astype(s.dtype), sums, d_chunk)",
           "return jax.tree.map(lambda s, d: d.astype(s.dtype), sums, d_chunk)",
           PP_TESTS,
           "1F1B (V = 1) writes each backward's layer gradient over the sum: the last micro-batch's alone"),
    Mutant("blind5-pp-inputs-embed-every-chunk", "blind5", SRC_MANUAL_PP,
           "first = (lax.axis_index(STAGE) == 0) & (chunk == 0)\n        return lax.cond(first,",
           "first = lax.axis_index(STAGE) == 0\n        return lax.cond(first,",
           PP_TESTS,
           "device 0 embeds the tokens for every chunk (interleaved: its later chunks ignore what arrived)"),
    Mutant("blind5-pp-embedding-grad-every-chunk", "blind5", SRC_MANUAL_PP,
           "first = (lax.axis_index(STAGE) == 0) & (chunk == 0)\n        lookup =",
           "first = lax.axis_index(STAGE) == 0\n        lookup =",
           PP_TESTS,
           "the embedding's gradient added on device 0's every chunk, not virtual stage 0's alone (interleaved)"),
    Mutant("blind5-pp-head-grad-of-unswapped-params", "blind5", SRC_MANUAL_PP,
           "loss = lambda h, o: nnx.merge(graphdef(cfg), {**params, **h}).head_loss(o, targets, par)",
           "loss = lambda h, o: nnx.merge(graphdef(cfg), params).head_loss(o, targets, par)",
           PP_TESTS,
           "the head's backward differentiates a model without the head's params swapped in: ln_final and "
           "lm_head get a zero gradient"),
    Mutant("blind5-pp-head-grad-overwrites-the-sum", "blind5", SRC_MANUAL_PP,
           "return d_out, jax.tree.map(lambda s, d: s + d.astype(s.dtype), head, d_head)",
           "return d_out, jax.tree.map(lambda s, d: d.astype(s.dtype), head, d_head)",
           PP_TESTS,
           "the head's weight gradient written over its sum: ln_final and lm_head keep the last micro-batch's"),
    Mutant("blind5-pp-1f1b-head-sums-dropped", "blind5", SRC_MANUAL_PP,
           'sums = {**sums, **head, "layers": self._add_to_chunk(sums["layers"], d_chunk, chunk)}',
           'sums = {**sums, "layers": self._add_to_chunk(sums["layers"], d_chunk, chunk)}',
           PP_TESTS,
           "1F1B's backward drops the head's updated sums: ln_final and lm_head keep a zero gradient"),
    Mutant("blind5-pp-zb-head-sums-dropped", "blind5", SRC_MANUAL_PP,
           "sums = self._add_embedding_grad(params, c, xs[i], d_inputs, {**sums, **head}, par)",
           "sums = self._add_embedding_grad(params, c, xs[i], d_inputs, sums, par)",
           PP_TESTS,
           "zb_h1's B drops the head's updated sums: ln_final and lm_head keep a zero gradient"),
    Mutant("blind5-pp-backward-reads-the-receiving-slot", "blind5", SRC_MANUAL_PP,
           "ys[i], grads_in[grad[t, stage]],\n                                            seed, sums, par)",
           "ys[i], grads_in[recv_grad[t, stage]],\n                                            seed, sums, par)",
           PP_TESTS,
           "1F1B's backward reads its output's gradient from the slot this tick's arrival goes to, not its own"),
    Mutant("blind5-pp-embedding-grad-from-output-grad", "blind5", SRC_MANUAL_PP,
           "return d_inputs, self._add_embedding_grad(params, chunk, tokens, d_inputs, sums, par)",
           "return d_inputs, self._add_embedding_grad(params, chunk, tokens, d_out, sums, par)",
           PP_TESTS,
           "1F1B's embedding gradient from the chunk's OUTPUT gradient, not its input's"),
    Mutant("blind5-pp-zb-input-not-embedded", "blind5", SRC_MANUAL_PP,
           "inputs = self._inputs(nnx.merge(graphdef(self.cfg.model), params), c, xs[i], acts[act[t, stage]], par)",
           "inputs = acts[act[t, stage]]",
           PP_TESTS,
           "zb_h1's B runs virtual stage 0's blocks on the (empty) arrived slot, not the embedded tokens"),
    # ------------------------------------------------------------------ zb_h1's split backward (manual_parallel/pp_split.py)
    Mutant("blind5-split-add-rows-reads-row-zero", "blind5", SRC_PP_SPLIT,
           "lax.dynamic_slice_in_dim(s, start, k, 0) + d.astype(s.dtype)",
           "lax.dynamic_slice_in_dim(s, 0, k, 0) + d.astype(s.dtype)",
           PP_TESTS,
           "add_rows adds the rows' gradient to rows [0, k)'s sum and writes it at `start`"),
    Mutant("blind5-split-add-rows-k-of-the-sums", "blind5", SRC_PP_SPLIT,
           "        k = d.shape[0]\n",
           "        k = s.shape[0]\n",
           PP_TESTS,
           "add_rows takes k from the sums: W's one-layer gradient broadcast into every layer's row"),
    Mutant("blind5-split-w-layers-reversed", "blind5", SRC_PP_SPLIT,
           "(jnp.arange(self.depth), self.layers, operands, dys)",
           "(jnp.arange(self.depth)[::-1], self.layers, operands, dys)",
           PP_TESTS,
           "W adds layer l's gradient into row L/S - 1 - l"),
    Mutant("blind5-split-w-row-off-by-one", "blind5", SRC_PP_SPLIT,
           "return add_rows(sums, jax.tree.map(lambda d: d[None], d_layer), l), None",
           "return add_rows(sums, jax.tree.map(lambda d: d[None], d_layer), l - 1), None",
           PP_TESTS,
           "W adds layer l's gradient into row l - 1 (layer 0's clamped to row 0: two layers' in one row)"),
    Mutant("blind5-split-stash-float32", "blind5", SRC_PP_SPLIT,
           "return [self.varying(jnp.zeros((self.depth, *s.shape), s.dtype)) for s in shapes]",
           "return [self.varying(jnp.zeros((self.depth, *s.shape), jnp.float32)) for s in shapes]",
           PP_TESTS,
           "zb_h1's probes and stash in float32 whatever the compute dtype: bf16 blocks' outputs promoted, the "
           "stash twice the bytes"),
    # ------------------------------------------------------------------ RoPE on halves (model/layers.py, model/attention.py, config.py)
    Mutant("blind5-rope-rotates-backwards", "blind5", SRC_LAYERS,
           "return even * cos - odd * sin, even * sin + odd * cos",
           "return even * cos + odd * sin, odd * cos - even * sin",
           ROPE_TESTS,
           "each RoPE pair rotated by minus its angle (both layouts)"),
    Mutant("blind5-rope-halves-output-interleaved", "blind5", SRC_LAYERS,
           "return jnp.concatenate(_rotate(evens, odds, cos, sin), axis=-1).astype(x.dtype)",
           "return jnp.stack(_rotate(evens, odds, cos, sin), axis=-1).reshape(x.shape).astype(x.dtype)",
           ROPE_TESTS,
           "apply_rope_halves returns its pairs interleaved (apply_rope's output order), not as halves"),
    Mutant("blind5-rope-halves-theta-and-length-swapped", "blind5", SRC_LAYERS,
           "cos, sin = _rope_at(x.shape[-1], positions, theta, max_len)\n    evens, odds",
           "cos, sin = _rope_at(x.shape[-1], positions, max_len, theta)\n    evens, odds",
           ROPE_TESTS,
           "apply_rope_halves passes max_len as theta and theta as max_len: other frequencies"),
    Mutant("blind5-evens-then-odds-odds-first", "blind5", SRC_LAYERS,
           "return np.concatenate([np.arange(0, dh, 2), np.arange(1, dh, 2)])",
           "return np.concatenate([np.arange(1, dh, 2), np.arange(0, dh, 2)])",
           ROPE_TESTS,
           "evens_then_odds puts the odd features first"),
    Mutant("blind5-rope-k-interleaved", "blind5", SRC_LAYERS,
           "return attend(rope(q, positions, theta, max_len), rope(k, positions, theta, max_len), v)",
           "return attend(rope(q, positions, theta, max_len), apply_rope(k, positions, theta, max_len), v)",
           ROPE_TESTS,
           "attend_rotated rotates k's features as interleaved pairs even when they come as halves"),
    Mutant("blind5-heads-halves-not-passed-to-rope", "blind5", SRC_ATTENTION,
           "self.theta, self.max_len, attend, halves)",
           "self.theta, self.max_len, attend)",
           HEADS_TESTS,
           "the heads layout permutes q and k into halves but rotates them as interleaved pairs"),
    Mutant("blind5-heads-v-permuted-too", "blind5", SRC_ATTENTION,
           "permuted = (halves, halves, False)  # q, k, v",
           "permuted = (halves, halves, halves)  # q, k, v",
           HEADS_TESTS,
           "v's features permuted too: the attention output's features reach out_proj in the wrong order"),
    Mutant("blind5-rope-halves-at-512", "blind5", SRC_CONFIG,
           "return head_dim % 256 == 0",
           "return head_dim % 512 == 0",
           ROPE_TESTS,
           "RoPE on halves only at head_dim multiples of 512: the measured 160M shape (256) loses it"),
    Mutant("blind5-fast-halves-of-d-model", "blind5", SRC_FAST_PATH,
           "if rope_on_halves(m.head_dim) else",
           "if rope_on_halves(m.d_model) else",
           (FAST_PATH, BENCH),
           "the fast path's qkv_layout line claims RoPE halves by d_model (768: gpt2_125m), not head_dim"),
    # ------------------------------------------------------------------ the layer-by-layer sum (train/trainer.py)
    Mutant("blind5-sum-by-layer-sum-dtype-dropped", "blind5", SRC_TRAINER,
           "lambda p, xm, ym: loss(whole(*p), xm, ym), (rest, layers), x, y, grad_accum, count, sum_dtype)",
           "lambda p, xm, ym: loss(whole(*p), xm, ym), (rest, layers), x, y, grad_accum, count)",
           SUM_BY_LAYER_TESTS,
           "sum_by_layer does not pass sum_dtype on: --grad_accum_dtype=weight sums in float32 when unrolled"),
    Mutant("blind5-sum-by-layer-last-layer-dropped", "blind5", SRC_TRAINER,
           "for i in range(_depth(params[k]))] for k in stacks}",
           "for i in range(_depth(params[k]) - 1)] for k in stacks}",
           SUM_BY_LAYER_TESTS,
           "sum_by_layer splits a stack's first L - 1 layers: the last layer is lost"),
    Mutant("blind5-sum-by-layer-rest-params-not-grads", "blind5", SRC_TRAINER,
           "return loss_sum, whole(rest_grad, layer_grads)",
           "return loss_sum, whole(rest, layer_grads)",
           SUM_BY_LAYER_TESTS,
           "sum_by_layer returns the embedding's and head's PARAMS as their gradient"),
    Mutant("blind5-unrolled-stacks-model-depth", "blind5", SRC_TRAINER,
           "return tuple(name for name, stack in cfg.stacks if 1 < stack.num_layers <= cfg.scan_unroll)",
           "return tuple(name for name, stack in cfg.stacks if 1 < cfg.num_layers <= cfg.scan_unroll)",
           SUM_BY_LAYER_TESTS,
           "unrolled_stacks compares the model's depth, not each stack's: a 1-layer dense stack summed by "
           "layer, a fully unrolled dense stack not when the MoE stack is deeper"),
    Mutant("blind5-accum-per-layer-first-stack-only", "blind5", SRC_TRAINER,
           "return sum_by_layer(loss, params, x, y, grad_accum, count, sum_dtype, per_layer)",
           "return sum_by_layer(loss, params, x, y, grad_accum, count, sum_dtype, per_layer[-1:])",
           ACCUM_SUM_TESTS,
           "accumulated_value_and_grad sums only the last named stack by layer"),
    # ------------------------------------------------------------------ the memory model's table schedules (cost/memory.py)
    Mutant("blind5-memory-loss-bytes-gpipe-not-tables", "blind5", SRC_COST_MEMORY,
           'if "layers" in rules and schedule != "gpipe":\n        # a table',
           'if "layers" in rules and schedule == "gpipe":\n        # a table',
           (MEMORY, FAST_PATH),
           "the loss's float32 logits dropped from GPipe's stage and kept in the tables' (condition inverted)"),
    Mutant("blind5-memory-stash-of-whole-model", "blind5", SRC_COST_MEMORY,
           "return tokens * cfg.num_layers // stages * block",
           "return tokens * cfg.num_layers * block",
           STASH_TESTS,
           "zb_h1's stash counts every layer of the model, not the stage's L/S"),
    Mutant("blind5-memory-stash-w3-dy-dropped", "blind5", SRC_COST_MEMORY,
           "+ 2 * kv + 2 * f) * dtype_bytes  # operands, then dy's",
           "+ 2 * kv + f) * dtype_bytes  # operands, then dy's",
           STASH_TESTS,
           "zb_h1's stash omits one [tokens, F] output gradient (w3's)"),
    # ------------------------------------------------------------------ the HLO evaluator's async copies (hlo/evaluate.py)
    Mutant("blind5-evaluate-copy-start-misspelt", "blind5", SRC_EVALUATE,
           'if op == "copy-start":',
           'if op == "copy_start":',
           EVALUATE_TESTS,
           "the evaluator's copy-start case matches no opcode (HLO spells it with a hyphen): unreadable again"),
    Mutant("blind5-evaluate-copy-done-tuple", "blind5", SRC_EVALUATE,
           "return self.value(i.operands[0]).get(0)",
           "return self.value(i.operands[0])",
           EVALUATE_TESTS,
           "copy-done returns copy-start's whole (destination, source, context) instead of its destination"),
    # ------------------------------------------------------------------ the planner and the bench (launch/)
    Mutant("blind5-plan-schedules-only-when-fit", "blind5", SRC_LAUNCH_PLAN,
           "    if schedules:\n",
           "    if schedules and fit:\n",
           PLANNER_TESTS,
           "the schedule section shown only when a plan fits (reverted): a mesh that fits no plan hides which "
           "schedule comes closest"),
    Mutant("blind5-bench-command-without-dcn-mesh", "blind5", SRC_BENCH,
           '"mesh", "dcn_mesh", "devices",',
           '"mesh", "devices",',
           (BENCH,),
           "the bench's recorded command drops --dcn_mesh: a rerun builds one slice's mesh"),
    Mutant("blind5-bench-command-without-memory-flags", "blind5", SRC_BENCH,
           '"profiled_steps", "skip_memory_check", "device_memory_gib")',
           '"profiled_steps")',
           (BENCH,),
           "the bench's recorded command drops --skip_memory_check and --device_memory_gib"),
]
