"""Shared launcher plumbing: config from flags, runner selection, device setup.

A *runner* is one way of executing the train step (single device, or a
strategy twin). Every runner has the same interface, so the training loop
never knows which one it drives:

    runner.init_state(seed) -> TrainState      (created sharded, on device)
    runner.abstract_state() -> TrainState      (ShapeDtypeStructs + shardings)
    runner.place_batch(x, y) -> (x, y)         (numpy -> device arrays, per strategy)
    runner.train_step(state, x, y) -> (state, metrics)
    runner.eval_loss(params, x, y) -> loss
    runner.to_model(state) -> TrainState (the layers as a checkpoint holds them; to_stored back)

User errors (a ValueError or OSError: a bad flag value, an unreadable file, a
mesh that does not fit) reach the user as one message on stderr and exit
status 1 (`run` / `guarded`); `--debug` or TWINSHARD_DEBUG=1 shows the traceback.
Every check that can run before devices, compilation or writes does (`check_*`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
from typing import Callable

from absl import app, flags

from twinshard.parallel import strategies, support
from twinshard.config import CP_LAYOUTS, GRAD_ACCUM_DTYPES, MOE_DISPATCHES, OPTIMIZERS, PIPELINE_SCHEDULES, Config, ModelConfig, TrainConfig, preset
from twinshard.errors import guarded

STRATEGIES = strategies.RUNS  # single (the single-device reference) and the parallel strategies
PARALLEL = strategies.NAMES  # those a twin writes on a mesh; single (strategies.SINGLE) splits nothing
CROSS_DCN = strategies.CROSS_DCN  # those that may put an axis across slices (--dcn_mesh)
IMPLS = support.TWINS


def define(definer, name: str, *args, **kwargs) -> None:
    """Define a flag once per process: launchers share these, and tests import several. It is a
    key flag of the program run (absl's --help lists only those; --helpfull lists every flag)."""
    if name not in flags.FLAGS:
        definer(name, *args, **kwargs)
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])  # absl's name for __main__


_HELP = ("--help", "-help", "-?", "--helpshort", "--helpfull", "--helpxml")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, where asking for help exits 0 (absl exits 1: it is not an error)."""
    try:
        return app.parse_flags_with_usage(argv)
    except SystemExit as e:
        if e.code == 1 and any(a.split("=")[0] in _HELP for a in argv[1:]):
            raise SystemExit(0) from None
        raise


def define_model_flags() -> None:
    define(flags.DEFINE_string, "preset", "small", "Named preset from twinshard.config (tiny, small, gpt2_125m, ...).")
    define(flags.DEFINE_integer, "steps", None, "Training steps (default: the preset's).")
    define(flags.DEFINE_integer, "batch_size", None, "Global batch size in sequences.")
    define(flags.DEFINE_float, "lr", None, "Peak learning rate.")
    define(flags.DEFINE_integer, "seed", None, "Seed for init and batches.")
    define(flags.DEFINE_enum, "strategy", "single", STRATEGIES, "Parallelism strategy.")
    define(flags.DEFINE_enum, "impl", "auto", IMPLS, "auto (GSPMD annotations), manual (shard_map collectives) or "
           f"explicit (sharding in types: {', '.join(support.written_by('explicit'))}; docs/explicit.md).")
    define(flags.DEFINE_string, "mesh", None, "Mesh, e.g. data:4,tensor:2 (default: from the device count); "
           "with --dcn_mesh, the axes inside a slice (hsdp: fsdp:4).")
    define(flags.DEFINE_string, "dcn_mesh", None, "The mesh axes across slices, over the data-center network, "
           f"outermost (e.g. data:2; strategies {', '.join(strategies.CROSS_DCN)}): their product is the slice "
           "count (devices' slice_index; on CPU each process a slice, or one process's devices split evenly).")
    define(flags.DEFINE_integer, "devices", 8, "Simulated CPU devices when running a strategy on CPU; "
           "given explicitly, a single-process run with more devices uses only the first N.")
    define(flags.DEFINE_string, "tokenizer", None, "A tiktoken ranks file (from `python -m twinshard.train.bpe`) "
           "or a built-in name (bytes, gpt2, shakespeare4096); default: the preset's. Sets vocab_size.")
    define(flags.DEFINE_enum, "optimizer", None, OPTIMIZERS, "Optimizer (default: the preset's, adamw); "
           "its state is sharded like the params in every strategy.")
    define(flags.DEFINE_integer, "grad_accum", None, "Micro-batches per step: the batch is split into "
           "grad_accum micro-batches whose gradients are accumulated (default 1).")
    define(flags.DEFINE_enum, "grad_accum_dtype", None, GRAD_ACCUM_DTYPES, "The micro-batches' gradient sum: "
           "float32 (default), or weight: each param's dtype (the fast path's on a TPU with bf16 weights).")
    define(flags.DEFINE_integer, "microbatches", None, "Pipeline strategies (pp, pp_fsdp): micro-batches in flight per "
           "step, at least the number of stages (GPipe bubble: (S-1)/(M+S-1)).")
    define(flags.DEFINE_enum, "schedule", None, PIPELINE_SCHEDULES, "Pipeline schedule (default gpipe, both "
           "twins); 1f1b: one forward, one backward, at most S micro-batches alive per stage; interleaved: "
           "1F1B over --virtual_stages chunks per stage; zb_h1: 1F1B with each backward split into its input "
           "and weight gradients, the latter in the bubbles (twinshard/parallel/pipeline.py draws them).")
    define(flags.DEFINE_integer, "virtual_stages", None, "Pipeline --schedule=interleaved: chunks of "
           "L/(stage x V) layers per stage, placed round-robin (bubble (S-1)/(V M+S-1)).")
    define(flags.DEFINE_enum, "cp_layout", None, CP_LAYOUTS, "Context parallelism (cp, fsdp_cp): "
           "zigzag (default: shard c holds chunks c and 2C-1-c of 2C, balancing causal attention; "
           "--context_length a multiple of 2C) or contiguous (shard c holds the c-th T/C tokens; ulysses always).")
    define_precision_flags()


def define_memory_flags() -> None:
    """The flags launch/fit.py reads: every launcher that builds a step asks whether it fits."""
    define(flags.DEFINE_bool, "skip_memory_check", False, "Compile and run even when the step does not fit "
           "the device's memory (by the cost model, or by the compiled step's memory_analysis).")
    define(flags.DEFINE_float, "device_memory_gib", None, "Memory per device to check the step against "
           "(default: the accelerator's bytes_limit; on a CPU the host's memory before compiling, no check after).")


def define_precision_flags() -> None:
    define_memory_flags()  # --skip_memory_check, --device_memory_gib (launch/fit.py)
    from twinshard.config import ATTENTION_IMPLS, COMPUTE_DTYPES, REMAT_POLICIES, WEIGHT_DTYPES

    define(flags.DEFINE_enum, "dtype", None, COMPUTE_DTYPES, "Compute dtype (default: the preset's, float32): "
           "bfloat16 = bf16 activations and matmuls, float32 master weights, optimizer state, norms and loss.")
    define(flags.DEFINE_enum, "weight_dtype", None, WEIGHT_DTYPES, "Storage dtype of the params, their "
           "gradients and the optimizer's moments (default: the preset's, float32; bfloat16: half the bytes "
           "per parameter, no float32 master copy).")
    define(flags.DEFINE_enum, "attention", None, ATTENTION_IMPLS, "Attention kernel (default auto: cuDNN flash "
           "attention on a GPU in bf16, splash on a TPU in bf16, recompute elsewhere: its backward recomputes the "
           "probabilities, saving no [T, T] array; splash: JAX's Pallas TPU flash attention, interpret mode off a "
           "TPU, recompute under cp and fsdp_cp; xla: jax.nn's XLA kernel; reference: the readable "
           "twinshard.model.layers one).")
    define(flags.DEFINE_integer, "attention_block", None, "The splash kernel's block of queries and keys: a "
           "multiple of 128 dividing --context_length rounded up to 128 (default 0: the largest up to 512).")
    define(flags.DEFINE_integer, "scan_unroll", None, "Layers per iteration of the layer scan (default 1: "
           "compile time flat in depth; num_layers: fully unrolled, faster on CPU, compiles longer).")
    define(flags.DEFINE_bool, "collective_matmul", None, "tp_sp, manual twin: decompose each sequence "
           "all-gather before the column-parallel matmuls into ppermutes overlapped with the matmuls.")
    define(flags.DEFINE_integer, "tp_overlap_chunks", None, "tp, fsdp_tp (auto, manual twins): run each block "
           "on this many chunks of the device's batch, so one chunk's Megatron all-reduces over tensor can overlap "
           "another's matmuls (default 1: off; a divisor of the per-device batch).")
    define(flags.DEFINE_enum, "remat", None, REMAT_POLICIES, "Rematerialization of each layer (default none; "
           "full: recompute the layer in backward; dots: save only matmul outputs; dots_no_batch: save only "
           "matmul outputs without a batch dimension; save_qkv_proj: save q, k, v by name; save_dot_except_mlp: also the attention's "
           "output and out_proj (the MLP, norms and RoPE recomputed); minimal: save every projection and the attention kernel's out and log-sum-exp by name).")
    define(flags.DEFINE_integer, "loss_chunks", None, "Vocabulary tiling (default 0: off): the cross-entropy "
           "of each device's tokens in this many chunks, each chunk's logits recomputed in the backward pass, so "
           "no [B, T, V] float32 array is held; a divisor of the per-device batch x --context_length.")
    define_speed_flags()
    define_shape_flags()  # every launcher that builds a model config (train, plan, bench, collectives,
    define_moe_flags()  # compare) takes them


def define_speed_flags() -> None:
    """The accelerator-speed options (default: today's numerics), each a ModelConfig field of its name."""
    from twinshard.config import PRECISIONS, QKV_LAYOUTS, QUANTIZATIONS

    define(flags.DEFINE_enum, "logits_dtype", None, PRECISIONS, "The LM head's logits (default float32; compute: "
           "in the compute dtype with float32 max / log-sum-exp / target logit, no float32 [tokens, V] array).")
    define(flags.DEFINE_bool, "loss_recompute", None, "With --loss_chunks: each chunk's logits recomputed in the "
           "backward (default true); false saves them in the forward ([tokens, V] held, no second lm_head matmul).")
    define(flags.DEFINE_enum, "norm_dtype", None, PRECISIONS, "RMSNorm's elementwise work (default float32; "
           "compute: in the compute dtype, the mean of squares accumulated in float32).")
    define(flags.DEFINE_enum, "qkv_layout", None, QKV_LAYOUTS, "q, k, v: tokens (default: [B, T, h*dh], split "
           "into heads by transposes) or heads (einsummed straight into the kernel's [B, h, T, dh] and out).")
    define(flags.DEFINE_enum, "quantization", None, QUANTIZATIONS, "The blocks' q/k/v/o and MLP matmuls: none (default), "
           "int8 (int8 dots into int32 forward and for dx, per-channel absmax scales; no tensor parallelism) or "
           "int8_dw (dW in int8 too, its scales over the whole batch).")
    define(flags.DEFINE_bool, "splash_fused_bwd", None, "The splash kernel's backward: one fused kernel for dq, "
           "dk, dv (default true) or false: dq by a kernel of its own.")
    define(flags.DEFINE_integer, "xla_tpu_scoped_vmem_limit_kib", None, "XLA:TPU's scoped VMEM limit in KiB, "
           "a compile option of the train step (default 0: the compiler's, 16 MiB on a v5e; splash blocks of "
           "2048 need more); ignored off a TPU.")
    define(flags.DEFINE_bool, "async_collectives", None, "XLA:TPU runs all-reduces and all-gathers as async "
           "collective fusions beside compute (default true: twinshard/train/xla_options.py); false: the "
           "compiler's defaults. Ignored off a TPU.")


SPEED_FLAGS = ("logits_dtype", "loss_recompute", "norm_dtype", "qkv_layout", "quantization", "splash_fused_bwd",
               "xla_tpu_scoped_vmem_limit_kib", "async_collectives")


# The model-shape flags: each overrides the ModelConfig field of its name (None: the preset's), so
# any shape can be trained, compiled, benchmarked or planned (with_model_flags applies them).
_SHAPE_FLAGS = (
    ("vocab_size", "vocabulary size (padded to a multiple of 128 in the embedding; with a tokenizer, at "
     "least its ids)."),
    ("d_model", "model width D (a new d_model without --d_ff re-derives d_ff = 8/3 d_model)."),
    ("num_layers", "transformer blocks L."),
    ("num_heads", "query heads H, a divisor of d_model (head_dim = d_model / num_heads, even)."),
    ("num_kv_heads", "key/value heads of grouped-query attention, a divisor of num_heads (1: multi-query; "
     "0: num_heads, multi-head attention)."),
    ("d_ff", "SwiGLU width F (0: 8/3 d_model rounded up to a multiple of 64)."),
    ("context_length", "sequence length T."),
)
SHAPE_FLAGS = tuple(name for name, _ in _SHAPE_FLAGS)


def define_shape_flags() -> None:
    for name, text in _SHAPE_FLAGS:
        define(flags.DEFINE_integer, name, None, f"Model shape (default: the preset's): {text}")


# The mixture-of-experts flags: each overrides the ModelConfig field of its name (None: the preset's).
_MOE_FLAGS = (
    (flags.DEFINE_integer, "num_experts", "experts per layer, 0 = the dense feed-forward, >= 2 = every layer "
     "after --first_dense_layers routed (default: the preset's; tiny_moe, mixtral_8x7b have 4, 8)."),
    (flags.DEFINE_integer, "first_dense_layers", "which layers are MoE: the first K keep the dense feed-forward "
     "(DeepSeek's first_k_dense_replace), layers K..L-1 are routed (0 <= K < --num_layers; default 0: all)."),
    (flags.DEFINE_integer, "experts_per_token", "each token's top-k experts (1 <= k <= --num_experts; default 2)."),
    (flags.DEFINE_float, "capacity_factor", "buffer slots per expert per group, ceil(k * group * factor / "
     "num_experts); tokens past them are dropped (default 1.25; 0: dropless)."),
    (flags.DEFINE_integer, "moe_group_size", "tokens per capacity group, a divisor of the context length "
     "(default 0: the whole sequence)."),
    (flags.DEFINE_float, "router_aux_loss", "coefficient of the Switch load-balancing loss (default 0.01)."),
    (flags.DEFINE_float, "router_z_loss", "coefficient of the router z-loss (default 0)."),
    (flags.DEFINE_integer, "expert_d_ff", "each expert's feed-forward width (default 0: d_ff)."),
)
_MOE_DISPATCH_TEXT = ("how tokens reach their experts (default dense: the capacity buffers, an all_to_all pair "
                      "under ep; ragged: dropless, needs --capacity_factor=0, rows sorted by expert through "
                      "jax.lax.ragged_dot and, under manual ep, ragged_all_to_all: TPU/GPU only).")
MOE_FLAGS = (*(name for _, name, _ in _MOE_FLAGS), "moe_dispatch")


def define_moe_flags() -> None:
    for definer, name, text in _MOE_FLAGS:
        define(definer, name, None, "Mixture of experts: " + text)
    define(flags.DEFINE_enum, "moe_dispatch", None, MOE_DISPATCHES, "Mixture of experts: " + _MOE_DISPATCH_TEXT)


# The flags that override the ModelConfig field of their name (with_model_flags; launch.plan's
# launch line carries those that differ from the preset).
MODEL_FLAGS = ("dtype", "weight_dtype", "remat", "attention", "attention_block", "scan_unroll", "collective_matmul",
               "tp_overlap_chunks", "loss_chunks", *SPEED_FLAGS, *SHAPE_FLAGS, *MOE_FLAGS)


def with_model_flags(cfg: Config, FLAGS) -> Config:
    """--dtype / --attention / --scan_unroll / --remat, the shape flags (SHAPE_FLAGS) and the MoE flags
    (MODEL_FLAGS) applied to the model config (None: the preset's). A value ModelConfig refuses is its
    ValueError, the flags named first."""
    over = {k: getattr(FLAGS, k) for k in MODEL_FLAGS if getattr(FLAGS, k, None) is not None}
    if over.get("scan_unroll", 1) < 1:
        raise ValueError(f"--scan_unroll={over['scan_unroll']} must be >= 1 (layers per scan iteration; "
                         f"{cfg.model.num_layers} unrolls the stack fully).")
    if not over:
        return cfg
    given = " ".join(f"--{k}={v}" for k, v in over.items() if k in MOE_FLAGS or k in SHAPE_FLAGS)
    if "d_model" in over and "d_ff" not in over:
        over["d_ff"] = 0  # re-derive 8/3 d_model for the new width
    try:
        model = dataclasses.replace(cfg.model, **over)
    except ValueError as e:
        if not given:
            raise
        raise ValueError(f"{given}: {e}") from None
    return dataclasses.replace(cfg, model=model)


def attention_line(cfg: Config, strategy: str) -> str:
    """Which attention kernel runs (launchers print it): splash serves whole sequences, so the
    context-parallel strategies run recompute in its place."""
    import jax
    import jax.numpy as jnp

    from twinshard.model import layers

    kernel = layers.attention_kernel(cfg.model.attention, jnp.dtype(cfg.model.dtype))
    if kernel != "splash":
        return f"attention: {kernel}"
    if strategies.get(strategy).family == "context" and strategy not in strategies.ALL_TO_ALL_CONTEXT:
        return f"attention: recompute (splash needs whole sequences; {strategy} splits them)"
    mode = "" if jax.default_backend() == "tpu" else ", Pallas interpret mode: no TPU"
    return f"attention: splash (block {cfg.model.splash_block}{mode})"


def fast_path(cfg: Config, FLAGS, strategy: str, log=print) -> Config:
    """`cfg` on this process's accelerator's fast path (twinshard/hardware/fast_path.py: on a TPU, what
    tools/tpu_bench.sh measured best; elsewhere nothing), its choices and the flags that overrule them
    logged. Call after jax.distributed joins: it reads the devices."""
    import jax

    from twinshard.hardware import fast_path as chooser

    given = {n: getattr(FLAGS, n) for n in (*MODEL_FLAGS, "batch_size", "grad_accum", "grad_accum_dtype")
             if n in FLAGS and FLAGS[n].present}
    shape_given = any(n in FLAGS and FLAGS[n].present for n in (*SHAPE_FLAGS, *MOE_FLAGS, "tokenizer"))
    device = jax.devices()[0]
    path = chooser.choose(device.platform, device.device_kind, cfg, FLAGS.preset, given, strategy, shape_given)
    for line in path.lines():
        log(line)
    return path.cfg


def define_data_flags() -> None:
    define(flags.DEFINE_string, "data", None, "UTF-8 .txt or .txt.gz corpus (default: the embedded Shakespeare), "
           "or token shards: a directory from `python -m launch.tokenize`, a glob of .bin files or one .bin file.")
    define(flags.DEFINE_string, "cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "twinshard"),
            "Where tokenized corpora are cached (uint16 memmaps).")
    define(flags.DEFINE_enum, "data_dtype", None, ("uint16", "uint32"), "The id type of .bin token files that "
           "have no shards.json beside them: uint16 (nanoGPT's) or uint32.")


def load_splits(cfg: Config, data_path: str | None, cache_dir: str, data_dtype: str | None = None):
    """(train, validation) token arrays of the corpus (a text file, or token shards read as memmaps:
    twinshard.train.shards.open_shards); both must hold a full window. data_dtype: --data_dtype
    (default: the flag's value, where a launcher defines it)."""
    from twinshard.train import data, shards

    path = data_path or data.DEFAULT_CORPUS
    if data_dtype is None and "data_dtype" in flags.FLAGS and flags.FLAGS.is_parsed():
        data_dtype = flags.FLAGS.data_dtype
    if shards.is_token_files(path):
        tokens = shards.open_shards(path, cfg.train.tokenizer, cfg.model.vocab_size, data_dtype)
    elif data_dtype is not None:
        raise ValueError(f"--data_dtype={data_dtype} is for .bin token files; drop it for the text corpus {path}.")
    else:
        tokens = data.tokenize_to_memmap(path, cfg.train.tokenizer, cache_dir)
    train, val = data.split_tokens(tokens)
    for name, part in (("training", train), ("validation", val)):
        if len(part) < cfg.model.context_length + 1:
            raise ValueError(
                f"the {name} split of {path} has {len(part)} tokens, fewer than context_length+1 = "
                f"{cfg.model.context_length + 1}; pass a smaller --context_length or a larger --data.")
    return train, val


# Integer flags and their smallest valid value (checked as typed, so messages name the flag).
_MIN_INT_FLAGS = {"steps": 1, "batch_size": 1, "context_length": 1, "seed": 0, "grad_accum": 1, "microbatches": 1,
                  "virtual_stages": 1}


def check_model_flags(FLAGS) -> None:
    """The model/run flags' own values (as typed), before any config is built."""
    for name, low in _MIN_INT_FLAGS.items():
        value = getattr(FLAGS, name)
        if value is not None and value < low:
            raise ValueError(f"--{name}={value} must be >= {low}" + (
                "; drop it for the preset's value." if name != "seed" else " (numpy seeds are non-negative)."))
    if FLAGS.lr is not None and not (math.isfinite(FLAGS.lr) and FLAGS.lr > 0):
        raise ValueError(f"--lr={FLAGS.lr} must be a positive number, e.g. --lr=1e-3.")
    if FLAGS.devices < 1:
        raise ValueError(f"--devices={FLAGS.devices} must be >= 1.")


def config_from_flags(FLAGS) -> Config:
    """The preset with flag overrides; invalid values raise ValueError naming the flag, before any work."""
    from twinshard.config import PRESETS

    if FLAGS.preset not in PRESETS:
        raise ValueError(f"--preset={FLAGS.preset}: unknown preset {FLAGS.preset!r}; choose one of "
                         f"{', '.join(PRESETS)}.")
    check_model_flags(FLAGS)
    cfg = preset(FLAGS.preset)
    model: ModelConfig = cfg.model
    overrides = {k: getattr(FLAGS, k) for k in ("steps", "batch_size", "lr", "seed", "optimizer", "grad_accum",
                                                "grad_accum_dtype", "microbatches", "schedule", "virtual_stages", "cp_layout")
                 if getattr(FLAGS, k) is not None}
    if FLAGS.tokenizer is not None:
        if FLAGS.vocab_size is not None:
            raise ValueError(f"--vocab_size={FLAGS.vocab_size} and --tokenizer={FLAGS.tokenizer}: the tokenizer sets "
                             "the vocabulary; pass one of them.")
        # a file by absolute path: launch.sample and --resume find it from any directory
        overrides["tokenizer"] = FLAGS.tokenizer if not os.path.isfile(FLAGS.tokenizer) \
            else os.path.abspath(FLAGS.tokenizer)
        model = dataclasses.replace(model, vocab_size=tokenizer_vocab(FLAGS.tokenizer))
    elif FLAGS.vocab_size is not None and FLAGS.vocab_size < (ids := tokenizer_vocab(cfg.train.tokenizer)):
        raise ValueError(f"--vocab_size={FLAGS.vocab_size} is below the {ids} ids of the preset's tokenizer "
                         f"{cfg.train.tokenizer}, whose tokens would fall outside the embedding; pass "
                         f"--vocab_size >= {ids}, or a --tokenizer of at most {FLAGS.vocab_size} ids.")
    train: TrainConfig = cfg.train
    accum, batch = overrides.get("grad_accum", train.grad_accum), overrides.get("batch_size", train.batch_size)
    micro = overrides.get("microbatches", train.microbatches)
    if batch % micro:
        raise ValueError(f"--microbatches={micro} does not split the batch of {batch} sequences (--batch_size); "
                         f"choose --microbatches from {[k for k in range(1, batch + 1) if batch % k == 0]}.")
    if batch % accum:
        raise ValueError(f"--grad_accum={accum} does not split the batch of {batch} sequences (--batch_size) into "
                         f"equal micro-batches; choose --grad_accum from "
                         f"{[k for k in range(1, batch + 1) if batch % k == 0]}.")
    if overrides:
        if "lr" in overrides:  # keep the preset's lr/min_lr ratio
            overrides["min_lr"] = train.min_lr * overrides["lr"] / train.lr
        if "steps" in overrides:
            overrides["warmup_steps"] = min(train.warmup_steps, overrides["steps"])
        train = dataclasses.replace(train, **overrides)
    return with_model_flags(Config(model, train), FLAGS)


def tokenizer_vocab(name: str) -> int:
    """n_vocab of --tokenizer (a built-in name or a ranks file), checked before any work."""
    from twinshard.train import tokenizer

    if name not in tokenizer.TOKENIZERS and not os.path.isfile(name):
        raise ValueError(f"--tokenizer={name}: no such file and not a built-in tokenizer "
                         f"({', '.join(tokenizer.TOKENIZERS)}); make one with `python -m twinshard.train.bpe "
                         "--vocab_size=N --out=FILE.tiktoken`.")
    try:
        return tokenizer.get_encoding(name).n_vocab
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"--tokenizer={name} is not a tiktoken ranks file (`base64(token) rank` per "
                         f"line): {e}; make one with `python -m twinshard.train.bpe`.") from None


def check_output_path(path: str | None, flag: str, force: bool | None = None) -> None:
    """A file the run will write at the end: its directory must exist now, not after the run; with
    `force` given (a launcher's --force), an existing file only when it is True."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--{flag}={path} is a directory; pass a file path.")
    if force is False and os.path.exists(path):
        raise ValueError(f"--{flag}={path} exists; pass --force to overwrite it, or another path.")
    if not os.path.isdir(parent):
        raise ValueError(f"--{flag}={path}: directory {parent} does not exist; create it or pick another path.")
    if not _can_write_in(parent):
        raise ValueError(f"--{flag}={path}: cannot write in {parent}; pick a writable directory.")


def check_writable_dir(path: str, flag: str) -> None:
    """`path` is a directory, or can be made one, where this process can write; nothing is created."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ValueError(f"--{flag}={path} is a file, not a directory; pass a directory (created if missing).")
    existing = full
    while not os.path.exists(existing):  # also False below a file: walk up to what exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--{flag}={path}: {existing} is a file, so no directory can be made below it; "
                         "pass a path under a directory.")
    if not _can_write_in(existing):
        raise ValueError(f"--{flag}={path}: {existing} is not writable (read-only or not permitted); "
                         f"pass a --{flag} where you can write.")


def _can_write_in(directory: str) -> bool:
    """Probe by making (and removing) a temporary directory: os.access says yes to root on a
    read-only mount or sysfs, where mkdir still fails."""
    try:
        tempfile.TemporaryDirectory(dir=directory, prefix=".twinshard-probe-").cleanup()
    except OSError:
        return False
    return True


def run_devices(n: int, explicit: bool):
    """Devices for the runner: None (all of them), or the first n when --devices was given and
    this single-process run has more (tests run fsdp on 4 of their 8 simulated devices)."""
    import jax

    if not explicit or jax.process_count() > 1 or jax.device_count() <= n:
        return None
    return jax.devices()[:n]


def run(main: Callable, name: str) -> None:
    """absl's app.run(main) through `guarded`, with a --debug flag."""
    define(flags.DEFINE_bool, "debug", False, "On an error, show the Python traceback (or TWINSHARD_DEBUG=1).")
    app.run(lambda argv: guarded(main, argv, debug=flags.FLAGS.debug, name=name), flags_parser=parse_flags)


def resolve_run(strategy: str, impl: str, mesh_spec: str | None, cfg: Config, devices=None,
                first_devices: bool = False, dcn_spec: str | None = None):
    """The run of `strategy` in twin `impl` (twinshard.parallel.resolve.resolve_run, every check once;
    single in twin `impl`: launch.compare's reference of that twin, its options checked as the twin's).

    devices: None (all of jax.devices(), ordered by jax.make_mesh) or an explicit, ordered list;
    dcn_spec: --dcn_mesh, the axes across slices."""
    from twinshard.parallel import resolve

    return resolve.resolve_run(strategy, impl, mesh_spec, cfg, devices, first_devices, dcn_spec)


def make_runner(strategy: str, impl: str, mesh_spec: str | None, cfg: Config, devices=None,
                dcn_spec: str | None = None):
    """Build the runner for a strategy; validation errors are ValueErrors naming the fix."""
    return runner_of(resolve_run(strategy, impl, mesh_spec, cfg, devices, dcn_spec=dcn_spec))


def runner_of(run):
    """The runner of a resolved run (`resolve_run`): its twin's; on no mesh (single) the single-device one."""
    from twinshard.train.trainer import SingleDevice

    return twin(run.twin).runner_of(run) if run.mesh else SingleDevice(run.cfg.model, run.cfg.train)


def twin(name: str):
    """The package of twin `name` (one of twinshard.parallel.support.TWINS): its registry of strategies
    (`MODULES`) and the `runner_of` a resolved run."""
    import auto_parallel
    import explicit_parallel
    import manual_parallel

    return {package.TWIN: package for package in (auto_parallel, manual_parallel, explicit_parallel)}[name]


def default_platform() -> None:
    """On a machine with libtpu installed (the tpu extra) but no TPU chip or GPU, use the
    CPU without letting JAX probe libtpu (it prints TPU_WORKER_HOSTNAMES errors and
    holds /tmp/libtpu_lockfile). A set JAX_PLATFORMS, a TPU chip or a GPU: left alone."""
    from twinshard.hardware import topology

    topology.default_to_cpu()


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for n CPU devices; must run before jax initialises its backend."""
    if n > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}").strip()
