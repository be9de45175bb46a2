"""The chip's own rates, measured apart from any training step: what the step-time prediction
(`twinshard.hlo.schedule`) multiplies the nominal peaks by.

    python tools/chip_micro.py --json=micro.json            # on the accelerator
    JAX_PLATFORMS=cpu python tools/chip_micro.py --small    # here: the same code on tiny shapes

Three kinds, each a separate jitted program timed alone (25th percentile of `--reps` samples, each
of 5 calls blocked once):
- matmul: a square [n, n] x [n, n] in bf16 (and int8 into int32), plus the matmul shapes of
  the presets' layers (tokens x d_model x d_ff, the LM head), FLOP/s against the chip's peak;
- HBM: an elementwise pass (y = x * a + b) and a row reduction over arrays far larger than
  any on-chip memory, bytes read + written per second against the datasheet bandwidth;
- splash: the project's splash kernel alone (`twinshard.model.layers.splash_attention`),
  forward and forward + backward at each preset's attention shape and block, FLOP/s with
  causal attention counted half (forward 4 B H T^2 dh / 2; backward 2.5x the forward: the
  fused backward recomputes Q K^T and forms dV, dP, dQ, dK).
None of these is a training step: the predictions they feed are checked against steps that
were measured separately (BENCHMARKS.md, "Step time predicted from the compiled program").
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags

flags.DEFINE_string("json", None, "Write the measurements as JSON here.")
flags.DEFINE_bool("small", False, "Tiny shapes (a CPU check of the code, not a measurement).")
flags.DEFINE_integer("reps", 20, "Timed calls per program.")
flags.DEFINE_list("splash_blocks", "512,1024", "Splash block sizes to time (2048 needs a larger "
                  "scoped VMEM: --xla_tpu_scoped_vmem_limit_kib in LIBTPU_INIT_ARGS).")
flags.DEFINE_list("parts", "matmul,hbm,splash", "Which measurements to run (splash_sweep: --splash_sweep's "
                  "block sizes at --splash_sweep_shape).")
flags.DEFINE_list("splash_sweep", "block=512", "splash_sweep's kernels, each 'key=value' pairs joined by ':': block "
                  "(every block), fused (0/1: one backward kernel), and splash.BlockSizes fields (block_kv_compute=256, "
                  "k_layout=SEQ_MINOR, ...), e.g. block=512:block_kv_compute=256,block=1024:fused=0.")
flags.DEFINE_string("splash_sweep_shape", "gpt2_350m", "The SPLASH_SHAPES row splash_sweep runs at.")
FLAGS = flags.FLAGS

# (name, B, heads, kv heads, T, head_dim): the attention of tools/tpu_bench.sh's presets
SPLASH_SHAPES = (("gpt2_125m", 16, 12, 12, 1024, 64), ("gpt2_350m", 16, 16, 16, 1024, 64),
                 ("llama_v5e", 2, 16, 4, 2048, 128),
                 ("s160", 4, 4, 1, 2048, 256))  # BENCHMARKS.md's 160M shape, 4 sequences a micro-batch
# (name, M, K, N): the layers' matmuls at those presets' token counts
MATMUL_SHAPES = (("gpt2_125m mlp", 16384, 768, 3072), ("gpt2_125m lm_head", 16384, 768, 50304),
                 ("gpt2_350m mlp", 16384, 1024, 4096), ("llama_v5e mlp", 4096, 2048, 5632),
                 ("llama_v5e lm_head", 4096, 2048, 32768))


def timed(f, *args, reps, inner=5):
    """The 25th-percentile seconds of one f(*args) (compiled and warmed first), from samples of
    `inner` calls blocked once at the end: on the v5e a call timed alone carried 0.6-0.8 ms of
    dispatch (an 8192^3 bf16 matmul: 6.61 ms alone, 5.82 ms per call five at a time), which halved
    the measured rate of a 1-2 ms kernel (splash fwd+bwd at llama_v5e's shape: 2.28 ms alone,
    1.34 ms per layer inside the step)."""
    import jax

    from twinshard.hardware.measure import p25

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready([f(*args) for _ in range(inner)])
        times.append((time.perf_counter() - t0) / inner)
    return p25(times)


def matmuls(small: bool, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    shapes = [("square bf16", 8192, 8192, 8192, "bfloat16"), ("square bf16 4096", 4096, 4096, 4096, "bfloat16"),
              ("square int8", 8192, 8192, 8192, "int8")]
    shapes += [(name, m, k, n, "bfloat16") for name, m, k, n in MATMUL_SHAPES]
    rows = []
    for name, m, k, n, dtype in shapes:
        if small:
            m, k, n = min(m, 256), min(k, 256), min(n, 256)
        key1, key2 = jax.random.split(jax.random.key(0))
        if dtype == "int8":
            a = jax.random.randint(key1, (m, k), -127, 127, jnp.int8)
            b = jax.random.randint(key2, (k, n), -127, 127, jnp.int8)
            f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.int32))
        else:
            a, b = jax.random.normal(key1, (m, k), dtype), jax.random.normal(key2, (k, n), dtype)
            f = jax.jit(jnp.matmul)
        s = timed(f, a, b, reps=reps)
        rows.append({"kind": "matmul", "name": name, "dtype": dtype, "shape": [m, k, n], "seconds": s,
                     "flops_per_s": 2 * m * k * n / s})
    return rows


def hbm(small: bool, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    n = 1 << (16 if small else 28)  # 2^28 elements: 512 MiB in bf16, 1 GiB in float32
    rows = []
    for dtype in ("bfloat16", "float32"):
        x = jnp.ones((n // 4096, 4096), dtype)
        size = x.size * x.dtype.itemsize
        axpy = jax.jit(lambda x: x * jnp.asarray(1.5, x.dtype) + jnp.asarray(0.5, x.dtype))
        s = timed(axpy, x, reps=reps)
        rows.append({"kind": "hbm", "name": f"elementwise {dtype}", "bytes": 2 * size, "seconds": s,
                     "bytes_per_s": 2 * size / s})
        rowsum = jax.jit(lambda x: jnp.sum(x.astype(jnp.float32), axis=-1))
        s = timed(rowsum, x, reps=reps)
        out = x.shape[0] * 4
        rows.append({"kind": "hbm", "name": f"row reduction {dtype}", "bytes": size + out, "seconds": s,
                     "bytes_per_s": (size + out) / s})
    return rows


def splash(small: bool, reps: int, blocks: list, shapes=SPLASH_SHAPES) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from twinshard.model.layers import Splash, splash_attention

    rows = []
    for name, b, h, hk, t, dh in shapes:
        if small:
            b, h, hk, t = 1, 2, min(hk, 2), 256
        keys = jax.random.split(jax.random.key(1), 3)
        q = jax.random.normal(keys[0], (b, h, t, dh), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, hk, t, dh), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, hk, t, dh), jnp.bfloat16)
        forward_flops = 4 * b * h * t * t * dh / 2  # causal: half of QK^T and PV
        for block in blocks:
            size, label = (block.block, block._asdict()) if isinstance(block, Splash) else (block, block)
            if size > t:
                continue
            fwd = jax.jit(lambda q, k, v, block=block: splash_attention(q, k, v, block))
            loss = lambda q, k, v, block=block: splash_attention(q, k, v, block).astype(jnp.float32).sum()  # noqa: E731
            both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            try:
                s_fwd, s_both = timed(fwd, q, k, v, reps=reps), timed(both, q, k, v, reps=reps)
            except Exception as e:  # noqa: BLE001  a block the scoped VMEM cannot hold: recorded, not fatal
                rows.append({"kind": "splash", "name": name, "block": label, "error": str(e).splitlines()[0][:300]})
                continue
            rows.append({"kind": "splash", "name": name, "shape": [b, h, hk, t, dh], "block": label,
                         "forward_s": s_fwd, "forward_flops_per_s": forward_flops / s_fwd,
                         "fwd_bwd_s": s_both, "fwd_bwd_flops_per_s": 3.5 * forward_flops / s_both})
    return rows


def splash_sweep(small: bool, reps: int, configs: list[str], shape: str) -> list[dict]:
    """The splash kernel alone at one preset's attention shape under each of `configs`' block sizes and layouts."""
    from twinshard.model.layers import Splash

    rows_by_name = {row[0]: row for row in SPLASH_SHAPES}
    if shape not in rows_by_name:
        raise app.UsageError(f"--splash_sweep_shape={shape}: not one of {sorted(rows_by_name)}")
    try:
        kernels = [Splash.parse(c) for c in configs]
    except ValueError as e:
        raise app.UsageError(f"--splash_sweep: {e}") from None
    return splash(small, reps, kernels, shapes=(rows_by_name[shape],))


def main(argv):
    del argv
    import jax

    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.device_kind}", flush=True)
    out = {"jax": jax.__version__, "device_kind": device.device_kind, "rows": []}
    parts = {"matmul": lambda: matmuls(FLAGS.small, FLAGS.reps), "hbm": lambda: hbm(FLAGS.small, FLAGS.reps),
             "splash": lambda: splash(FLAGS.small, FLAGS.reps, [int(b) for b in FLAGS.splash_blocks]),
             "splash_sweep": lambda: splash_sweep(FLAGS.small, FLAGS.reps, FLAGS.splash_sweep, FLAGS.splash_sweep_shape)}
    unknown = sorted(set(FLAGS.parts) - set(parts))
    if unknown:
        raise app.UsageError(f"--parts={','.join(FLAGS.parts)}: unknown {unknown}; choose from {sorted(parts)}")
    for name in FLAGS.parts:
        for row in parts[name]():
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            if FLAGS.json:  # after every row: a run stopped by its time limit keeps what it measured
                with open(FLAGS.json, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    from launch.common import parse_flags  # --help exits 0

    sys.exit(app.run(main, flags_parser=parse_flags))
