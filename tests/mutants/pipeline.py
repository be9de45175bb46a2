"""Mutants of pipeline parallelism (pp, pp_fsdp)."""

from .base import Mutant, SRC_COST_ROWS, SRC_RUNNER

MUTANTS: list[Mutant] = [
    # --- pipeline parallelism (twinshard/parallel/pipeline.py, manual_parallel/pp.py, auto_parallel/pp.py)
    Mutant("pp-shift-backwards", "pipeline", "manual_parallel/collectives.py",
           "    return [(k, k + 1) for k in range(n - 1)]",
           "    return [(k + 1, k) for k in range(n - 1)]",
           ("tests/test_pipeline.py",), "stages hand their output to the previous stage"),
    Mutant("pp-shift-grad-forward", "pipeline", "manual_parallel/collectives.py",
           "    return lax.ppermute(x, axis, perm=[(dst, src) for src, dst in _to_next(lax.axis_size(axis), wrap)])",
           "    return lax.ppermute(x, axis, perm=_to_next(lax.axis_size(axis), wrap))",
           ("tests/test_pipeline.py",), "the activation gradient travels forward instead of back"),
    Mutant("pp-replicated-grads-mean", "pipeline", "manual_parallel/pp.py",
           "return loss, {k: jax.tree.map(lambda g: lax.psum(g, STAGE), v) if rep[k] else v for k, v in grads.items()}",
           "return loss, {k: jax.tree.map(lambda g: lax.pmean(g, STAGE), v) if rep[k] else v for k, v in grads.items()}",
           ("tests/test_pipeline.py",), "the embedding / lm_head gradients averaged over stages (only one is non-zero)"),
    Mutant("pp-too-few-ticks", "pipeline", "twinshard/parallel/pipeline.py",
           "    return microbatches + stages - 1",
           "    return microbatches + stages - 2",
           ("tests/test_pipeline.py",), "the last micro-batch never leaves the last stage"),
    Mutant("pp-auto-roll-backwards", "pipeline", "auto_parallel/pp.py",
           "jnp.roll(out, 1, axis=0)",
           "jnp.roll(out, -1, axis=0)",
           ("tests/test_pipeline.py",), "the GSPMD buffer shifts stage s -> s-1"),
    Mutant("pp-cost-one-way", "pipeline", SRC_COST_ROWS,
           '        row(ctx, "backward", "collective-permute", ("stage",), ticks, ctx.activation(b),',
           '        row(ctx, "backward", "collective-permute", ("stage",), 0, ctx.activation(b),',
           ("tests/test_pipeline.py",), "the cost model forgets the backward hand-offs"),
    # --- pp_fsdp (pipeline + FSDP inside each stage)
    Mutant("pp-fsdp-no-data-mean", "pipeline", SRC_RUNNER,
           "return self._mean_loss(loss), self.mean_over_tokens(grads, replicated)",
           "return self._mean_loss(loss), grads",
           ("tests/test_pipeline.py::test_pp_fsdp_matches_single_device",),
           "ManualRunner's step, around the pipeline, skips the DP mean: pp_fsdp's norm-gain gradients are "
           "not averaged over data (each data shard keeps its own)"),
    Mutant("pp-fsdp-auto-microbatch-split", "pipeline", "auto_parallel/pp.py",
           "micro = x.reshape(dp, m, b // dp, t, d).swapaxes(0, 1).reshape(m, b, t, d)",
           "micro = x.reshape(m, b, t, d)",
           ("tests/test_pipeline.py::test_pp_fsdp_matches_single_device",),
           "the GSPMD pipeline cuts micro-batches from the global rows, not from each data shard's "
           "(the finished rows come back in another order than the targets)"),
    Mutant("pp-fsdp-cost-stage-sum-whole", "pipeline", SRC_COST_ROWS,
           "shards = ctx.d if w.is_matrix else 1",
           "shards = 1",
           ("tests/test_pipeline.py::test_pp_fsdp_manual_ledger_equals_the_cost_model_exactly",),
           "the cost model sums whole embedding / lm_head gradients over stage, not their data shards"),
    Mutant("pp-fsdp-check-ignores-data", "pipeline", "twinshard/parallel/pipeline.py",
           "    if batch % (data * microbatches):",
           "    if batch % microbatches:",
           ("tests/test_pipeline.py::test_pp_fsdp_bad_batch_split_is_a_clear_error",),
           "a batch that does not split into data x M micro-batches is not refused before compiling"),
]
