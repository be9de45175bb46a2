"""Does the train step fit in a device's memory? Every launcher asks before running it.

A step that cannot fit is refused in ONE line (a ValueError: `common.run` prints it, exit 1)
naming the part that dominates and what to change, never XLA's RESOURCE_EXHAUSTED traceback,
and before anything is written to a workdir or an output file:

(a) before compiling (`check_model`), from the cost model (twinshard.cost, memory per device).
    Refused only when its verdict is sure: the exact argument bytes (params, optimizer state,
    tests/test_memory.py) plus SURE x its temporaries still exceed the device. Measured, XLA's
    temporaries / the model's: 0.85-1.8 for every strategy and twin (tests/test_memory.py,
    remat none), >= 0.57 under remat on a smaller denominator (tests/test_remat.py); on a TPU v5e
    gpt2_350m at 16x1024 bf16 asked XLA for 27.1 G where the model says 27.6 GiB. SURE = 0.5 is
    below all of them. On a CPU the limit is the host's memory shared by its local devices.
(b) after compiling, before running (`compile_checked`): `memory_analysis()`'s total allocation
    (`compiled_bytes`) against the device's `bytes_limit`. XLA:TPU refuses an
    over-large program in the compile itself (RESOURCE_EXHAUSTED): that error becomes the same
    line. XLA:CPU reports no limit: no check there.

`--device_memory_gib` replaces the device's memory in both (tests inject a small one on a CPU);
`--skip_memory_check` skips (a) and (b).
"""

from __future__ import annotations

import dataclasses
import os
import re

from absl import flags


SURE = 0.5  # the least of XLA's temporaries per byte of the model's that counts as sure (module docstring)
GIB = 2 ** 30

# Each part of twinshard.cost's Memory: what the line calls it, and what shrinks it.
_ACTIVATIONS_FIX = ("--remat=full (or dots_no_batch), a smaller --batch_size, --grad_accum=K (K micro-batches: "
                    "1/K of the activations), a shorter --context_length")
PARTS = {
    "activations": ("saved activations", _ACTIVATIONS_FIX),
    "backward_layer": ("one layer's backward working set",
                       "a smaller --batch_size, --grad_accum=K or a shorter --context_length ([T, T] grows with T^2)"),
    "params": ("params", "--weight_dtype=bfloat16 (half the bytes), fsdp over more devices, or a smaller model"),
    "grads": ("gradients", "--weight_dtype=bfloat16 (half the bytes), fsdp over more devices, or a smaller model"),
    "optimizer": ("optimizer state", "--weight_dtype=bfloat16 (bf16 moments), --optimizer=adafactor, or fsdp over "
                  "more devices"),
    "gathered_weights": ("gathered weights", "tp or fsdp_tp (each device gathers only its tensor shard)"),
    "accumulator": ("the gradient accumulator", "a smaller --grad_accum with a smaller --batch_size"),
    "master": ("master weights", "--weight_dtype=float32 without a copy, or fsdp over more devices"),
}
TEMPORARY = ("activations", "backward_layer", "grads", "gathered_weights", "accumulator")


def human(n: float) -> str:
    from twinshard.cost import human as text  # twinshard.cost imports jax: not at flag definition

    return text(n)


def _flag(name: str, default=None):
    """The flag's value; `default` where this process defines or parsed no such flag (a library call)."""
    return getattr(flags.FLAGS, name) if name in flags.FLAGS and flags.FLAGS.is_parsed() else default


def limit(after_compile: bool) -> tuple[int, str] | None:
    """(bytes a device may use, what that is), or None (no check): --device_memory_gib, else the
    accelerator's bytes_limit, else on a CPU the host's memory per local device before compiling
    and nothing after it."""
    import jax

    gib = _flag("device_memory_gib")
    if gib is not None:
        if not gib > 0:
            raise ValueError(f"--device_memory_gib={gib} must be positive (GiB per device).")
        return int(gib * GIB), f"--device_memory_gib={gib:g}"
    local = jax.local_devices()
    stats = local[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{local[0].device_kind}'s bytes_limit"
    if after_compile:
        return None
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // len(local), f"this host's {total / GIB:.1f} GiB shared by {len(local)} device(s)"


def _fix(part: str) -> str:
    fix = PARTS[part][1]
    if part == "activations" and "loss_chunks" in flags.FLAGS:  # the chunked loss, where this build has it
        fix += ", --loss_chunks"
    return fix


def _largest(memory, among=None) -> str:
    parts = {k: v for k, v in dataclasses.asdict(memory).items() if among is None or k in among}
    return max(parts, key=parts.get)


def model_memory(run):
    """The cost model's Memory of `run` (a resolved run) on this backend, or None where it has none."""
    import jax

    from twinshard import cost

    try:  # attention auto on a GPU or a TPU: cuDNN's or splash's, which keep no [T, T] array
        return cost.of_run(run, gpu=jax.default_backend() == "gpu", tpu=_on_tpu(run)).memory
    except ValueError:  # no memory model for this configuration (a mixture of experts under remat=dots)
        return None


def check_model(run, bound: tuple[int, str] | None = None) -> None:
    """(a): refuse, before compiling, a step of `run` the cost model surely cannot fit (module
    docstring); `bound`: (bytes, what) of devices that are not this host's (a TPU topology)."""
    if _flag("skip_memory_check", False) or (need := model_memory(run)) is None:
        return
    have, what = bound if bound is not None and _flag("device_memory_gib") is None else limit(after_compile=False)
    surely = need.total - (1 - SURE) * need.temporaries
    if surely <= have:
        return
    top = _largest(need)
    raise ValueError(f"this step needs ~{human(need.total)} per device by the cost model ({PARTS[top][0]} "
                     f"{human(getattr(need, top))} of {human(need.total)}; at least {human(surely)}) and a device "
                     f"has {human(have)} ({what}): try {_fix(top)}; --skip_memory_check compiles anyway.")


def compiled_bytes(compiled) -> dict[str, int] | None:
    """memory_analysis(): arguments, temporaries, `summed` (arguments + outputs - aliased + temporaries) and
    the peak the device holds, XLA's `total_allocation_bytes`: every allocation of the program's buffer
    assignment, all live while it runs (arguments, outputs not aliased to them, the temporaries as packed);
    `summed` where the backend reports no total.

    On a TPU the sum overstates it: temp_size_in_bytes there exceeds the temporaries' packed allocation.
    gpt2_125m 16x1024 bf16 with float32 weights (README's command before the fast path) logged "compiled
    step 18.12 GiB" on a v5e and ran in its 15.75; compiled ahead of time for a v5e (libtpu 0.0.50.1):
    arguments 1.81 GiB (all aliased to the outputs), temporaries 16.31, summed 18.12, total allocation
    13.65. peak_memory_in_bytes, beside it 13.64, is no bound: a small step's read 147 MB over its 84 MB
    of allocations, and XLA:CPU's leaves the temporaries out. On a CPU total and sum agree (tiny: 7.68 MB)."""
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    summed = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    return {"arguments": int(ma.argument_size_in_bytes), "temporaries": int(ma.temp_size_in_bytes),
            "summed": int(summed), "peak": int(getattr(ma, "total_allocation_bytes", 0) or summed)}


def _refuse_compiled(used: str, have: str, why: str, run, temporaries: bool) -> ValueError:
    need = model_memory(run)
    top = "activations" if need is None else _largest(need, TEMPORARY if temporaries else ("params", "optimizer"))
    part = "" if need is None else f"; the cost model's largest part: {PARTS[top][0]} {human(getattr(need, top))}"
    return ValueError(f"the compiled step needs {used} per device ({why}{part}) and a device has {have}: try "
                      f"{_fix(top)}; --skip_memory_check runs anyway.")


def check_compiled(compiled, run, bound: tuple[int, str] | None = None) -> None:
    """(b): refuse a compiled step whose memory_analysis() exceeds the device's limit (`bound`: as
    check_model's)."""
    if _flag("device_memory_gib") is None and _on_tpu(run):
        # XLA:TPU refuses at compile time what does not fit (compile_checked's line), so on a TPU the
        # compiler's verdict stands, compiled ahead of time for a topology's chips too.
        return
    if _flag("device_memory_gib") is not None or bound is None:
        bound = limit(after_compile=True)
    if _flag("skip_memory_check", False) or bound is None:
        return
    got = compiled_bytes(compiled)
    if got is None or got["peak"] <= bound[0]:
        return
    temporaries = got["temporaries"] >= got["arguments"]
    raise _refuse_compiled(human(got["peak"]), f"{human(bound[0])} ({bound[1]})",
                           f"XLA's memory_analysis: temporaries {human(got['temporaries'])}, arguments "
                           f"{human(got['arguments'])}", run, temporaries)


def _on_tpu(run) -> bool:
    """The step is compiled for TPU chips: this host's, or a topology's (`run.devices`)."""
    import jax

    devices = getattr(run, "devices", None)
    return (devices[0].platform if devices else jax.default_backend()) == "tpu"


def smaller_splash_block(m) -> str:
    """What to pass where the splash block of ModelConfig `m` overflows the scoped VMEM: the largest block
    below it that twinshard.splash_blocks.splash_vmem_bytes fits."""
    from twinshard.splash_blocks import splash_fitting

    block = m.splash_block
    smaller = [b for b in splash_fitting(m.context_length, m.head_dim, m.xla_tpu_scoped_vmem_limit_kib) if b < block]
    fix = f"pass --attention_block={max(smaller)}" if smaller else "no smaller splash block exists"
    return (f"the splash block is {block} at head_dim {m.head_dim}; {fix}, the largest below it that fits "
            "by twinshard.splash_blocks.splash_vmem_bytes, or raise --xla_tpu_scoped_vmem_limit_kib")


def _kernel_of(error: str) -> str:
    """The custom call an XLA:TPU VMEM error names ('splash_mha_dkv_no_residuals'), and the sizes it states."""
    kernel = re.search(r"allocating on stack for %([\w-]+?)(?:\.\d+)? =", error)
    sizes = re.search(r"size ([\d.]+\w?) and limit ([\d.]+\w?)", error)
    return ((kernel[1] if kernel else "a custom call") + (f": {sizes[1]} of {sizes[2]}" if sizes else ""))


# XLA:TPU's compile errors: "... Ran out of memory in memory space hbm. Used 27.10G of 15.75G hbm. ..."
# and, compiled ahead of time for a topology, "... the total memory required for HLO temporaries
# (17.26G) exceeds available HBM (15.75G)" (measured, libtpu 0.0.50.1)
_USED = re.compile(r"Used ([\d.]+[KMGT]?) of ([\d.]+[KMGT]?) (\w+)"
                   r"|required for HLO (?:\w+) \(([\d.]+[KMGT]?)\) exceeds available (\w+) \(([\d.]+[KMGT]?)\)")


def compile_checked(lowered, run, bound: tuple[int, str] | None = None, compile=None):
    """`compile(lowered)` (default lowered.compile()), with XLA's RESOURCE_EXHAUSTED and
    check_compiled's verdict as one line each."""
    import jax

    try:
        compiled = lowered.compile() if compile is None else compile(lowered)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        if "memory space vmem" in str(e):  # a kernel's blocks, not the step, exceed the chip's on-core memory
            raise ValueError(f"XLA refused to compile it: a kernel's blocks overflow the chip's scoped VMEM "
                             f"({_kernel_of(str(e))}): {smaller_splash_block(run.cfg.model)}.") from None
        m = _USED.search(str(e))
        used, have = ((m[1], f"{m[2]} ({m[3]})") if m and m[1] else (m[4], f"{m[6]} ({m[5]})") if m
                      else ("more than a device has", "less"))
        raise _refuse_compiled(used, have, "XLA refused to compile it: RESOURCE_EXHAUSTED", run, True) from None
    check_compiled(compiled, run, bound)
    return compiled


def check_step(runner, run):
    """The runner's train step compiled ahead of time on its abstract state and checked (b); the
    jitted step reuses this compile (measured, JAX 0.12: no second backend compile at the first call).
    Nothing is compiled here where no check could run (a CPU without --device_memory_gib)."""
    import jax
    import numpy as np

    if _flag("skip_memory_check", False) or limit(after_compile=True) is None:
        return None
    cfg = run.cfg
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.context_length), np.int32,
                                  sharding=getattr(runner, "batch_sharding", None))
    return compile_checked(runner.train_step.lower(runner.abstract_state(), tokens, tokens), run)
