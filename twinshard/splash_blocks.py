"""The splash kernel's blocks: which sizes it takes for a sequence, the scoped VMEM a block needs, and the
automatic block (ModelConfig.splash_block). Below twinshard.config, which checks --attention_block with it."""

import math

SPLASH_LANES = 128  # the splash kernel's key blocks are multiples of 128 tokens (its NUM_LANES)
# splash_block's largest automatic block: 512 up to T = 1024, 1024 beyond (measured, TPU v5e, JAX
# 0.10.2, bf16 fwd+bwd: B16 H12 T1024 dh64 3.25 ms at 512, 3.41 at 1024; B8 H16 T2048 dh128 5.85 at 512, 5.47 at 1024),
# and never one splash_vmem_bytes puts over the scoped VMEM (at head_dim 256, 512: it also ran faster than 1024,
# 161.2k against 159.6k tokens/s on BENCHMARKS.md's 160M shape).
SCOPED_VMEM_KIB = 16 * 1024  # XLA:TPU's default scoped VMEM limit on a v5e (its compile errors: "limit 16.00M")
# The splash kernels' scoped VMEM for a block of n queries and keys at head_dim dh, in bytes:
# SPLASH_VMEM_PER_SCORE n^2 (the f32 [n, n] score blocks) + SPLASH_VMEM_PER_ROW n dh (the q, k, v, o, do, dq, dk,
# dv blocks, double-buffered, and their f32 accumulators). Fitted to XLA:TPU's compile errors on a v5e:
# the forward at n = 2048 needs 19.89M at dh 128 and 21.84M at dh 256 (AOT, libtpu 0.0.50.1: 4.49 B per
# n^2, 7.8 per n dh); the fused dkv kernel at n = 1024, dh 256 needed 16.39M (MHA, 20 heads) and 17.52M
# (MQA, one kv head, 8 sequences) on the chip (jax 0.10.2), where n = 1024 at dh 128 ran (llama_v5e). The
# model gives that dkv kernel 17.75 MiB (above its largest measured figure) and dh 128 at 1024 11.1 MiB.
# Measured: libtpu 0.0.50.1 compiled dh 256 at n = 1024 ahead of time for a v5e (the kernel alone and the
# 160M step at 8 sequences), where the chip's jax 0.10.2 refused it: the model keeps the chip's verdict.
SPLASH_VMEM_PER_SCORE = 4.5
SPLASH_VMEM_PER_ROW = 53


def splash_padded(t: int) -> int:
    """t rounded up to a multiple of 128: the sequence length the splash kernel runs on."""
    return SPLASH_LANES * math.ceil(t / SPLASH_LANES)


def splash_blocks(t: int) -> list[int]:
    """The block sizes the splash kernel takes for t tokens: multiples of 128 dividing splash_padded(t)."""
    padded = splash_padded(t)
    return [b for b in range(SPLASH_LANES, padded + 1, SPLASH_LANES) if padded % b == 0]


def splash_vmem_bytes(block: int, head_dim: int) -> int:
    """The scoped VMEM (bytes) the splash kernels need for blocks of `block` tokens at `head_dim` (the model above)."""
    return int(SPLASH_VMEM_PER_SCORE * block * block + SPLASH_VMEM_PER_ROW * block * head_dim)


def splash_fitting(t: int, head_dim: int, vmem_limit_kib: int = 0) -> list[int]:
    """splash_blocks(t) whose splash_vmem_bytes fit the scoped VMEM (vmem_limit_kib, 0: SCOPED_VMEM_KIB)."""
    limit = 1024 * (vmem_limit_kib or SCOPED_VMEM_KIB)
    return [b for b in splash_blocks(t) if splash_vmem_bytes(b, head_dim) <= limit]


def splash_block(t: int, block: int = 0, head_dim: int = 128, vmem_limit_kib: int = 0) -> int:
    """The splash kernel's block for t tokens at `head_dim`: `block`, or for 0 the largest of splash_blocks(t)
    up to 512 (1024 when t > 1024) that fits the scoped VMEM (splash_fitting; 128 where none does)."""
    if block and block not in splash_blocks(t):
        raise ValueError(f"ModelConfig.attention_block={block} (--attention_block) must be a multiple of "
                         f"{SPLASH_LANES} dividing the {t}-token sequence padded to {splash_padded(t)}; choose "
                         f"from {splash_blocks(t)} (0: automatic).")
    cap = 512 if splash_padded(t) <= 1024 else 1024
    return block or max((b for b in splash_fitting(t, head_dim, vmem_limit_kib) if b <= cap), default=SPLASH_LANES)
