"""Typed configuration and named presets: a `Config` = `ModelConfig` + `TrainConfig`;
`preset(name)` returns a frozen preset that launchers override with `dataclasses.replace`.
Every field is checked by type (twinshard/field_types.py), then range, when built; a bad value is a
ValueError naming `ModelConfig.d_model`-style the field, the value and what is accepted.

    >>> from twinshard.config import preset
    >>> cfg = preset("tiny")
    >>> cfg.model.d_ff, cfg.model.padded_vocab_size
    (192, 384)
"""

from __future__ import annotations

import dataclasses
import math

from twinshard.field_types import check_types
from twinshard.splash_blocks import splash_block

COMPUTE_DTYPES = ("float32", "bfloat16")
PRECISIONS = ("float32", "compute")  # ModelConfig.logits_dtype / norm_dtype (the fields say what each means)
QKV_LAYOUTS = ("tokens", "heads")  # ModelConfig.qkv_layout
QUANTIZATIONS = ("none", "int8", "int8_dw")  # ModelConfig.quantization (twinshard/model/quantize.py)
WEIGHT_DTYPES = ("float32", "bfloat16")  # ModelConfig.weight_dtype: the params', gradients' and moments' dtype
ATTENTION_IMPLS = ("auto", "reference", "recompute", "xla", "cudnn", "splash")  # twinshard.model.layers.causal_attention
# jax.checkpoint policy of the scanned block (twinshard.model.scan_layers); "none": no remat
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "save_qkv_proj", "save_dot_except_mlp", "minimal")
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")  # twinshard/parallel/pipeline.py  # twinshard.train.optim.make_optimizer
GRAD_ACCUM_DTYPES = ("float32", "weight")  # the micro-batch gradient sum (twinshard.train.trainer.accumulated_value_and_grad)
CP_LAYOUTS = ("zigzag", "contiguous")  # context parallelism's token layout (twinshard/parallel/context.py)
# How a mixture of experts moves its tokens to the experts (twinshard/model/moe.py): "dense", the
# GShard capacity buffers and einsums; "ragged", dropless rows sorted by expert and jax.lax.ragged_dot
MOE_DISPATCHES = ("dense", "ragged")
VOCAB_MULTIPLE = 128  # pad the vocab so it splits over any power-of-two tensor axis <= 128


def _round_up(x: int, multiple: int) -> int:
    return multiple * math.ceil(x / multiple)


def default_d_ff(d_model: int) -> int:
    """SwiGLU width: 8/3 d_model rounded up to a multiple of 64 (JAX-LM spec)."""
    return _round_up(math.ceil(8 * d_model / 3), 64)


def rope_on_halves(head_dim: int) -> bool:
    """Whether the heads layout (ModelConfig.qkv_layout="heads") rotates q and k on halves
    (twinshard.model.layers.apply_rope_halves): where each half is whole vregs of a TPU's 128 lanes. Measured on
    one v5e (jax 0.10.2, qkv_layout=heads), a step with halves against stride-2 pairs: head_dim 256 (the 160M
    shape) 764.7 against 795.2 ms; 64 (gpt2_125m, halves of 32 lanes) 147.1 against 131.3 ms; 128
    (llama_v5e) 254.6 against 255.0 ms."""
    return head_dim % 256 == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # real tokenizer vocab; the embedding is padded to `padded_vocab_size`
    context_length: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int = 0  # 0 -> default_d_ff(d_model)
    # key/value heads (1: multi-query); 0 stays 0 and means num_heads, so a replaced num_heads keeps MHA
    num_kv_heads: int = 0
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    # compute dtype of activations and matmul inputs; params, norms, softmax statistics and the loss stay f32
    dtype: str = "float32"
    # storage dtype of params, gradients and moments (MaxText's weight_dtype; bfloat16 keeps no f32 copy)
    weight_dtype: str = "float32"
    # twinshard.model.layers.causal_attention's kernel; "auto": cuDNN on a GPU, splash on a TPU (bf16), else recompute
    attention: str = "auto"
    # the splash kernel's block: a multiple of 128 dividing the padded context_length; 0: splash_block's choice
    attention_block: int = 0
    splash_fused_bwd: bool = True  # splash's backward: one kernel for dq, dk, dv, or (False) dq apart
    # XLA:TPU's scoped VMEM limit in KiB, a compile option of the step (0: the compiler's default)
    xla_tpu_scoped_vmem_limit_kib: int = 0
    # XLA:TPU's async collective fusions, compute beside them (train/xla_options.py); False: its defaults
    async_collectives: bool = True
    # q, k, v through a [B, T, h*dh] layout and transposes ("tokens") or straight in the kernel's [B, h, T, dh] ("heads")
    qkv_layout: str = "tokens"
    # layers per layer-scan iteration: 1 compiles ONE layer; num_layers unrolls (XLA:CPU up to 26% faster, BENCHMARKS.md)
    scan_unroll: int = 1
    # jax.checkpoint policy of the scanned block (twinshard/model/transformer.py REMAT_POLICIES; docs/memory.md)
    remat: str = "none"
    # vocabulary tiling: 0 computes the loss from the whole [B, T, V] logits; n makes each device's
    # logits n chunks at a time (twinshard/model/loss.py); on a TPU pick B*T/n ~ 4-8k tokens per device
    loss_chunks: int = 0
    # the LM head's logits: "float32" arrays, or "compute": the matmul's dtype with float32 statistics
    # (max, log-sum-exp, the target's logit), no float32 [tokens, V] array forward or backward
    logits_dtype: str = "float32"
    # loss_chunks > 0: each chunk's logits recomputed in the backward (True) or saved by the forward
    loss_recompute: bool = True
    # RMSNorm's elementwise work: "float32", or "compute" (the mean of squares accumulated in float32)
    norm_dtype: str = "float32"
    # "int8": the blocks' projections as int8 dots summed in int32, forward and dx; "int8_dw": dW too, its
    # scales maxima over the whole batch (twinshard/model/quantize.py)
    quantization: str = "none"
    # tp_sp's manual twin: each all-gather before a column-parallel matmul as ppermutes overlapped with it
    collective_matmul: bool = False
    # tp, fsdp_tp (auto, manual twins): each dense block runs its batch in this many chunks, so one chunk's
    # Megatron all-reduces over `tensor` can run beside another's matmuls (1: off, one chunk)
    tp_overlap_chunks: int = 1
    # mixture of experts (twinshard/model/moe.py): 0 is dense; E >= 2 routes every layer after
    # the first `first_dense_layers`, which form a second scanned stack (`ModelConfig.stacks`)
    num_experts: int = 0
    first_dense_layers: int = 0  # K: layers 0..K-1 keep the dense SwiGLU of width d_ff; 0 <= K < L
    experts_per_token: int = 2  # k: each token's top-k experts, weights renormalised over the k
    # expert buffer slots per group: C = min(S, ceil(k S capacity_factor / E)); 0: dropless, C = S
    capacity_factor: float = 1.25
    # tokens per capacity group S (0: context_length); divides context_length, so groups never span sequences
    moe_group_size: int = 0
    router_aux_loss: float = 0.01  # Switch load-balancing loss coefficient
    router_z_loss: float = 0.0  # ST-MoE router z-loss coefficient
    expert_d_ff: int = 0  # each expert's SwiGLU width F_e; 0 -> d_ff
    # "dense" capacity buffers and einsums, or "ragged" dropless rows through jax.lax.ragged_dot
    # (manual ep: ragged_all_to_all, accelerators only: XLA:CPU has none)
    moe_dispatch: str = "dense"

    def __post_init__(self):
        check_types(self)
        for name, choices in (("dtype", COMPUTE_DTYPES), ("weight_dtype", WEIGHT_DTYPES),
                              ("attention", ATTENTION_IMPLS), ("remat", REMAT_POLICIES),
                              ("moe_dispatch", MOE_DISPATCHES), ("logits_dtype", PRECISIONS),
                              ("norm_dtype", PRECISIONS), ("qkv_layout", QKV_LAYOUTS),
                              ("quantization", QUANTIZATIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} is not supported; choose one of "
                                 f"{', '.join(choices)}.")
        if self.tp_overlap_chunks < 1:
            raise ValueError(f"ModelConfig.tp_overlap_chunks={self.tp_overlap_chunks} (--tp_overlap_chunks) must be "
                             ">= 1 (1: off; n: each block's batch in n chunks).")
        if self.tp_overlap_chunks > 1 and self.num_experts:
            raise ValueError(f"ModelConfig.tp_overlap_chunks={self.tp_overlap_chunks} (--tp_overlap_chunks) chunks "
                             f"dense blocks only, and num_experts={self.num_experts} routes them: use 1 (off) or 0 experts.")
        if self.loss_chunks < 0:
            raise ValueError(f"ModelConfig.loss_chunks={self.loss_chunks} (--loss_chunks) must be >= 0 (0: the "
                             "loss from whole logits; n: each device's tokens in n chunks).")
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "scan_unroll"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be positive.")
        if self.d_model % self.num_heads:
            raise ValueError(f"ModelConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                             f"choose num_heads from {_divisors(self.d_model)} or change d_model.")
        self._check_kv_heads()
        if self.quantization != "none" and self.qkv_layout == "heads":
            raise ValueError(f"--quantization={self.quantization} quantizes the [tokens, D] projections, which "
                             "--qkv_layout=heads replaces: pass --qkv_layout=tokens, or --quantization=none.")
        if self.attention_block < 0:
            raise ValueError(f"ModelConfig.attention_block={self.attention_block} (--attention_block) must be "
                             f">= 0 (0: automatic).")
        splash_block(self.context_length, self.attention_block)
        if self.xla_tpu_scoped_vmem_limit_kib < 0:
            raise ValueError(f"ModelConfig.xla_tpu_scoped_vmem_limit_kib={self.xla_tpu_scoped_vmem_limit_kib} "
                             "must be >= 0 KiB (0: the compiler's default; 98304 lets splash run blocks of 2048).")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model/num_heads = {self.head_dim} is odd; RoPE rotates pairs of "
                             "features, so pick d_model and num_heads giving an even head_dim.")
        for name in ("rope_theta", "norm_eps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be positive.")
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", default_d_ff(self.d_model))
        elif self.d_ff < 0:
            raise ValueError(f"ModelConfig.d_ff={self.d_ff} must be positive (or 0 for 8/3 d_model).")
        self._check_moe()

    def _check_kv_heads(self) -> None:
        """num_kv_heads: 0 (num_heads) or a divisor of num_heads."""
        h, kv = self.num_heads, self.num_kv_heads
        if kv < 0 or kv and h % kv:
            raise ValueError(
                f"ModelConfig.num_kv_heads={kv} (--num_kv_heads) must divide num_heads={h}: each key/value head "
                f"serves an equal group of query heads; choose --num_kv_heads from {_divisors(h)} "
                "(0: num_heads, multi-head attention; 1: multi-query).")

    def _check_moe(self) -> None:
        e, k = self.num_experts, self.experts_per_token
        if e == 1 or e < 0:
            raise ValueError(f"ModelConfig.num_experts={e}: use 0 for the dense feed-forward or at least 2 "
                             "experts (one expert is the dense block behind a router that always picks it).")
        if e and not 1 <= k <= e:
            raise ValueError(f"ModelConfig.experts_per_token={k} must be in [1, num_experts={e}]; choose "
                             f"k from 1 to {e} (2 is the Mixtral / GShard choice), or more experts.")
        for name, meaning in (("capacity_factor", " (0: dropless, every expert has room for the whole group)"),
                              ("router_aux_loss", " (0: no load-balancing loss)"),
                              ("router_z_loss", " (0: no z-loss)"), ("expert_d_ff", " (0: d_ff)"),
                              ("moe_group_size", " (0: context_length)")):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be >= 0{meaning}.")
        if self.moe_group_size and self.context_length % self.moe_group_size:
            raise ValueError(
                f"ModelConfig.moe_group_size={self.moe_group_size} does not divide context_length="
                f"{self.context_length}, so a capacity group would span two sequences; choose it from "
                f"{_divisors(self.context_length)} (0: the whole sequence).")
        dense = self.first_dense_layers
        if not 0 <= dense < self.num_layers:
            raise ValueError(f"ModelConfig.first_dense_layers={dense} (--first_dense_layers) must be in "
                             f"[0, num_layers={self.num_layers}): at least one layer must be a mixture of experts; "
                             f"choose 0 to {self.num_layers - 1}, or --num_experts=0 --first_dense_layers=0 for a "
                             "dense model.")
        if dense and not e:
            raise ValueError(f"ModelConfig.first_dense_layers={dense} (--first_dense_layers) keeps the first layers "
                             "dense in a mixture of experts, but num_experts=0: add experts (--num_experts=4), or "
                             "pass --first_dense_layers=0.")
        if e and self.moe_dispatch == "ragged" and self.capacity_factor != 0:
            raise ValueError(
                f"ModelConfig.moe_dispatch='ragged' (--moe_dispatch=ragged) is dropless: it runs every token at "
                f"each of its k experts, so it needs capacity_factor=0, not {self.capacity_factor} "
                "(--capacity_factor): pass --capacity_factor=0 with --moe_dispatch=ragged, or use "
                "--moe_dispatch=dense for a capacity that drops tokens.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def splash_block(self) -> int:
        """The splash kernel's block: attention_block, or splash_block's automatic one for this T, head_dim
        and scoped VMEM limit."""
        return splash_block(self.context_length, self.attention_block, self.head_dim,
                            self.xla_tpu_scoped_vmem_limit_kib)

    @property
    def kv_heads(self) -> int:
        """Hkv: the key/value heads (num_kv_heads, or num_heads where it is 0)."""
        return self.num_kv_heads or self.num_heads

    @property
    def kv_dim(self) -> int:
        """Hkv * head_dim: the width of the key and value projections (d_model without GQA)."""
        return self.kv_heads * self.head_dim

    @property
    def padded_vocab_size(self) -> int:
        return _round_up(self.vocab_size, VOCAB_MULTIPLE)

    @property
    def moe_group(self) -> int:
        """S: tokens per capacity group (moe_group_size, or the whole sequence)."""
        return self.moe_group_size or self.context_length

    @property
    def expert_ff(self) -> int:
        """F_e: each expert's SwiGLU width (expert_d_ff, or d_ff)."""
        return self.expert_d_ff or self.d_ff

    @property
    def expert_capacity(self) -> int:
        """C: buffer slots per expert per group, min(S, ceil(k S capacity_factor / E)); S when dropless, 0 when dense."""
        e, k, s = self.num_experts, self.experts_per_token, self.moe_group
        if not e:
            return 0
        if self.capacity_factor == 0:
            return s
        # rounded to 9 places first, so 1.1 * 40 = 44.00000000000001 slots is 44, not 45
        return min(s, max(1, math.ceil(round(k * s * self.capacity_factor / e, 9))))

    @property
    def moe_layers(self) -> int:
        """Layers whose feed-forward is a mixture of experts: L - first_dense_layers (0: dense)."""
        return self.num_layers - self.first_dense_layers if self.num_experts else 0

    @property
    def stacks(self) -> tuple[tuple[str, "ModelConfig"], ...]:
        """The scanned stacks of identical layers in run order, as (parameter name, the config of one
        stack whose num_layers is its depth): ("layers",) alone, or ("dense_layers", "layers") when
        first_dense_layers > 0; a dense stack's config has num_experts 0."""
        k = self.first_dense_layers
        if not k:
            return (("layers", self),)
        dense = dataclasses.replace(self, num_layers=k, num_experts=0, first_dense_layers=0)
        return (("dense_layers", dense), ("layers", dataclasses.replace(self, num_layers=self.num_layers - k,
                                                                        first_dense_layers=0)))

    def num_params(self, padded: bool = True) -> int:
        """Exact parameter count of `TransformerLM`: N = 2 V D + L (2 D^2 + 2 D Hkv dh + 3 D F + 2 D) + D,
        with D E + 3 E D F_e in place of 3 D F in the MoE layers."""
        v = self.padded_vocab_size if padded else self.vocab_size
        d, f, e = self.d_model, self.d_ff, self.num_experts
        per_layer = 2 * d * d + 2 * d * self.kv_dim + 2 * d  # attention and the two norm gains
        moe = d * e + e * 3 * d * self.expert_ff  # router + E SwiGLUs
        dense_ffn = (self.num_layers - self.moe_layers) * 3 * d * f
        return 2 * v * d + self.num_layers * per_layer + dense_ffn + self.moe_layers * moe + d


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 8  # global batch, in sequences
    steps: int = 100
    lr: float = 1e-3  # peak learning rate (alpha_max)
    min_lr: float = 1e-4  # alpha_min, reached at `steps` (cosine end)
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping
    skip_nonfinite: bool = True  # skip (and count) updates whose gradient norm is inf/nan
    seed: int = 0
    tokenizer: str = "gpt2"
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 0  # 0: only at the end
    optimizer: str = "adamw"  # one of OPTIMIZERS (twinshard.train.optim.make_optimizer)
    grad_accum: int = 1  # micro-batches per step (gradients accumulated under lax.scan)
    grad_accum_dtype: str = "float32"  # their sum: float32, or weight (each param's own dtype)
    microbatches: int = 1  # pipeline strategies: micro-batches in flight per step (twinshard/parallel/pipeline.py)
    schedule: str = "gpipe"  # pipeline schedule: gpipe, 1f1b, interleaved, zb_h1 (twinshard/parallel/support.py: which twin)
    virtual_stages: int = 1  # interleaved: chunks of L/(S V) layers per stage, placed round-robin
    # context parallelism (cp, fsdp_cp): which sequence positions each `context` shard holds
    cp_layout: str = "zigzag"

    def __post_init__(self):
        check_types(self)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"TrainConfig.optimizer={self.optimizer!r} is not supported; choose one of "
                             f"{', '.join(OPTIMIZERS)}.")
        if self.grad_accum < 1:
            raise ValueError(f"TrainConfig.grad_accum={self.grad_accum} must be >= 1 (1: no accumulation).")
        if self.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
            raise ValueError(f"TrainConfig.grad_accum_dtype={self.grad_accum_dtype!r} is not a gradient-sum dtype; "
                             f"choose one of {', '.join(GRAD_ACCUM_DTYPES)}.")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"TrainConfig.schedule={self.schedule!r} is not a pipeline schedule; choose one of "
                             f"{', '.join(PIPELINE_SCHEDULES)}.")
        if self.virtual_stages < 1:
            raise ValueError(f"TrainConfig.virtual_stages={self.virtual_stages} must be >= 1 (1: a stage is one chunk).")
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"TrainConfig.cp_layout={self.cp_layout!r} is not a context-parallel layout; choose "
                             f"one of {', '.join(CP_LAYOUTS)}.")
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ValueError(f"TrainConfig.microbatches={self.microbatches} must be >= 1 and split batch_size="
                             f"{self.batch_size} evenly; choose from {_divisors(self.batch_size)}.")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"TrainConfig.batch_size={self.batch_size} does not split into grad_accum="
                             f"{self.grad_accum} equal micro-batches; choose grad_accum from "
                             f"{_divisors(self.batch_size)}.")
        for name in ("batch_size", "steps", "eval_batches", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be positive.")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ValueError(f"TrainConfig.warmup_steps={self.warmup_steps} must be in [0, steps={self.steps}].")
        if self.lr <= 0:
            raise ValueError(f"TrainConfig.lr={self.lr} must be positive.")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"TrainConfig.min_lr={self.min_lr}: need 0 <= min_lr <= lr ({self.lr}).")
        if self.seed < 0:
            raise ValueError(f"TrainConfig.seed={self.seed} must be >= 0 (numpy's generators take "
                             "non-negative seeds).")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)}: AdamW needs 0 <= {name} < 1.")
        if self.eps <= 0:
            raise ValueError(f"TrainConfig.eps={self.eps}: AdamW needs eps > 0.")
        for name, meaning in (("weight_decay", ""), ("grad_clip", " (0 disables clipping)"),
                              ("eval_every", " (0: never)"), ("checkpoint_every", " (0: only at the end)")):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 0{meaning}.")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    train: TrainConfig

    def __post_init__(self):
        chunks, tokens = self.model.loss_chunks, self.train.batch_size * self.model.context_length
        if chunks and tokens % chunks:  # per device: loss.check_chunks, when the program is traced
            raise ValueError(f"ModelConfig.loss_chunks={chunks} (--loss_chunks) does not divide batch_size x "
                             f"context_length = {tokens} tokens; choose a divisor of {tokens} (0: off).")
        n, micro = self.model.tp_overlap_chunks, self.train.batch_size // self.train.grad_accum
        if micro % n:  # per device: resolve.check_overlap_chunks, on the mesh
            raise ValueError(f"ModelConfig.tp_overlap_chunks={n} (--tp_overlap_chunks) does not divide the {micro} "
                             f"sequences of a micro-batch (batch_size / grad_accum); choose a divisor of {micro} (1: off).")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _maxtext_v5e(d_model: int, num_layers: int, num_heads: int, d_ff: int, per_chip: int) -> Config:
    """One of MaxText's published v5e-256 runs (its dims at commit e47fa1b5d): its D, layers, head_dim 256,
    vocab, sequence and batch (per_chip x 256); q/k/v/o are [D, D] here, so d_ff (SwiGLU) gives a layer
    MaxText's matmul parameters (tools/maxtext_predict.py names every difference). Splash blocks of 512:
    the automatic 1024 overflows the dkv kernel's scoped VMEM at head_dim 256 (16.39M of 16M, v5e)."""
    return Config(ModelConfig(vocab_size=32768, context_length=2048, d_model=d_model, num_layers=num_layers,
                              num_heads=num_heads, d_ff=d_ff, dtype="bfloat16", remat="full", attention_block=512),
                  TrainConfig(batch_size=per_chip * 256, tokenizer="bytes"))

_PRESETS: dict[str, Config] = {
    # Tests: byte-level vocab (257, padded to 384) so padded logits are always exercised.
    "tiny": Config(
        ModelConfig(vocab_size=257, context_length=32, d_model=64, num_layers=2, num_heads=4),
        TrainConfig(batch_size=8, steps=20, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                    tokenizer="bytes", log_every=5, eval_every=10, eval_batches=2),
    ),
    # The CPU demo: a 4096-token BPE trained on the corpus; loss falls within minutes on 2 cores.
    "small": Config(
        ModelConfig(vocab_size=4096, context_length=128, d_model=256, num_layers=4, num_heads=8),
        TrainConfig(batch_size=16, steps=200, lr=3e-3, min_lr=3e-4, warmup_steps=20,
                    tokenizer="shakespeare4096", log_every=10, eval_every=100),
    ),
    # Accelerator presets (GPT-2-like shapes, r50k vocab 50257 -> 50304 padded).
    "gpt2_125m": Config(
        ModelConfig(vocab_size=50257, context_length=1024, d_model=768, num_layers=12, num_heads=12),
        TrainConfig(batch_size=64, steps=5000, lr=6e-4, min_lr=6e-5, warmup_steps=200,
                    tokenizer="gpt2", log_every=10, eval_every=500),
    ),
    "gpt2_350m": Config(
        ModelConfig(vocab_size=50257, context_length=1024, d_model=1024, num_layers=24, num_heads=16),
        TrainConfig(batch_size=64, steps=5000, lr=3e-4, min_lr=3e-5, warmup_steps=200,
                    tokenizer="gpt2", log_every=10, eval_every=500),
    ),
    "llm_1b": Config(
        ModelConfig(vocab_size=50257, context_length=2048, d_model=2048, num_layers=20, num_heads=16),
        TrainConfig(batch_size=64, steps=5000, lr=2e-4, min_lr=2e-5, warmup_steps=500,
                    tokenizer="gpt2", log_every=10, eval_every=500),
    ),
    # Mixture of experts at the tiny shapes: 4 experts, top-2, each as wide as tiny's d_ff.
    "tiny_moe": Config(
        ModelConfig(vocab_size=257, context_length=32, d_model=64, num_layers=2, num_heads=4,
                    num_experts=4, experts_per_token=2),
        TrainConfig(batch_size=8, steps=20, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                    tokenizer="bytes", log_every=5, eval_every=10, eval_batches=2),
    ),
    # Mixtral 8x7B's shapes for launch.plan, from huggingface.co/mistralai/Mixtral-8x7B-v0.1's
    # config.json (46.7B = num_params; context 4096 of 32768; "bytes" a placeholder vocabulary)
    "mixtral_8x7b": Config(
        ModelConfig(vocab_size=32000, context_length=4096, d_model=4096, num_layers=32, num_heads=32,
                    num_kv_heads=8, d_ff=14336, rope_theta=1e6, norm_eps=1e-5, dtype="bfloat16",
                    num_experts=8, experts_per_token=2, capacity_factor=1.25, expert_d_ff=14336),
        TrainConfig(batch_size=64, steps=5000, lr=2e-4, min_lr=2e-5, warmup_steps=500,
                    tokenizer="bytes", log_every=10, eval_every=500),
    ),
    # Llama 3's published shapes for launch.plan, from the config.json of huggingface.co/meta-llama/
    # Meta-Llama-3-8B and -70B (8.03B, 70.6B = num_params); RoPE here rotates interleaved pairs
    # (Meta's checkpoints rotate halves) and "bytes" is a placeholder vocabulary.
    # Llama-shaped for ONE TPU v5e (15.75 GiB) at batch 2 x 2048, remat full, bf16: 13.7 GiB per chip
    # by the cost model (batch 4 is 15.5 GiB, too close). Not yet measured on a TPU.
    "llama_v5e": Config(
        ModelConfig(vocab_size=32768, context_length=2048, d_model=2048, num_layers=14, num_heads=16,
                    num_kv_heads=4, d_ff=5632, rope_theta=500_000.0, norm_eps=1e-5, dtype="bfloat16", remat="full"),
        TrainConfig(batch_size=2, steps=5000, lr=3e-4, min_lr=3e-5, warmup_steps=200,
                    tokenizer="bytes", log_every=10, eval_every=500),
    ),
    "llama3_8b": Config(
        ModelConfig(vocab_size=128256, context_length=8192, d_model=4096, num_layers=32, num_heads=32,
                    num_kv_heads=8, d_ff=14336, rope_theta=500_000.0, norm_eps=1e-5, dtype="bfloat16"),
        TrainConfig(batch_size=64, steps=5000, lr=2e-4, min_lr=2e-5, warmup_steps=500,
                    tokenizer="bytes", log_every=10, eval_every=500),
    ),
    "llama3_70b": Config(
        ModelConfig(vocab_size=128256, context_length=8192, d_model=8192, num_layers=80, num_heads=64,
                    num_kv_heads=8, d_ff=28672, rope_theta=500_000.0, norm_eps=1e-5, dtype="bfloat16"),
        TrainConfig(batch_size=64, steps=5000, lr=2e-4, min_lr=2e-5, warmup_steps=500,
                    tokenizer="bytes", log_every=10, eval_every=500),
    ),
    # MaxText's published v5e-256 configurations as this model spells them (_maxtext_v5e; BENCHMARKS.md)
    "maxtext_v5e_16b": _maxtext_v5e(5120, 32, 20, 25920, 6),  # MaxText: 32 heads x 256, relu MLP 32768
    "maxtext_v5e_32b": _maxtext_v5e(10240, 32, 40, 19136, 4),  # 32 heads x 256, relu MLP 32768
    "maxtext_v5e_64b": _maxtext_v5e(10240, 64, 40, 19136, 2),  # 32 heads x 256, relu MLP 32768
    # 80 heads x 128 (the same [D, D] projections): the heads split over MaxText's tensor 16, which 40 do not
    "maxtext_v5e_128b": _maxtext_v5e(10240, 64, 80, 51904, 1),  # 64 heads x 256, relu MLP 65536
}

PRESETS: tuple[str, ...] = tuple(_PRESETS)


def preset(name: str) -> Config:
    """The named preset (configs are frozen, so sharing the instance is safe)."""
    try:
        return _PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}.") from None
