"""The fast path (twinshard/hardware/fast_path.py): what a run does on a TPU unless a flag says otherwise,
tested as the pure function it is (platform 'tpu' given by hand: no chip here), and the splash block that
fits the chip's scoped VMEM at every head_dim (twinshard.splash_blocks.splash_block, splash_vmem_bytes)."""

import dataclasses

import pytest

from twinshard.config import PRESETS, ModelConfig, preset, rope_on_halves
from twinshard.splash_blocks import splash_block, splash_fitting, splash_vmem_bytes
from twinshard.hardware import fast_path

V5E = ("tpu", "TPU v5 lite")  # jax's device_kind of a v5e
MiB = 2 ** 20
BF16_NUMERICS = {"weight_dtype": "bfloat16", "logits_dtype": "compute", "norm_dtype": "compute"}


def chosen(name: str, given: dict | None = None, where=V5E, strategy: str = "single", **kw) -> dict:
    """name -> value of every option the fast path sets for preset `name` with the `given` flags applied."""
    return {c.name: c.value for c in path(name, given, where, strategy, **kw).choices}


def path(name: str, given: dict | None = None, where=V5E, strategy: str = "single", shape_given: bool = False):
    given = given or {}
    cfg = preset(name)
    model = {k: v for k, v in given.items() if k in {f.name for f in dataclasses.fields(ModelConfig)}}
    train = {k: v for k, v in given.items() if k not in model}
    cfg = type(cfg)(dataclasses.replace(cfg.model, **model), dataclasses.replace(cfg.train, **train))
    return fast_path.choose(*where, cfg, name, given, strategy, shape_given)


# What tools/tpu_bench.sh ran each preset with (BENCHMARKS.md, "TPU (one v5e)"), at the preset's batch
TPU_BENCH = {
    "gpt2_125m": {"dtype": "bfloat16", **BF16_NUMERICS, "qkv_layout": "heads", "scan_unroll": 12,
                  "grad_accum": 4, "grad_accum_dtype": "weight"},  # 64 sequences as 4 micro-batches of 16
    "gpt2_350m": {"dtype": "bfloat16", **BF16_NUMERICS, "qkv_layout": "heads", "scan_unroll": 24,
                  "grad_accum": 8, "grad_accum_dtype": "weight"},  # the preset's remat is none already; micro-batches of 8
    "llama_v5e": {**BF16_NUMERICS, "qkv_layout": "heads", "scan_unroll": 14, "remat": "none", "batch_size": 4},
}


@pytest.mark.parametrize("name", TPU_BENCH)
def test_each_preset_on_a_v5e_gets_what_tpu_bench_measured_best(name):
    assert chosen(name) == TPU_BENCH[name]


def test_the_gradient_sum_is_bf16_only_where_bf16_weights_are_summed_over_micro_batches():
    assert "grad_accum_dtype" not in chosen("llama_v5e")  # 4 sequences: one micro-batch, nothing to sum
    assert chosen("llama_v5e", {"batch_size": 8})["grad_accum_dtype"] == "weight"  # 2 micro-batches of 4
    assert "grad_accum_dtype" not in chosen("gpt2_125m", {"weight_dtype": "float32"})  # float32 weights: float32 sums
    assert "grad_accum_dtype" not in chosen("gpt2_125m", {"grad_accum": 1})
    assert chosen("gpt2_125m", {"grad_accum": 2})["grad_accum_dtype"] == "weight"
    flagged = path("gpt2_125m", {"grad_accum_dtype": "float32"})  # the flag wins, and says so
    assert flagged.cfg.train.grad_accum_dtype == "float32"
    assert any(line.startswith("--grad_accum_dtype=float32 wins") for line in flagged.overruled)
    assert "grad_accum_dtype" not in chosen("gpt2_125m", strategy="fsdp")  # one chip's option


def test_a_given_batch_is_split_into_the_measured_micro_batch_not_changed():
    assert chosen("gpt2_125m", {"batch_size": 16}).get("grad_accum") is None  # 16 is one micro-batch
    assert chosen("gpt2_350m", {"batch_size": 16})["grad_accum"] == 2  # 2 micro-batches of 8
    got = chosen("llama_v5e", {"batch_size": 8})
    assert "batch_size" not in got and got["grad_accum"] == 2 and got["remat"] == "none"
    # 6 sequences do not split into 4s: no remat was measured at a micro-batch of 6, the preset's full stays
    assert "remat" not in chosen("llama_v5e", {"batch_size": 6})


@pytest.mark.parametrize("name", PRESETS)
def test_off_a_tpu_nothing_changes(name):
    for where in (("cpu", "cpu"), ("gpu", "NVIDIA H100 80GB HBM3")):
        got = path(name, where=where)
        assert got.choices == () and got.lines() == [] and got.cfg == preset(name)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_on_a_tpu_builds_a_valid_config_with_a_reason_per_choice(name):
    got = path(name)
    assert got.choices and all(c.why for c in got.choices)
    assert got.lines()[0].startswith("fast path on tpu v5e: ") and "\n" not in got.lines()[0]
    for c in got.choices:
        assert f"{c.name}={c.value} (" in got.lines()[0]
        assert getattr(got.cfg.model, c.name, None) == c.value or getattr(got.cfg.train, c.name) == c.value


def test_a_given_flag_wins_and_says_so_in_one_line():
    got = path("gpt2_125m", {"logits_dtype": "float32", "qkv_layout": "heads"})
    assert got.cfg.model.logits_dtype == "float32" and got.cfg.model.norm_dtype == "compute"
    assert got.overruled == ("--logits_dtype=float32 wins over the fast path's logits_dtype=compute (no float32 "
                             "[tokens, V] logits: -4.3% a step on gpt2_125m).",)  # heads agrees: no line
    # float32 compute given: the bf16 options do not apply, and nothing else says they were overruled
    got = path("gpt2_125m", {"dtype": "float32"})
    assert got.cfg.model.dtype == "float32" and got.cfg.model.weight_dtype == "float32"
    assert [line.split(" wins")[0] for line in got.overruled] == ["--dtype=float32"]
    assert got.cfg.model.scan_unroll == 12  # the program's options stay
    got = path("llama_v5e", {"remat": "full", "batch_size": 2})
    assert (got.cfg.model.remat, got.cfg.train.batch_size) == ("full", 2) and len(got.overruled) == 2


def test_what_was_measured_on_one_chip_stays_off_a_mesh_and_off_other_shapes():
    assert chosen("gpt2_125m", strategy="fsdp") == {"dtype": "bfloat16", **BF16_NUMERICS}
    got = chosen("llama_v5e", shape_given=True)  # a shape flag: the preset's measured batch is not this model's,
    assert "batch_size" not in got and got["qkv_layout"] == "heads"  # the shape rule splits the preset's own
    got = chosen("llama_v5e", where=("tpu", "TPU v5p"))  # measured on a v5e's 16 GiB
    assert "remat" not in got and "batch_size" not in got


# BENCHMARKS.md's 160M shape (the public single-file trainer's), given by flags over llama_v5e
S160 = dict(vocab_size=32768, d_model=1024, num_layers=8, num_heads=4, num_kv_heads=1, d_ff=3072, context_length=2048)


def test_a_shape_given_by_flags_runs_the_measured_micro_batch_without_remat_where_it_fits():
    got = path("llama_v5e", {**S160, "batch_size": 64}, shape_given=True)
    # 64 sequences as 16 micro-batches of 4 x 2048 = MICRO_BATCH_TOKENS, no remat: the shape's measured best
    assert got.cfg.train.grad_accum == 16 and got.cfg.model.remat == "none" and got.cfg.train.batch_size == 64
    assert "5.0 GiB by the memory model" in got.lines()[0]  # the 5,081 MiB launch.bench's model column gave
    # the micro-batch is the largest divisor of the batch within MICRO_BATCH_TOKENS, at every sequence length
    for t, batch, accum in ((1024, 64, 8), (4096, 8, 4), (8192, 4, 4), (2048, 6, 2), (2048, 3, 1), (16384, 2, 2)):
        got = path("llama_v5e", {**S160, "context_length": t, "batch_size": batch}, shape_given=True)
        assert got.cfg.train.grad_accum == accum, (t, batch)
    # a given split wins; remat is still judged at that split
    got = path("llama_v5e", {**S160, "batch_size": 64, "grad_accum": 8}, shape_given=True)
    assert got.cfg.train.grad_accum == 8 and got.cfg.model.remat == "none"  # 8 x 2048 (XLA's 7,105 MiB) fits
    got = path("llama_v5e", {**S160, "batch_size": 64, "grad_accum": 1}, shape_given=True)
    assert got.cfg.train.grad_accum == 1 and got.cfg.model.remat == "full"  # 64 x 2048 without remat would not


def test_a_shape_the_memory_model_puts_over_the_chip_keeps_its_remat():
    from twinshard.cost.memory import memory
    from twinshard.hardware.chips import chip

    big = {**S160, "d_model": 4096, "num_layers": 16, "d_ff": 14336, "num_heads": 32, "batch_size": 8}
    got = path("llama_v5e", big, shape_given=True)
    assert got.cfg.model.remat == preset("llama_v5e").model.remat != "none"
    m = got.cfg.model
    need = memory(m, "single", {}, 8, 2048, dtype_bytes=2, grad_accum=got.cfg.train.grad_accum, remat="none",
                  param_bytes=2, state_bytes=2, tpu=True).total
    assert need > fast_path.HBM_SHARE * chip("v5e").hbm_bytes  # the reason, recomputed
    # float32 weights given: 4 bytes a parameter and moment, so a shape that fits in bf16 may not
    small = {**S160, "batch_size": 64}
    assert path("llama_v5e", small, shape_given=True).cfg.model.remat == "none"
    line = path("llama_v5e", {**small, "weight_dtype": "float32"}, shape_given=True).lines()[0]
    assert "remat=none" not in line or "GiB by the memory model" in line
    off_v5e = path("llama_v5e", small, where=("tpu", "TPU v5p"), shape_given=True).cfg
    assert off_v5e.model.remat != "none" and off_v5e.train.grad_accum == 1  # measured on a v5e only


# ----------------------------------------------------------------------------- every threshold at its edge

def modelled(cfg) -> int:
    """The memory model's bytes of `cfg`'s single-chip step without remat, in the numerics it runs (what the
    fast path compares with HBM_SHARE of the chip)."""
    from twinshard.cost.memory import memory
    from twinshard.cost.weights import DTYPE_BYTES

    m, t, w = cfg.model, cfg.train, DTYPE_BYTES[cfg.model.weight_dtype]
    return memory(m, "single", {}, t.batch_size, m.context_length, dtype_bytes=DTYPE_BYTES[m.dtype],
                  grad_accum=t.grad_accum, remat="none", param_bytes=w, state_bytes=w, tpu=True).total


def test_remat_none_exactly_up_to_the_hbm_share_of_the_chip():
    """The 160M shape at 8 x 2048 in one micro-batch, d_ff grown in steps of 64 until the memory model crosses
    HBM_SHARE of a v5e: the last d_ff under the share runs without remat, the first over it keeps the preset's
    remat, though it is well under the whole chip's HBM."""
    from twinshard.hardware.chips import chip

    hbm = chip("v5e").hbm_bytes
    share = fast_path.HBM_SHARE * hbm

    def run(step: int):
        return path("llama_v5e", {**S160, "d_ff": 64 * step, "batch_size": 8, "grad_accum": 1}, shape_given=True)

    under, over = 48, 1024  # d_ff 3072 (the shape's) fits, 65536 does not
    assert modelled(run(under).cfg) <= share < modelled(run(over).cfg)
    while over - under > 1:
        mid = (under + over) // 2
        under, over = (mid, over) if modelled(run(mid).cfg) <= share else (under, mid)
    fits, too_big = run(under), run(over)
    assert fits.cfg.model.remat == "none" and f"under {fast_path.HBM_SHARE:.0%} of the chip's" in fits.lines()[0]
    assert too_big.cfg.model.remat == preset("llama_v5e").model.remat != "none"
    assert share < modelled(too_big.cfg) < 0.9 * hbm  # just over the share, far from the whole chip


@pytest.mark.parametrize("given, batch, accum, remat", [
    ({}, 4, 1, "none"),  # the measured batch: one micro-batch of 4
    ({"batch_size": 3}, 3, 1, "none"), ({"batch_size": 4}, 4, 1, "none"),  # up to one micro-batch: no split
    ({"batch_size": 5}, 5, 1, "full"),  # 5 does not split into 4s: a micro-batch of 5 was not measured
    ({"batch_size": 8}, 8, 2, "none"), ({"batch_size": 12}, 12, 3, "none"),
    ({"batch_size": 8, "grad_accum": 1}, 8, 1, "full"),  # a given split wins; remat judged at that split
    ({"batch_size": 8, "grad_accum": 4}, 8, 4, "none")])
def test_the_measured_batch_splits_into_its_micro_batch_and_drops_remat_only_up_to_it(given, batch, accum, remat):
    """llama_v5e measured best at micro-batches of 4 without remat (its preset: 2 sequences, remat full)."""
    got = path("llama_v5e", given).cfg
    assert (got.train.batch_size, got.train.grad_accum, got.model.remat) == (batch, accum, remat)


@pytest.mark.parametrize("layers, unroll", [(1, None), (2, 2), (fast_path.UNROLL_MAX_LAYERS, fast_path.UNROLL_MAX_LAYERS),
                                            (fast_path.UNROLL_MAX_LAYERS + 1, None)])
def test_the_stack_is_unrolled_up_to_the_deepest_measured(layers, unroll):
    assert chosen("llama_v5e", {"num_layers": layers}, shape_given=True).get("scan_unroll") == unroll


def test_a_block_at_the_scoped_vmem_limit_fits_and_one_kib_less_does_not():
    """--attention_block=1024 at head_dim 256 needs 18,176 KiB by splash_vmem_bytes: no line under a limit of
    exactly that, one line naming the largest fitting block a KiB below it."""
    shape = {"d_model": 1024, "num_heads": 4, "num_kv_heads": 1, "d_ff": 3072, "attention_block": 1024}
    kib = splash_vmem_bytes(1024, 256) // 1024
    assert kib * 1024 == splash_vmem_bytes(1024, 256)
    at = path("llama_v5e", {**shape, "xla_tpu_scoped_vmem_limit_kib": kib}, shape_given=True).overruled
    assert not [x for x in at if "attention_block" in x]
    (line,) = [x for x in path("llama_v5e", {**shape, "xla_tpu_scoped_vmem_limit_kib": kib - 1},
                               shape_given=True).overruled if "attention_block" in x]
    assert "the largest block that fits is --attention_block=512" in line


def test_int8_keeps_the_tokens_layout_and_deep_stacks_stay_scanned():
    assert "qkv_layout" not in chosen("llama_v5e", {"quantization": "int8_dw"})
    assert "scan_unroll" not in chosen("llama3_8b")  # 32 layers: past the 24 measured to compile in 73 s
    assert chosen("llm_1b")["scan_unroll"] == 20
    assert "scan_unroll" not in chosen("gpt2_125m", {"scan_unroll": 2})


# ----------------------------------------------------------------------------- the splash block and VMEM

# XLA:TPU's compile errors (v5e, 16 MiB scoped VMEM): (block, head_dim, MiB needed, where measured)
# (the forward kernel's figures are lower bounds: the dkv kernel of the same block needs more)
REFUSED = [(1024, 256, 16.39, "dkv kernel, MHA 20 heads, maxtext_v5e_16b on the chip"),
           (1024, 256, 17.52, "dkv kernel, MQA, the 160M shape at 8 sequences on the chip"),
           (2048, 128, 19.89, "forward kernel, AOT for a v5e"), (2048, 256, 21.84, "forward kernel, AOT for a v5e")]
RAN = [(1024, 128), (512, 256), (512, 64), (1024, 64)]  # llama_v5e, the 160M shape, gpt2_125m (T 1024)


def test_the_vmem_model_refuses_every_block_the_chip_refused_and_fits_every_one_it_ran():
    for block, dh, mib, _ in REFUSED:
        assert splash_vmem_bytes(block, dh) >= mib * MiB * 0.999 and splash_vmem_bytes(block, dh) > 16 * MiB
    for block, dh in RAN:
        assert splash_vmem_bytes(block, dh) <= 16 * MiB


def test_the_automatic_block_fits_at_every_head_dim_and_keeps_the_measured_fastest():
    # the 160M shape (T 2048, head_dim 256): 512 (1024 overflows; 512 was the faster where both ran)
    m = ModelConfig(vocab_size=32768, context_length=2048, d_model=1024, num_layers=8, num_heads=4, num_kv_heads=1,
                    d_ff=3072, dtype="bfloat16")
    assert m.splash_block == 512 and splash_block(2048, 0, 256) == 512
    assert splash_block(2048, 0, 128) == 1024 and splash_block(1024, 0, 64) == 512  # as measured before
    assert splash_block(32) == 128 and splash_block(4096, 0, 512) == 512
    for dh in (64, 128, 256, 512, 1024):
        assert splash_vmem_bytes(splash_block(4096, 0, dh), dh) <= 16 * MiB
    # a raised limit lets more blocks fit; the automatic cap (1024) still holds
    assert 2048 in splash_fitting(2048, 128, 98304) and 2048 not in splash_fitting(2048, 128)
    assert dataclasses.replace(m, xla_tpu_scoped_vmem_limit_kib=98304).splash_block == 1024
    assert dataclasses.replace(m, attention_block=1024).splash_block == 1024  # by hand: kept


def test_a_block_set_by_hand_over_vmem_gets_one_line_naming_the_largest_that_fits():
    shape = {"d_model": 1024, "num_heads": 4, "num_kv_heads": 1, "d_ff": 3072}
    got = path("llama_v5e", {**shape, "attention_block": 1024}, shape_given=True)
    (line,) = [x for x in got.overruled if "attention_block" in x]
    assert "--attention_block=1024 at head_dim 256 needs ~17.8 MiB" in line and "--attention_block=512" in line
    assert got.cfg.model.attention_block == 1024  # the flag is kept
    assert not [x for x in path("llama_v5e", {**shape, "attention_block": 512}, shape_given=True).overruled
                if "attention_block" in x]


def test_the_launchers_pass_the_flags_given_and_log_the_choices(monkeypatch):
    """launch.common.fast_path: the flags on the command line are `given` (a default is not), a shape flag
    drops the preset's measured batch, and on this CPU nothing changes."""
    import jax
    from absl import flags

    from launch import common

    common.define_model_flags()
    flags.FLAGS(["prog", "--preset=llama_v5e", "--logits_dtype=float32"])
    try:
        cfg, lines = common.config_from_flags(flags.FLAGS), []
        assert common.fast_path(cfg, flags.FLAGS, "single", lines.append) == cfg and lines == []  # CPU
        chip = type("Device", (), {"platform": "tpu", "device_kind": "TPU v5 lite"})()
        monkeypatch.setattr(jax, "devices", lambda *a: [chip])
        got = common.fast_path(cfg, flags.FLAGS, "single", lines.append)
        assert (got.model.logits_dtype, got.model.remat, got.train.batch_size) == ("float32", "none", 4)
        assert lines[0].startswith("fast path on tpu v5e: ") and lines[1].startswith("--logits_dtype=float32 wins")
        flags.FLAGS(["prog", "--preset=llama_v5e", "--d_model=1024"])
        lines = []
        got = common.fast_path(common.config_from_flags(flags.FLAGS), flags.FLAGS, "single", lines.append)
        # a shape flag: the preset's measured batch does not apply; its 2 x 2048 fits without remat (the shape rule)
        assert (got.model.remat, got.train.batch_size, got.train.grad_accum) == ("none", 2, 1)
        assert "by the memory model" in lines[0]
    finally:
        flags.FLAGS.unparse_flags()



@pytest.fixture
def on_v5e(monkeypatch):
    """launch(*argv, cfg=None) -> (config, lines): launch.common.fast_path on a faked v5e for a fresh command
    line (cfg: the flags' config unless given)."""
    import jax
    from absl import flags

    from launch import common

    common.define_model_flags()
    chip = type("Device", (), {"platform": "tpu", "device_kind": "TPU v5 lite"})()
    monkeypatch.setattr(jax, "devices", lambda *a: [chip])

    def launch(*argv: str, cfg=None):
        flags.FLAGS.unparse_flags()  # absl keeps an earlier parse's flags present
        flags.FLAGS(["prog", *argv])
        lines: list[str] = []
        return common.fast_path(cfg or common.config_from_flags(flags.FLAGS), flags.FLAGS, "single",
                                lines.append), lines

    yield launch
    flags.FLAGS.unparse_flags()


def field(cfg, name: str):
    return getattr(cfg.model if name in {f.name for f in dataclasses.fields(cfg.model)} else cfg.train, name)


def test_every_option_the_fast_path_sets_yields_to_its_flag(on_v5e):
    """Each option the fast path sets on some preset (every Choice name it makes), that preset launched with the
    option's flag at the preset's own value: that value runs, the fast path's line does not list the option, and
    the lines are the chooser's for that flag given (an overruling line where it disagrees)."""
    first: dict[str, tuple[str, object]] = {}  # option -> (the first preset it is set on, the value set)
    for name in PRESETS:
        for c in path(name).choices:
            first.setdefault(c.name, (name, c.value))
    assert {c.name for name in PRESETS for c in path(name, shape_given=True).choices} <= set(first)
    assert {"dtype", "weight_dtype", "logits_dtype", "norm_dtype", "qkv_layout", "scan_unroll", "remat",
            "batch_size", "grad_accum"} <= set(first)
    for option, (name, value) in first.items():
        own = field(preset(name), option)
        assert own != value
        got, lines = on_v5e(f"--preset={name}", f"--{option}={own}")
        assert field(got, option) == own, (option, name)
        assert not any(f"{option}=" in part.split(" (")[0] for part in lines[0].split(": ", 1)[1].split("; ")), lines
        assert lines == path(name, {option: own}).lines(), (option, lines)
    _, lines = on_v5e("--preset=llama_v5e", "--d_model=1024", "--num_heads=4", "--num_kv_heads=1",
                      "--attention_block=1024")  # the flag the VMEM check reads
    assert any(line.startswith("--attention_block=1024 at head_dim 256 needs") for line in lines), lines


def test_every_flag_that_changes_the_model_drops_the_presets_measured_batch(on_v5e):
    """llama_v5e's measured batch (4 sequences without remat, its preset 2) is its own shape's and vocabulary's:
    any shape flag, MoE flag or --tokenizer on the command line drops it (the shape rule decides instead), and
    other flags keep it. The preset's config is run each time: only the flag's presence differs."""
    from absl import flags

    from launch import common

    cfg = preset("llama_v5e")
    assert on_v5e("--preset=llama_v5e", cfg=cfg)[0].train.batch_size == 4
    for flag in (*common.SHAPE_FLAGS, *common.MOE_FLAGS, "tokenizer"):
        kind = flags.FLAGS[flag]
        value = {"int": 2, "float": 0.5}.get(kind.flag_type(), getattr(kind.parser, "enum_values", ["bytes"])[0])
        got, lines = on_v5e("--preset=llama_v5e", f"--{flag}={value}", cfg=cfg)
        assert got.train.batch_size == 2 and "by the memory model" in lines[0], (flag, lines)
    for argv in (["--seed=3"], ["--steps=5"], ["--lr=0.002"], ["--logits_dtype=float32"], ["--optimizer=sgd"]):
        assert on_v5e("--preset=llama_v5e", *argv, cfg=cfg)[0].train.batch_size == 4, argv


@pytest.mark.parametrize("name, given, halves", [
    ("gpt2_125m", {}, False),  # head_dim 64 (d_model 768 is a multiple of 256: the head's width decides)
    ("llama_v5e", {}, False),  # head_dim 128
    ("gpt2_125m", {"d_model": 1024, "num_heads": 4}, True),  # the 160M shape's head_dim 256
    ("gpt2_125m", {"d_model": 1536, "num_heads": 3, "qkv_layout": "tokens"}, False),  # halves need the heads layout
])
def test_the_qkv_layout_line_claims_rope_halves_exactly_where_the_model_rotates_halves(name, given, halves):
    """The heads layout's reason names RoPE on halves iff config.rope_on_halves(head_dim) holds, the rule the
    attention itself applies (twinshard.model.attention.project_heads): never by d_model, which is a multiple
    of 256 for gpt2_125m's 12 heads of 64 too."""
    got = path(name, given, shape_given=bool(given))
    line = got.lines()[0]
    assert got.cfg.model.head_dim == got.cfg.model.d_model // got.cfg.model.num_heads
    assert ("RoPE halves" in line) == halves == (got.cfg.model.qkv_layout == "heads"
                                                  and rope_on_halves(got.cfg.model.head_dim)), line
