"""The curated mutants of tools/mutate.py: small, realistic bugs, one line each.

A mutant replaces `original` (which must occur exactly once in `file`, else the
mutant is reported `stale`) by `replacement` and names the tests that should
catch it, cheapest and likeliest first (pytest runs with -x, so a caught mutant
stops at its first failure). Selections are whole files unless a node id is
clearly enough: a mutant reported `missed` because its selection was too narrow
is a bug of this list, not of the tests.

How a selection is chosen: the tests that hold an independent reference for the
mutated code. A bug in shared single-device math (layers, loss, optimizer) changes
the single-device run and both twins alike, so the twin-vs-single tests cannot see
it: such a mutant selects the tests with hand/NumPy references (test_layers,
test_model, test_loss_optim). test_auto never imports manual_parallel/, so
manual-twin mutants select test_manual (and test_train, which trains manual fsdp).

`equivalent` (a reason) marks a mutant known not to change behaviour; such a
mutant is not run unless --run-equivalent (which then checks the label).

When code moves, fix the snippet here (the run reports `stale`). A new strategy
adds mutants for its placement table, each named collective (forward and
backward) and its cost-model rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    category: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    description: str
    equivalent: str | None = None


MANUAL = "tests/test_manual.py"
AUTO = "tests/test_auto.py"
COST = "tests/test_cost.py"
HLO = "tests/test_hlo.py"
LAYERS = "tests/test_layers.py"
MODEL = "tests/test_model.py"
OPTIM = "tests/test_loss_optim.py"
DATA = "tests/test_data.py"
TRAIN = "tests/test_train.py"
TPU = "tests/test_tpu_topology.py"
CLI = "tests/test_collectives_cli.py"

# Everything that reads a compiled ledger or the cost model (a parser or model bug shows there too).
LEDGER_TESTS = (HLO, MANUAL, AUTO, TPU, CLI)
COST_TESTS = (COST, MANUAL, TPU, CLI)
# Both twins (placement tables are read by both).
TWINS = (MANUAL, AUTO)

_COLL = "manual_parallel/collectives.py"
_TP = "manual_parallel/tp.py"
_FSDP = "manual_parallel/fsdp.py"
_RUNNER = "manual_parallel/runner.py"
_OPTIM = "twinshard/optim.py"
_LAYERS = "twinshard/layers.py"
_LOSS = "twinshard/loss.py"
_MODEL = "twinshard/model.py"
_DATA = "twinshard/data.py"
_HLO = "twinshard/hlo.py"
_COST = "twinshard/cost.py"
_TRAIN = "launch/train.py"

MUTANTS: list[Mutant] = [
    # --- named collectives, forward and backward (manual_parallel/collectives.py)
    Mutant("fsdp-gather-wrong-dim", "collective", _COLL,
           "lax.all_gather(w_shard, axis, axis=dim, tiled=True)",
           "lax.all_gather(w_shard, axis, axis=0, tiled=True)",
           (MANUAL,), "fsdp_gather forward gathers along dim 0 whatever dimension is sharded"),
    Mutant("fsdp-scatter-not-summed", "collective", _COLL,
           "lax.psum_scatter(grad_full, axis, scatter_dimension=dim, tiled=True) / n",
           "lax.dynamic_slice_in_dim(grad_full, lax.axis_index(axis) * (grad_full.shape[dim] // n), "
           "grad_full.shape[dim] // n, dim) / n",
           (MANUAL,), "fsdp_gather backward keeps its own slice of the gradient instead of reduce-scattering"),
    Mutant("fsdp-scatter-no-mean", "collective", _COLL,
           "lax.psum_scatter(grad_full, axis, scatter_dimension=dim, tiled=True) / n",
           "lax.psum_scatter(grad_full, axis, scatter_dimension=dim, tiled=True)",
           (MANUAL,), "fsdp_gather backward sums instead of averaging (no division by the data size)"),
    Mutant("copy-to-tp-bwd-pmean", "collective", _COLL,
           "return (lax.psum(grad, axis),)",
           "return (lax.pmean(grad, axis),)",
           (MANUAL,), "Megatron f backward averages the partial input gradients instead of summing"),
    Mutant("copy-to-tp-fwd-no-pcast", "collective", _COLL,
           'return lax.pcast(x, axis, to="varying")  # a type change: no data moves',
           "return x",
           (MANUAL,), "Megatron f forward leaves x invariant, so autodiff adds its own psum to f's"),
    Mutant("reduce-from-tp-fwd-pmean", "collective", _COLL,
           "return lax.psum(x, axis)",
           "return lax.pmean(x, axis)",
           (MANUAL,), "Megatron g forward averages the row-parallel partial sums"),
    Mutant("reduce-from-tp-bwd-psum", "collective", _COLL,
           'return (lax.pcast(grad, axis, to="varying"),)  # a type change: no data moves',
           "return (lax.psum(grad, axis),)",
           (MANUAL,), "Megatron g backward all-reduces the (already replicated) output gradient"),
    # --- Megatron TP specifics (manual_parallel/tp.py, twinshard/model.py, twinshard/loss.py)
    Mutant("tp-embed-no-mask", "tp", _TP,
           "reduce_from_tp(jnp.where(mine[..., None], rows, 0.0), TENSOR)",
           "reduce_from_tp(rows, TENSOR)",
           (MANUAL,), "vocab-parallel embedding sums clipped lookups of ids other shards own"),
    Mutant("tp-embed-offset", "tp", _TP,
           "local = ids - lax.axis_index(TENSOR) * v_local",
           "local = ids - lax.axis_index(TENSOR)",
           (MANUAL,), "vocab-parallel embedding offsets ids by the shard index, not index x rows"),
    Mutant("tp-embed-plain-psum", "tp", _TP,
           "return reduce_from_tp(jnp.where(mine[..., None], rows, 0.0), TENSOR)",
           "return lax.psum(jnp.where(mine[..., None], rows, 0.0), TENSOR)",
           (MANUAL,), "embedding psum written as a bare lax.psum instead of g",
           equivalent="under check_vma autodiff transposes psum into a pcast to varying, exactly "
                      "g's backward; same HLO, same source line"),
    Mutant("tp-loss-offset", "tp", _TP,
           "offset = lax.axis_index(TENSOR) * logits.shape[-1]",
           "offset = 0",
           (MANUAL,), "vocab-parallel cross-entropy treats every shard's columns as ids 0..V/t"),
    Mutant("tp-loss-local-max", "tp", _TP,
           "reduce_max=functools.partial(lax.pmax, axis_name=TENSOR)",
           "reduce_max=lambda m: m",
           (MANUAL,), "vocab-parallel cross-entropy uses each shard's own max (no pmax)"),
    Mutant("tp-loss-max-psum", "tp", _TP,
           "reduce_max=functools.partial(lax.pmax, axis_name=TENSOR)",
           "reduce_max=functools.partial(lax.psum, axis_name=TENSOR)",
           (MANUAL,), "pmax of the logit max written as psum: exact in math, exp(z - sum of "
                            "maxes) underflows to a -inf/nan loss once logits are large"),
    Mutant("tp-loss-sum-pmean", "tp", _TP,
           "reduce_sum=functools.partial(lax.psum, axis_name=TENSOR)",
           "reduce_sum=functools.partial(lax.pmean, axis_name=TENSOR)",
           (MANUAL,), "vocab-parallel cross-entropy averages sum-exp and the target logit"),
    Mutant("loss-target-any-later-shard", "tp", _LOSS,
           "on_shard = (local >= 0) & (local < z.shape[-1])",
           "on_shard = local >= 0",
           (OPTIM, MANUAL), "a shard counts the target logit of ids that live on later shards"),
    Mutant("model-no-f-before-lm-head", "tp", _MODEL,
           "self.lm_head(par.enter_tensor_parallel(x), par)",
           "self.lm_head(x, par)",
           (MANUAL,), "Megatron f dropped before lm_head: autodiff inserts the psum itself, unnamed"),
    Mutant("model-no-g-after-attention", "tp", _MODEL,
           "return par.exit_tensor_parallel(out)",
           "return out",
           (MANUAL,), "Megatron g dropped after output_proj: attention output stays a partial sum"),
    # --- the manual runner: DP mean, pcast, loss mean, clipping norm (manual_parallel/runner.py)
    Mutant("dp-mean-psum", "runner", _RUNNER,
           "lax.pmean(g, DATA) if r else g",
           "lax.psum(g, DATA) if r else g",
           (MANUAL,), "data-parallel gradient sync sums instead of averaging"),
    Mutant("dp-mean-skipped", "runner", _RUNNER,
           "return jax.tree.map(lambda g, r: lax.pmean(g, DATA) if r else g, grads, replicated)",
           "return grads",
           (MANUAL,), "data-parallel gradient sync forgotten"),
    Mutant("dp-no-pcast-before-grad", "runner", _RUNNER,
           'params = jax.tree.map(lambda p, r: lax.pcast(p, DATA, to="varying") if r else p,\n'
           "                              params, replicated)",
           "pass",
           (MANUAL,), "params not pcast to varying: autodiff psums over data, then the pmean double-counts"),
    Mutant("loss-mean-psum", "runner", _RUNNER,
           "return lax.pmean(loss, DATA) if self.sizes[DATA] > 1 else loss",
           "return lax.psum(loss, DATA) if self.sizes[DATA] > 1 else loss",
           (MANUAL,), "reported loss summed over data shards instead of averaged"),
    Mutant("norm-psum-pmean", "runner", _RUNNER,
           "lax.psum(sq, axes) if axes else sq",
           "lax.pmean(sq, axes) if axes else sq",
           (MANUAL, TRAIN), "global-norm partial squares averaged instead of summed over shards"),
    Mutant("norm-returns-square", "runner", _RUNNER,
           "return jnp.sqrt(total)",
           "return total",
           (MANUAL, TRAIN), "global_norm returns the squared norm"),
    Mutant("norm-active-axes-unordered", "runner", _RUNNER,
           "return tuple(a for a in mesh_lib.AXES if a in axes and sizes[a] > 1)",
           "return tuple(a for a in axes if sizes[a] > 1)",
           (MANUAL,), "_active keeps spec order, so P('tensor','data') and P('data','tensor') get two psums"),
    # --- FSDP remat policy (manual_parallel/fsdp.py)
    Mutant("fsdp-remat-saves-gathers", "fsdp", _FSDP,
           'return not any(e.primitive.name == "all_gather" for e in params["call_jaxpr"].eqns)',
           "return True",
           (MANUAL,), "remat policy saves the gathered weights: no re-gather, full weights live to backward"),
    Mutant("fsdp-remat-recomputes-psums", "fsdp", _FSDP,
           '_SAVED = {"dot_general", "gather", "psum", "psum_invariant", "pmax"}',
           '_SAVED = {"dot_general", "gather", "pmax"}',
           (MANUAL,), "remat policy recomputes all-reduce outputs: fsdp_tp's backward repeats TP psums"),
    # --- placement tables (auto_parallel/*.py; the manual twin imports the same tables)
    Mutant("place-dp-batch-replicated", "placement", "auto_parallel/dp.py",
           'ACTIVATION_RULES: dict[str, str] = {"batch": "data"}',
           "ACTIVATION_RULES: dict[str, str] = {}",
           TWINS, "dp does not split the batch: every device trains on all of it"),
    Mutant("place-fsdp-weights-replicated", "placement", "auto_parallel/fsdp.py",
           'PARAM_RULES: dict[str, str] = {"embed": "data"}',
           "PARAM_RULES: dict[str, str] = {}",
           TWINS, "fsdp keeps every weight whole on every device (it is dp)"),
    Mutant("place-fsdp-batch-replicated", "placement", "auto_parallel/fsdp.py",
           'ACTIVATION_RULES: dict[str, str] = {"batch": "data"}',
           "ACTIVATION_RULES: dict[str, str] = {}",
           TWINS, "fsdp does not split the batch"),
    Mutant("place-tp-vocab-whole", "placement", "auto_parallel/tp.py",
           'PARAM_RULES: dict[str, str] = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}',
           'PARAM_RULES: dict[str, str] = {"heads": "tensor", "mlp": "tensor"}',
           TWINS, "tp keeps embedding and lm_head whole (not vocab-parallel)"),
    Mutant("place-tp-mlp-gathered-at-use", "placement", "auto_parallel/tp.py",
           'ACTIVATION_RULES: dict[str, str] = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}',
           'ACTIVATION_RULES: dict[str, str] = {"heads": "tensor", "vocab": "tensor"}',
           TWINS, "tp's use layout drops mlp: GSPMD gathers W1/W2/W3 before each use"),
    Mutant("place-fsdp_tp-heads-whole", "placement", "auto_parallel/fsdp_tp.py",
           'PARAM_RULES: dict[str, str] = {"embed": "data", "heads": "tensor", "mlp": "tensor", '
           '"vocab": "tensor"}',
           'PARAM_RULES: dict[str, str] = {"embed": "data", "mlp": "tensor", "vocab": "tensor"}',
           TWINS, "fsdp_tp does not split attention heads over tensor"),
    Mutant("place-fsdp_tp-batch-replicated", "placement", "auto_parallel/fsdp_tp.py",
           'ACTIVATION_RULES: dict[str, str] = {"batch": "data", "heads": "tensor"',
           'ACTIVATION_RULES: dict[str, str] = {"heads": "tensor"',
           TWINS, "fsdp_tp does not split the batch over data"),
    # --- optimizer (twinshard/optim.py, twinshard/trainer.py)
    Mutant("clip-always-rescales", "optim", _OPTIM,
           "scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))",
           "scale = max_norm / (norm + 1e-6)",
           (OPTIM,), "clipping also scales small gradients up to max_norm"),
    Mutant("grad-norm-reported-clipped", "optim", _OPTIM,
           "return updates, GuardState(new_inner, state.skipped + (~ok).astype(jnp.int32), norm)",
           "return updates, GuardState(new_inner, state.skipped + (~ok).astype(jnp.int32), norm_fn(grads))",
           (OPTIM,), "with skip_nonfinite (the default) grad_norm is the clipped norm"),
    Mutant("skip-misses-inf", "optim", _OPTIM,
           "ok = jnp.isfinite(norm)",
           "ok = ~jnp.isnan(norm)",
           (OPTIM,), "the non-finite guard skips nan but applies inf gradients"),
    Mutant("skip-keeps-bad-moments", "optim", _OPTIM,
           "new_inner = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_inner, state.inner)",
           "new_inner = jax.tree.map(lambda n, o: n, new_inner, state.inner)",
           (OPTIM,), "a skipped step still writes nan into the AdamW moments"),
    Mutant("cosine-span-from-zero", "optim", _OPTIM,
           "span = max(cosine_steps - warmup_steps, 1)",
           "span = max(cosine_steps, 1)",
           (OPTIM,), "cosine decays over all steps instead of the post-warmup span"),
    Mutant("cosine-end-inclusive", "optim", _OPTIM,
           "jnp.where(t <= cosine_steps, cos, lr_min)",
           "jnp.where(t < cosine_steps, cos, lr_min)",
           (OPTIM,), "cosine branch ends one step early",
           equivalent="at t = cosine_steps the cosine is already lr_min exactly "
                      "(1 + cos(pi) == 0.0 in float32)"),
    Mutant("warmup-off-by-one", "optim", _OPTIM,
           "warm = lr_max * t / max(warmup_steps, 1)",
           "warm = lr_max * (t + 1) / max(warmup_steps, 1)",
           (OPTIM,), "warmup starts at lr_max/warmup instead of 0"),
    Mutant("adamw-betas-swapped", "optim", _OPTIM,
           "b1=cfg.beta1, b2=cfg.beta2",
           "b1=cfg.beta2, b2=cfg.beta1",
           (OPTIM,), "AdamW gets beta1 and beta2 swapped"),
    Mutant("adamw-weight-decay-default", "optim", _OPTIM,
           "weight_decay=cfg.weight_decay)",
           ")",
           (OPTIM,), "AdamW weight decay not passed through (optax's default 1e-4 used)"),
    Mutant("adamw-eps-default", "optim", _OPTIM,
           "eps=cfg.eps,",
           "",
           (OPTIM,), "AdamW eps not passed through (optax's default 1e-8 used)"),
    Mutant("lr-reported-ignores-skips", "optim", "twinshard/trainer.py",
           "applied_before = state.step - state.opt_state.skipped",
           "applied_before = state.step",
           (OPTIM, TRAIN), "the reported lr runs on the step count, not on applied updates"),
    # --- layers (twinshard/layers.py, twinshard/config.py, twinshard/loss.py)
    Mutant("rmsnorm-eps-ignored", "layers", _LAYERS,
           "jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)",
           "jnp.mean(x32 * x32, axis=-1, keepdims=True))",
           (LAYERS, MODEL), "RMSNorm ignores eps"),
    Mutant("rmsnorm-eps-1e-6", "layers", "twinshard/config.py",
           "norm_eps: float = 1e-5",
           "norm_eps: float = 1e-6",
           (LAYERS, MODEL), "RMSNorm eps default 1e-6 instead of the spec's 1e-5"),
    Mutant("rope-sign", "layers", _LAYERS,
           "rot_even = x_even * cos - x_odd * sin",
           "rot_even = x_even * cos + x_odd * sin",
           (LAYERS, MODEL), "RoPE rotates the even features the wrong way"),
    Mutant("rope-frequencies", "layers", _LAYERS,
           "inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)",
           "inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / (head_dim // 2))",
           (LAYERS, MODEL), "RoPE frequencies use head_dim/2 in the exponent"),
    Mutant("softmax-no-max-shift", "layers", _LAYERS,
           "z = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))",
           "z = x",
           (LAYERS, MODEL), "softmax without subtracting the max (overflows at large scores)"),
    Mutant("causal-mask-sees-next", "layers", _LAYERS,
           "return jnp.tril(jnp.ones((t, t), dtype=bool))",
           "return jnp.tril(jnp.ones((t, t), dtype=bool), 1)",
           (LAYERS, MODEL), "causal mask lets each query see the next token"),
    Mutant("attention-scale", "layers", _LAYERS,
           "/ jnp.sqrt(q.shape[-1]).astype(q.dtype)",
           "/ q.shape[-1]",
           (LAYERS, MODEL), "attention scores divided by dk instead of sqrt(dk)"),
    Mutant("padded-logit-mask-off-by-one", "layers", _LOSS,
           "return jnp.where(ids < vocab_size, logits, -jnp.inf)",
           "return jnp.where(ids <= vocab_size, logits, -jnp.inf)",
           (OPTIM, MODEL), "the first padded vocab column takes probability"),
    Mutant("prenorm-skips-ln1", "layers", _MODEL,
           "x + self.attn(self.ln1(x, par), par)",
           "x + self.attn(x, par)",
           (MODEL,), "attention reads the un-normalised residual"),
    # --- data pipeline (twinshard/data.py)
    Mutant("batch-targets-not-shifted", "data", _DATA,
           "return windows[:, :-1], windows[:, 1:]",
           "return windows[:, :-1], windows[:, :-1]",
           (DATA,), "targets are the inputs, not the next tokens"),
    Mutant("batch-last-start-unreachable", "data", _DATA,
           "n_starts = len(tokens) - context_length",
           "n_starts = len(tokens) - context_length - 1",
           (DATA,), "get_batch never samples the last valid window"),
    Mutant("batch-seed-step-collide", "data", _DATA,
           "np.random.default_rng([seed, step])",
           "np.random.default_rng(seed + step)",
           (DATA, TRAIN), "(seed, step) -> seed + step: runs with other seeds replay shifted batches"),
    Mutant("split-overlaps", "data", _DATA,
           "tokens[len(tokens) - n_val :]",
           "tokens[len(tokens) - n_val - 1 :]",
           (DATA,), "validation split shares one token with the training split"),
    # --- checkpoint resume and sampling (launch/, twinshard/checkpoint.py)
    Mutant("resume-restarts-at-zero", "resume", _TRAIN,
           "start = int(_scalar(state.step))",
           "start = 0",
           (TRAIN,), "--resume restores the state but replays the data from step 0"),
    Mutant("resume-drops-metrics", "resume", _TRAIN,
           'return [r for r in map(json.loads, f) if r["step"] <= upto_step]',
           "return []",
           (TRAIN,), "--resume drops the metrics written before the checkpoint"),
    Mutant("resume-skips-meta-check", "resume", "twinshard/checkpoint.py",
           '_check_same(key, meta.get(key), want, f"{self.directory}/{step}")',
           "pass",
           (TRAIN,), "restore does not compare the checkpoint's model config with the run's"),
    Mutant("sample-ignores-checkpoint", "resume", "launch/sample.py",
           "ids = generate(state.params, model_cfg,",
           "ids = generate(SingleDevice(model_cfg, train_cfg).init_state(train_cfg.seed).params, model_cfg,",
           (TRAIN,), "launch.sample generates from freshly initialised weights, not the checkpoint's"),
    # --- the HLO ledger parser (twinshard/hlo.py)
    Mutant("hlo-iota-transpose-ignored", "ledger", _HLO,
           'ids = ids.transpose([int(x) for x in m.group(3).split(",")])',
           "ids = ids",
           LEDGER_TESTS, "iota replica groups ignore their T(...) transpose"),
    Mutant("hlo-mesh-subaxis-stride", "ledger", _HLO,
           "refs.append((i, sizes[i] // (pre * size), size))",
           "refs.append((i, pre, size))",
           LEDGER_TESTS, "mesh sub-axis (pre)size decoded with stride = pre"),
    Mutant("hlo-empty-groups", "ledger", _HLO,
           "    if not groups:\n        groups = [list(range(num_partitions))]",
           "    if groups is None:\n        groups = [list(range(num_partitions))]",
           LEDGER_TESTS, "replica_groups={} is no longer read as one group of all partitions"),
    Mutant("hlo-partial-group-check", "ledger", _HLO,
           "if len(set(coords[i])) < mesh.shape[i] or len(g) < full:",
           "if len(set(coords[i])) < mesh.shape[i]:",
           LEDGER_TESTS, "classify misses groups that span each axis but not the product of the axes"),
    Mutant("hlo-trip-count-ignored", "ledger", _HLO,
           'factor = trips + (1 if key == "condition" else 0)',
           'factor = 1 + (1 if key == "condition" else 0)',
           LEDGER_TESTS, "collectives in a while body counted once, not per trip"),
    Mutant("hlo-async-done-counted", "ledger", _HLO,
           'if form in ("done", "update") or (comp, i.name) in async_copies:',
           'if form == "update" or (comp, i.name) in async_copies:',
           LEDGER_TESTS, "async collectives counted at -start and again at -done"),
    Mutant("hlo-async-fusion-copies-counted", "ledger", _HLO,
           'if form in ("done", "update") or (comp, i.name) in async_copies:',
           'if form in ("done", "update"):',
           LEDGER_TESTS, "TPU async collective fusions counted once per computation of the chain"),
    Mutant("hlo-tuple-all-reduce-one-record", "ledger", _HLO,
           'if op in ("all-to-all", "ragged-all-to-all") or len(parts) == 1:',
           'if op in ("all-to-all", "ragged-all-to-all", "all-reduce") or len(parts) == 1:',
           LEDGER_TESTS, "a combined tuple all-reduce becomes one record, not one per operand"),
    Mutant("hlo-subbyte-bytes", "ledger", _HLO,
           "return math.prod(self.dims) * _DTYPE_BITS[self.dtype] // 8",
           "return math.prod(self.dims) * (_DTYPE_BITS[self.dtype] // 8)",
           LEDGER_TESTS, "bytes per element rounded down first: 4-bit and 1-bit types count 0 bytes"),
    Mutant("hlo-bf16-as-f32", "ledger", _HLO,
           '"f16": 16, "bf16": 16,',
           '"f16": 16, "bf16": 32,',
           LEDGER_TESTS, "bf16 collectives counted at 4 bytes per element"),
    Mutant("hlo-ring-reduce-scatter", "ledger", _HLO,
           '"reduce-scatter": float((n - 1) * nbytes),',
           '"reduce-scatter": (n - 1) / n * nbytes,',
           LEDGER_TESTS + (COST,), "reduce-scatter ring bytes use the all-gather formula on the result"),
    # --- the analytic cost model (twinshard/cost.py)
    Mutant("cost-ce-stats-compute-dtype", "cost", _COST,
           "a, stats, L = ctx.activation(batch), batch * ctx.seq * F32, ctx.L",
           "a, stats, L = ctx.activation(batch), batch * ctx.seq * ctx.s, ctx.L",
           COST_TESTS, "cross-entropy statistics sized with the compute dtype, not f32"),
    Mutant("cost-tp-activations-whole", "cost", _COST,
           "per_layer = b * seq * (4 * d + 4 * d // t + 3 * f // t) + b * (h // t) * seq * seq",
           "per_layer = b * seq * (4 * d + 4 * d + 3 * f) + b * h * seq * seq",
           COST_TESTS, "TP activation memory not divided by the tensor size"),
    Mutant("cost-fsdp_tp-gathered-whole", "cost", _COST,
           "gathered = max(layer, v * d) * dtype_bytes // t",
           "gathered = max(layer, v * d) * dtype_bytes",
           COST_TESTS, "fsdp_tp's gathered-weight memory not divided by the tensor size"),
    Mutant("cost-reduce-scatter-operand-bytes", "cost", _COST,
           "w.size * ctx.s // (tensor_shards * ctx.d),",
           "w.size * ctx.s // tensor_shards,",
           COST_TESTS, "reduce-scatter bytes counted as the operand, not the result"),
    Mutant("cost-embedding-regathered", "cost", _COST,
           "for w in _matrices(ctx) if w.name not in NOT_REGATHERED]",
           "for w in _matrices(ctx)]",
           COST_TESTS, "the model re-gathers the embedding table in backward"),
    Mutant("cost-megatron-g-once", "cost", _COST,
           'row(ctx, "forward", "all-reduce", ("tensor",), 2 * L, a,',
           'row(ctx, "forward", "all-reduce", ("tensor",), L, a,',
           COST_TESTS, "one Megatron g per layer in the model instead of two"),
    Mutant("cost-fsdp_tp-norm-axes", "cost", _COST,
           '_norm_row(ctx, ("data", "tensor"))',
           '_norm_row(ctx, ("tensor",))',
           COST_TESTS, "fsdp_tp's global-norm psum modelled over tensor only"),
    Mutant("cost-dp-no-loss-row", "cost", _COST,
           "return grads + [_loss_row(ctx)]",
           "return grads",
           COST_TESTS, "dp's model forgets the loss pmean"),
    Mutant("cost-attention-flops-halved", "cost", _COST,
           "fwd_attn = n * 2 * 2 * batch * seq * seq * hd",
           "fwd_attn = n * 2 * batch * seq * seq * hd",
           COST_TESTS, "attention FLOPs halved for causality (the code computes the full T x T)"),
    Mutant("cost-flops-per-device", "cost", _COST,
           "3 * fwd, 3 * fwd / n_devices)",
           "3 * fwd, 3 * fwd)",
           COST_TESTS, "per-device FLOPs not divided by the device count"),
    Mutant("cost-optimizer-one-moment", "cost", _COST,
           "return Memory(params, params, 2 * params, acts, gathered)",
           "return Memory(params, params, params, acts, gathered)",
           COST_TESTS, "optimizer memory counts one AdamW moment"),
]
