"""The fast path: what a run does on a TPU unless a flag says otherwise, chosen in ONE place.

`choose(platform, device_kind, cfg, preset, given, strategy)` is a pure function: from the hardware, the
model's shape and the preset, and the flags the user gave (name -> value), it returns each option it sets
with the reason, the config they make, and one line for each given flag that contradicts a choice (the
flag wins). `launch.train` and `launch.bench` log its lines at start:

    fast path on tpu v5e: dtype=bfloat16 (the MXU's dtype ...); logits_dtype=compute (...); ...

What it chooses is what tools/tpu_bench.sh measured best on one v5e (jax 0.10.2, 2026-12-06;
BENCHMARKS.md, "TPU (one v5e)"); off a TPU it chooses nothing, so CPU runs keep today's numerics.
The numerics options (dtype, weight_dtype, logits_dtype, norm_dtype) hold for every strategy; those of
one chip's program (qkv_layout, scan_unroll, remat, micro-batching) for `single`, where they were measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from twinshard.config import Config, rope_on_halves
from twinshard.splash_blocks import SCOPED_VMEM_KIB, splash_fitting, splash_vmem_bytes

# A micro-batch of this many tokens ran fastest at every measured shape with T >= 1024: llama_v5e 4 x 2048 (73.6% MFU
# against 68.2 at 2), the 160M shape 4 x 2048 (161.2k tokens/s against 155.8k at 2, 158.5k at 8, 148.3k at 16),
# gpt2_350m 8 x 1024; so a shape given by flags runs micro-batches of the largest split of its batch up to this.
MICRO_BATCH_TOKENS = 8192
# remat none where the memory model (twinshard.cost.memory, within 0.9-1.6x of XLA's figure) puts the step under
# this share of the chip's HBM (the model's 5,081 MiB stood beside XLA's 4,701 at the 160M shape, 4 sequences a
# micro-batch; launch.bench's "mem/dev" column).
HBM_SHARE = 0.8

# The deepest stack unrolled on the chip: gpt2_350m's 24 layers compiled in 73 s (12 layers 41 s, 14 49 s).
UNROLL_MAX_LAYERS = 24


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str  # a ModelConfig or TrainConfig field, and the launchers' flag of that name
    value: Any
    why: str


@dataclasses.dataclass(frozen=True)
class FastPath:
    where: str  # "tpu v5e", "cpu", ...
    choices: tuple[Choice, ...]  # applied (none where a flag was given for that field)
    overruled: tuple[str, ...]  # one line per given flag that contradicts a choice: the flag wins
    cfg: Config  # the config with the choices applied

    def lines(self) -> list[str]:
        """What the launchers print at start (nothing where nothing was chosen or overruled)."""
        head = ([f"fast path on {self.where}: " + "; ".join(f"{c.name}={c.value} ({c.why})" for c in self.choices)]
                if self.choices else [])
        return head + list(self.overruled)


# Each preset's measured batch on one v5e, for its own shape (no shape flag): (remat, sequences per
# micro-batch, the batch where the preset's is not the best, why).
_V5E_BATCHES: dict[str, tuple[str, int, int | None, str]] = {
    "gpt2_125m": ("none", 16, None, "16 sequences a micro-batch: 123,781 tokens/s; 24 and 32 no faster"),
    "gpt2_350m": ("none", 8, None, "no remat in micro-batches of 8: 367.9 ms for 16 sequences against 439.8 "
                  "with remat in one batch (XLA rematerializes the logits of a full chip)"),
    "llama_v5e": ("none", 4, 4, "no remat, 4 sequences: 73.6% MFU against 68.2% in the preset's 2 "
                  "(AdamW's 16 ms over twice the tokens)"),
}


def _numerics(cfg: Config) -> list[Choice]:
    """dtype, weight_dtype, logits_dtype, norm_dtype: every strategy."""
    m, out = cfg.model, []
    if m.dtype == "float32":
        out.append(Choice("dtype", "bfloat16", "the MXU's dtype: float32 matmuls take several passes, "
                          "activations twice the bytes"))
    out += [Choice("weight_dtype", "bfloat16", "half the bytes of params, gradients and AdamW moments; trains "
                   "within tests/test_weight_dtype.py's band of float32"),
            Choice("logits_dtype", "compute", "no float32 [tokens, V] logits: -4.3% a step on gpt2_125m"),
            Choice("norm_dtype", "compute", "RMSNorm in bf16, its mean of squares in float32: -4.4% on gpt2_125m")]
    return out


def _one_chip(cfg: Config, preset: str, given: Mapping[str, Any], shape_given: bool,
              on_v5e: bool) -> list[Choice]:
    """qkv_layout, scan_unroll, remat and micro-batching of a single-device run."""
    m, t, out = cfg.model, cfg.train, []
    if m.quantization == "none":  # the heads layout's einsums are not quantized (ModelConfig refuses the pair)
        halves = "; q and k on RoPE halves at this head_dim: -3.8% at the 160M shape" if rope_on_halves(m.head_dim) else ""
        out.append(Choice("qkv_layout", "heads", "q, k, v einsummed into the splash kernel's [B, h, T, dh]: with the two "
                          f"bf16 options -7.6% on gpt2_125m, -5.1% on llama_v5e{halves}"))
    if m.scan_unroll == 1 and m.num_layers > 1:
        if m.num_layers <= UNROLL_MAX_LAYERS:
            out.append(Choice("scan_unroll", m.num_layers, f"the {m.num_layers} layers unrolled: -10.5% on "
                              "gpt2_125m, -7.4% llama_v5e, -1.9% gpt2_350m; compiles 41-73 s for 12-24 layers; with "
                              "micro-batches their gradient summed layer by layer: -1.4% at the 160M shape"))
    measured = _V5E_BATCHES.get(preset) if on_v5e and not shape_given else None
    if measured is None:
        return out + (_shape_batch(cfg, given) if on_v5e else [])
    remat, micro, best, why = measured
    batch = t.batch_size if "batch_size" in given else best or t.batch_size  # a given batch is split, not changed
    accum = batch // micro if batch > micro and batch % micro == 0 and "grad_accum" not in given else t.grad_accum
    if batch // accum <= micro:  # remat none was measured at micro-batches up to this size
        out.append(Choice("remat", remat, why))
    out += [Choice("batch_size", best, why)] if best else []
    out.append(Choice("grad_accum", accum, why))
    return out


def _accum_sum(cfg: Config) -> list[Choice]:
    """grad_accum_dtype=weight where bf16 weights are summed over several micro-batches."""
    if cfg.train.grad_accum == 1 or cfg.model.weight_dtype != "bfloat16":
        return []
    return [Choice("grad_accum_dtype", "weight", "the micro-batch gradients summed in bf16, their weights' "
                   "dtype: 795.2 ms against 812.3 with a float32 sum at the 160M shape's 16 micro-batches")]


def _shape_batch(cfg: Config, given: Mapping[str, Any]) -> list[Choice]:
    """remat and micro-batching of a shape no preset measured: micro-batches of the largest divisor of the
    batch up to MICRO_BATCH_TOKENS tokens, without remat where the memory model fits them in HBM_SHARE of a v5e."""
    from twinshard.cost.memory import memory
    from twinshard.cost.weights import DTYPE_BYTES
    from twinshard.hardware.chips import chip

    m, t = cfg.model, cfg.train
    accum = t.grad_accum
    if "grad_accum" not in given:
        micro = max((n for n in range(1, t.batch_size + 1) if t.batch_size % n == 0
                     and n * m.context_length <= MICRO_BATCH_TOKENS), default=1)
        accum = t.batch_size // micro
    weight_bytes = DTYPE_BYTES[m.weight_dtype]
    need = memory(m, "single", {}, t.batch_size, m.context_length, dtype_bytes=DTYPE_BYTES[m.dtype],
                  grad_accum=accum, remat="none", param_bytes=weight_bytes, state_bytes=weight_bytes, tpu=True).total
    hbm = chip("v5e").hbm_bytes
    split = f"{t.batch_size // accum} sequences of {m.context_length} a micro-batch"
    out = [Choice("grad_accum", accum, f"{split}: micro-batches of up to {MICRO_BATCH_TOKENS} tokens ran fastest "
                  "(the 160M shape: 161.2k tokens/s at 4 x 2048 against 155.8k at 2, 158.5k at 8)")]
    if need <= HBM_SHARE * hbm:
        out.append(Choice("remat", "none", f"{split} without remat: {need / 2**30:.1f} GiB by the memory model, "
                          f"under {HBM_SHARE:.0%} of the chip's {hbm / 2**30:g} GiB"))
    return out


def _chip_name(device_kind: str | None) -> str | None:
    from twinshard.hardware.chips import chip_for

    chip = chip_for(device_kind) if device_kind else None
    return chip.name if chip else None


def choose(platform: str, device_kind: str | None, cfg: Config, preset: str, given: Mapping[str, Any],
           strategy: str = "single", shape_given: bool = False) -> FastPath:
    """The fast path of `cfg` (the preset with the given flags applied) on `platform` ('tpu', 'cpu', 'gpu')
    and `device_kind` (jax's, e.g. 'TPU v5 lite'). `given`: the flags the user set, name -> value (each
    wins over a choice of its name); `shape_given`: a shape flag changed the preset's model, so its
    measured batch does not apply. Off a TPU: no choice, `cfg` unchanged."""
    chip = _chip_name(device_kind)
    where = f"{platform} {chip}" if chip else platform
    if platform != "tpu":
        return FastPath(where, (), (), cfg)
    candidates = _numerics(cfg)
    if given.get("dtype", "bfloat16") != "bfloat16":  # float32 given: the bf16 options do not apply
        candidates = [c for c in candidates if c.name not in ("weight_dtype", "logits_dtype", "norm_dtype")]
    if strategy == "single":  # judged with the numerics it will run (the memory model's bytes: _shape_batch)
        numeric = apply(cfg, [c for c in candidates if c.name not in given])
        candidates += _one_chip(numeric, preset, given, shape_given, chip == "v5e")
        candidates += _accum_sum(apply(cfg, [c for c in candidates if c.name not in given]))
    current = {**dataclasses.asdict(cfg.model), **dataclasses.asdict(cfg.train)}
    choices, overruled = [], []
    for c in candidates:
        if c.name not in given:
            if c.value != current[c.name]:  # a choice that changes nothing is not listed
                choices.append(c)
        elif given[c.name] != c.value:
            overruled.append(f"--{c.name}={given[c.name]} wins over the fast path's {c.name}={c.value} ({c.why}).")
    cfg = apply(cfg, choices)
    return FastPath(where, tuple(choices), tuple(overruled + _block_over_vmem(cfg.model, given)), cfg)


def _block_over_vmem(m, given: Mapping[str, Any]) -> list[str]:
    """One line where --attention_block was given over the scoped VMEM by splash_vmem_bytes: the flag is kept,
    the line names the largest block that fits (XLA:TPU refuses a block over it, measured at 16.39-21.84M)."""
    block = given.get("attention_block")
    if not block or splash_vmem_bytes(block, m.head_dim) <= (limit := 1024 * (m.xla_tpu_scoped_vmem_limit_kib
                                                                                or SCOPED_VMEM_KIB)):
        return []
    fitting = splash_fitting(m.context_length, m.head_dim, m.xla_tpu_scoped_vmem_limit_kib)
    largest = f"--attention_block={max(fitting)}" if fitting else "no block"
    return [f"--attention_block={block} at head_dim {m.head_dim} needs ~{splash_vmem_bytes(block, m.head_dim) / 2**20:.1f} "
            f"MiB of scoped VMEM by twinshard.splash_blocks.splash_vmem_bytes, over the chip's {limit / 2**20:g} MiB: the largest "
            f"block that fits is {largest} (the flag is kept; XLA may refuse to compile it)."]


def apply(cfg: Config, choices) -> Config:
    """`cfg` with each choice set on the ModelConfig or TrainConfig field of its name."""
    model_fields = {f.name for f in dataclasses.fields(cfg.model)}
    model = {c.name: c.value for c in choices if c.name in model_fields}
    train = {c.name: c.value for c in choices if c.name not in model_fields}
    return Config(dataclasses.replace(cfg.model, **model), dataclasses.replace(cfg.train, **train))
