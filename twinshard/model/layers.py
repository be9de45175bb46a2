"""Layer math, once: pure functions on arrays (JAX-LM / CS336 spec).

Every strategy (single device, GSPMD, shard_map) calls these. They take local
sizes from array shapes, never from a world size: under Megatron TP the same
`attention` runs on H/tensor heads because `wq` arrives as [D, H/tensor * dh].

Notation: B batch, T sequence, D d_model, H heads, dh head dim, F d_ff, V vocab.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from twinshard.config import splash_block, splash_padded


Array = jax.Array
# jax.ad_checkpoint.checkpoint_name of the attention kernel's saved out and log-sum-exp
# (recompute_attention's, and splash's through its `residual_checkpoint_name`), for the
# remat policies that keep them (transformer.REMAT_POLICIES "minimal").
ATTENTION_RESIDUALS = "attention_residuals"
# checkpoint_name of the SwiGLU projections (MaxText's names): w1, w3 outputs; w2's output.
MLP_IN, MLP_OUT = ("mlpwi_0", "mlpwi_1"), "mlpwo"


def linear(x: Array, w: Array, flat: bool = True) -> Array:
    """y = x W with W stored [in, out] (bias-free). x: [..., in] -> [..., out].

    flat (the default): ONE 2-D dot on the rows [prod(...), in] @ [in, out]: with the batch
    dims kept (`einsum('...i,io->...o')`, flat=False) XLA:CPU computed the weight gradient
    with a transposing copy of the [..., out] cotangent first, a slower step (measured, JAX
    0.12). GSPMD shards the flat rows as the batch dims they merge, the same collectives
    flattened, EXCEPT where the sequence is sharded and the batch is not (cp, tp_sp: merging
    [B, T/c] into one dim is not a tiling, so it gathers activations): those strategies pass
    flat=False (Parallelism.flat_rows).

    In bf16 the dot is bf16 x bf16 -> bf16 and the backend accumulates in float32
    (TPU MXU, cuBLAS/cuDNN bf16 GEMMs; XLA:CPU upcasts). Asking for a float32 result
    (`preferred_element_type`) instead made JAX run BOTH backward matmuls in f32 x f32
    (the f32 cotangent promotes the bf16 operand; measured, JAX 0.12)."""
    if not flat:
        return matmul(x, w)
    return matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[-1])


def _product(x: Array, w: Array) -> Array:
    """x [..., in] @ w [in, out]: a 2-D dot on rows, an einsum keeping the batch dims otherwise."""
    if x.ndim == 2:
        return jnp.dot(x, w, out_sharding=partial_sums("ij,jk->ik", x, w))
    return jnp.einsum("...i,io->...o", x, w, out_sharding=partial_sums("...i,io->...o", x, w))


def partial_sums(spec: str, a: Array, b: Array) -> jax.sharding.NamedSharding | None:
    """The output sharding of the contraction `jnp.einsum(spec, a, b)` in JAX's Explicit mode
    (sharding in types: explicit_parallel/), None elsewhere (one device, GSPMD, inside shard_map).

    Each output dim is split as the input dim it comes from; a contracted dim split over the
    same mesh axes in both operands leaves the result `unreduced` over them: each device's
    partial sum, no communication. JAX 0.12 refuses such a contraction without an out_sharding
    ("Contracting dimensions are sharded and it is ambiguous how the output should be sharded"),
    so whoever reduces the partial sums says where the all-reduce runs: a hook (Megatron's g)
    or `cotangent_like` (a gradient, as its primal's type asks). spec: two operands, ellipsis
    ('...') of one length in all three terms."""
    types = jax.typeof(a), jax.typeof(b)
    mesh = next((t.sharding.mesh for t in types if not t.sharding.mesh.empty), None)
    if mesh is None or not mesh.explicit_axes:
        return None
    terms, out = spec.split("->")
    n = types[0].ndim - len(terms.split(",")[0].replace("...", ""))  # the dims '...' stands for
    expand = lambda term: term.replace("...", "".join(chr(0x3b1 + i) for i in range(n)))  # noqa: E731
    da, db = ({letter: _partition(t, i) for i, letter in enumerate(expand(term))}
              for term, t in zip(terms.split(","), types))
    unreduced = {axis for letter in set(da) & set(db) - set(expand(out))
                 if da[letter] is not None and da[letter] == db[letter] for axis in _mesh_axes(da[letter])}
    parts = [da[letter] if letter in da else db[letter] for letter in expand(out)]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*parts, unreduced=unreduced))


def _partition(aval, dim: int):
    """The mesh axis (or tuple of axes, or None) splitting dim `dim` of `aval`."""
    spec = aval.sharding.spec.partitions
    return spec[dim] if dim < len(spec) else None


def _mesh_axes(partition) -> tuple[str, ...]:
    return (partition,) if isinstance(partition, str) else tuple(partition)


@jax.custom_vjp
def matmul(x: Array, w: Array) -> Array:
    """x [..., in] @ w [in, out] -> [..., out]; its weight gradient is ONE dot x^T g -> [in, out].

    Autodiff of the plain dot computes dW as transpose(dot(g, x)): the dot yields [out, in]
    (JAX's dot_general transpose rule puts the cotangent's free dim first) and a transpose
    follows. Alone, XLA folds that transpose into the dot. Under GSPMD the gradient's
    all-reduce over the token axes (`data`; `context` under cp; fsdp's all-reduce + slice on
    XLA:CPU) is placed on the dot's [out, in] output, so the transpose cannot fold; it fuses
    into the optimizer's consumers instead (AdamW's mu, nu and update fusions), each reading
    the gradient column by column, several times slower on CPU (measured, JAX 0.12). One dot
    x^T g puts the all-reduce on a gradient already in the weight's layout. The manual twin's
    gradient mean comes after the transpose (its own line): never the problem.
    jax.checkpoint's policies see the same forward dot as for the plain `x @ w` (the same saved
    residuals under dots / dots_no_batch / full)."""
    return _product(x, w)


def _matmul_fwd(x: Array, w: Array) -> tuple[Array, tuple[Array, Array]]:
    return _product(x, w), (x, w)


def _matmul_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    x, w = res  # x: [..., in], w: [in, out], g: [..., out]
    dx = (jnp.dot(g, w.T, out_sharding=partial_sums("ij,jk->ik", g, w.T)) if g.ndim == 2
          else jnp.einsum("...o,io->...i", g, w, out_sharding=partial_sums("...o,io->...i", g, w)))  # [..., in]
    # x^T g: ONE dot_general(x, g) -> [in, out], no transpose after
    dw = jnp.einsum("...i,...o->io", x, g, out_sharding=partial_sums("...i,...o->io", x, g))
    return cotangent_like(dx, x), cotangent_like(dw, w)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def cotangent_like(ct: Array, primal: Array) -> Array:
    """A custom backward's cotangent as autodiff would leave it: in the primal's dtype and,
    inside shard_map (check_vma), summed over the mesh axes it varies over and the primal
    does not (the transpose of the implicit broadcast: a weight invariant over `data` meeting
    an activation that varies over it). Without the sum JAX rejects the program (`Custom VJP
    bwd rule ... corresponding to an input of type`) where autodiff of the plain expression
    inserted the psum silently (docs/design.md, JAX facts). The strategies here never need it
    (their manual twins pcast first); a bug that forgets the pcast then fails as it would under
    plain autodiff: gradients N times too large. The reverse (a primal varying over an
    axis its cotangent does not) cannot happen here: each cotangent above is a product with
    the output's cotangent, which varies over every axis either input does.

    In Explicit mode (explicit_parallel/) the cotangent is resharded to the type autodiff gives
    the primal's cotangent (`to_ct_aval`: a replicated weight's gradient replicated, a `reduced`
    one's left `unreduced`): a partial sum `partial_sums` left over the batch is reduced here
    (dp: the gradient all-reduce) or kept for a later reduction the types place."""
    if extra := tuple(sorted(varying_axes(ct) - varying_axes(primal))):
        ct = jax.lax.psum(ct, extra)
    elif jax.typeof(primal).sharding.mesh.explicit_axes:
        want = jax.typeof(primal).to_ct_aval().sharding
        if jax.typeof(ct).sharding.spec != want.spec:
            ct = jax.sharding.reshard(ct, want)
    return ct.astype(primal.dtype)


def varying_axes(x: Array) -> frozenset:
    """The mesh axes x varies over inside shard_map (empty outside). JAX 0.12 keeps them in
    `jax.typeof(x).manual_axis_type.varying` (printed as {V:axis}); there is no `.vma`."""
    return jax.typeof(x).manual_axis_type.varying


def linears(x: Array, ws: tuple[Array, ...], flat: bool = True) -> tuple[Array, ...]:
    """x @ w for each w of a shared input (q, k, v; w1, w3), x flattened ONCE: autodiff then
    saves one [prod(...), in] residual for all of them (one reshape per matmul saved one copy
    each: 3 extra [B, T, D] per layer, measured in tests/test_sequence.py's residual count)."""
    rows = x.reshape(-1, x.shape[-1]) if flat else x
    return tuple(linear(rows, w, flat).reshape(*x.shape[:-1], w.shape[-1]) for w in ws)


def embedding(ids: Array, table: Array) -> Array:
    """Row lookup. ids: [...] int, table: [V, D] -> [..., D]."""
    return jnp.take(table, ids, axis=0)


def rms_norm(x: Array, gain: Array, eps: float) -> Array:
    """x / sqrt(mean(x^2) + eps) * g, computed in float32, returned in x.dtype."""
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv_rms * gain.astype(jnp.float32)).astype(x.dtype)


def silu(x: Array) -> Array:
    return x * jax.nn.sigmoid(x)


@jax.custom_vjp
def swiglu_gate(h1: Array, h3: Array) -> Array:
    """SiLU(x W1) * x W3 from the two column-parallel projections h1 = x W1, h3 = x W3 [..., F].

    Its backward keeps h1 and h3 alone and recomputes the sigmoid from h1. Autodiff of the
    plain expression saved four more [..., F] arrays per layer (the sigmoid, SiLU and the
    products), which the scanned stack writes into [L, ...] buffers and reads back; this
    one saves 3 x [b, T, F] per layer (h1, h3, and W2's input, which W2's gradient reads)."""
    return silu(h1) * h3


def _swiglu_gate_fwd(h1: Array, h3: Array) -> tuple[Array, tuple[Array, Array]]:
    return swiglu_gate(h1, h3), (h1, h3)


def _swiglu_gate_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    h1, h3 = res  # [..., F] each; g: [..., F]
    sig = jax.nn.sigmoid(h1)
    silu_h1 = h1 * sig
    # d silu(h)/dh = sig + h sig (1 - sig) = sig + silu (1 - sig)
    return cotangent_like(g * h3 * (sig + silu_h1 * (1 - sig)), h1), cotangent_like(g * silu_h1, h3)


swiglu_gate.defvjp(_swiglu_gate_fwd, _swiglu_gate_bwd)


def swiglu(x: Array, w1: Array, w2: Array, w3: Array) -> Array:
    """W2 (SiLU(x W1) * x W3). x: [..., D], w1/w3: [D, F], w2: [F, D] -> [..., D]."""
    return linear(swiglu_gate(*linears(x, (w1, w3))), w2)


def row_max(x: Array, axis: int = -1) -> Array:
    """The max along `axis` (kept as a size-1 dim) that a stable softmax subtracts before exp. It
    only keeps exp() in range: the result does not depend on it, so no gradient flows through it
    (softmax below; ring attention's running max, manual_parallel/ring_attention.py)."""
    return jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))


def softmax(x: Array, axis: int = -1) -> Array:
    """Numerically stable softmax: subtract the max before exp."""
    z = x - row_max(x, axis)
    e = jnp.exp(z)
    return e / jnp.sum(e, axis=axis, keepdims=True)


@functools.lru_cache(maxsize=None)
def rope_tables(head_dim: int, theta: float, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cached cos/sin tables, each [max_len, head_dim/2] float32 (constants under jit).

    Pair k of position i is rotated by angle i * theta^(-2k/head_dim).
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: Array, positions: Array, theta: float, max_len: int) -> Array:
    """Rotate interleaved (even, odd) feature pairs. x: [..., T, dh], positions: [T]."""
    cos_table, sin_table = rope_tables(x.shape[-1], float(theta), int(max_len))
    cos, sin = jnp.asarray(cos_table)[positions], jnp.asarray(sin_table)[positions]  # [T, dh/2]
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rot_even = x_even * cos - x_odd * sin
    rot_odd = x_even * sin + x_odd * cos
    return jnp.stack([rot_even, rot_odd], axis=-1).reshape(x.shape).astype(x.dtype)


def causal_mask(t: int) -> Array:
    """[T, T] boolean keep-mask: query i sees keys j <= i."""
    return jnp.tril(jnp.ones((t, t), dtype=bool))


def scaled_dot_product_attention(q: Array, k: Array, v: Array, mask: Array | None = None) -> Array:
    """softmax(q k^T / sqrt(dk), masked) v. q: [..., Tq, dk], k: [..., Tk, dk], v: [..., Tk, dv].

    mask: boolean [Tq, Tk] (broadcastable), True = keep. Masked scores get -inf,
    so they carry exactly zero probability.
    """
    scores = attention_scores(q, k, mask)
    return jnp.einsum("...qk,...kd->...qd", softmax(scores, axis=-1).astype(v.dtype), v)


def attention_scores(q: Array, k: Array, mask: Array | None = None) -> Array:
    """q k^T / sqrt(dk) in float32 (the softmax runs in f32), masked scores -inf.
    q: [..., Tq, dk], k: [..., Tk, dk], mask: boolean [Tq, Tk] or None -> [..., Tq, Tk].
    scaled_dot_product_attention's and each block of ring attention's."""
    scores = jnp.einsum("...qd,...kd->...qk", q, k).astype(jnp.float32)  # softmax in f32
    scores = scores / np.sqrt(q.shape[-1]).astype(np.float32)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    return scores


def group_heads(q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
    """Grouped-query attention's layout: q [B, h, T, dh] and k, v [B, hk, Tk, dh] (h a multiple of
    hk) -> q [B, hk, h/hk, T, dh], k and v [B, hk, 1, Tk, dh]. Query head i attends with key/value
    head i // (h/hk) (the heads of a group are consecutive, as in jax.nn.dot_product_attention), and
    every "..." einsum of an attention kernel broadcasts each kv head over its group without a copy
    (jnp.einsum squeezes the size-1 dim: one dot_general batched over (B, hk)). ungroup_heads
    inverts it."""
    b, h, t, dh = q.shape
    hk = k.shape[-3]
    assert h % hk == 0 and k.shape == v.shape[:-1] + (k.shape[-1],), (q.shape, k.shape, v.shape)
    return q.reshape(b, hk, h // hk, t, dh), k[:, :, None], v[:, :, None]


def ungroup_heads(o: Array) -> Array:
    """[B, hk, h/hk, T, dh] -> [B, h, T, dh] (group_heads' inverse for the output)."""
    b, hk, g, t, dh = o.shape
    return o.reshape(b, hk * g, t, dh)


_TARGET: list[str] = []  # compiling_for's platform, innermost last


@contextlib.contextmanager
def compiling_for(platform: str):
    """Trace the kernels for `platform` instead of this process's backend: a TPU topology compiled
    ahead of time from a CPU host lowers splash for the chip (Mosaic), not in interpret mode."""
    _TARGET.append(platform)
    try:
        yield
    finally:
        _TARGET.pop()


def target_backend() -> str:
    """The platform the traced kernels run on (compiling_for's, else jax.default_backend())."""
    return _TARGET[-1] if _TARGET else jax.default_backend()


def attention_kernel(impl: str, dtype, positions: tuple[int, ...] | None = None) -> str:
    """The kernel `causal_attention` runs for `impl` on this backend: "auto" is cudnn on a GPU in
    bf16/fp16, splash on a TPU in bf16, recompute elsewhere; with permuted `positions` (the GSPMD
    context-parallel twin) splash runs recompute (its mask here is by index)."""
    if impl == "auto":
        backend, half = target_backend(), dtype in (jnp.bfloat16, jnp.float16)
        impl = ("cudnn" if half and backend == "gpu" and positions is None
                else "splash" if dtype == jnp.bfloat16 and backend == "tpu" else "recompute")
    return "recompute" if impl == "splash" and positions is not None else impl


def causal_attention(q: Array, k: Array, v: Array, impl: str = "auto",
                     positions: tuple[int, ...] | None = None, block: int = 0) -> Array:
    """Causal attention of q [B, h, T, dh] with k, v [B, hk, T, dh] -> [B, h, T, dh] (h local heads
    under TP). hk = h: multi-head attention; hk < h (a divisor): grouped-query attention, query head
    i attending with kv head i // (h/hk) (`group_heads`; jax.nn's kernels take it natively).

    impl: "reference" is `scaled_dot_product_attention` above, the readable one every
    other is tested against; "recompute" is `recompute_attention` below (the same math,
    a backward that saves no [T, T] array); "xla" and "cudnn" are
    `jax.nn.dot_product_attention`'s implementations (cuDNN flash attention: GPU,
    bf16/fp16 only; it never builds the [T, T] scores); "splash" is `splash_attention` below
    (Pallas TPU flash attention, blocks of `block` tokens, 0: `splash_block`'s choice);
    "auto" is `attention_kernel`'s choice for q's dtype and this backend.

    positions: the tokens' true places in a permuted sequence (the GSPMD context-parallel
    twin's zig-zag layout, auto_parallel/cp.py): key j is seen by query i iff positions[j] <=
    positions[i]; None: arange(T). jax.nn's kernels mask by index only, so with positions
    "auto" and "splash" are recompute and "xla" / "cudnn" run the reference.
    """
    impl = attention_kernel(impl, q.dtype, positions)
    if impl == "splash":
        return splash_attention(q, k, v, block)
    if impl in ("recompute", "reference") or positions is not None:
        grouped = k.shape[-3] != q.shape[-3]
        qg, kg, vg = group_heads(q, k, v) if grouped else (q, k, v)
        if impl == "recompute":
            o = recompute_attention(qg, kg, vg, positions)
        else:
            o = scaled_dot_product_attention(qg, kg, vg, _keep_mask(q.shape[-2], positions))
        return ungroup_heads(o) if grouped else o
    bthd = lambda t: t.transpose(0, 2, 1, 3)  # noqa: E731  [B, h, T, dh] <-> [B, T, h, dh]
    return bthd(jax.nn.dot_product_attention(bthd(q), bthd(k), bthd(v), is_causal=True, implementation=impl))


def splash_attention(q: Array, k: Array, v: Array, block: int = 0) -> Array:
    """Causal attention by JAX's Pallas splash attention kernel (TPU flash attention: tiled, it
    never builds a [T, T] array), q [B, h, T, dh], k, v [B, hk, T, dh] -> [B, h, T, dh].

    Grouped-query attention natively: the multi-head kernel takes hk kv heads dividing h (query
    head i reads kv head i // (h/hk), as `group_heads`), the multi-query kernel one kv head [T, dh].
    The kernel runs per example (a vmap over B), takes no softmax scale (q is scaled by
    1/sqrt(dh) first) and names its residuals (o and the rows' logsumexp) ATTENTION_RESIDUALS for
    remat policies. Off a TPU it runs in Pallas' interpret mode (the same kernel as plain XLA
    ops: CPU tests). T is padded with zeros to a multiple of 128 (the kernel refuses a key block
    that is not one: "bkv_compute=32 must be a multiple of 128", JAX 0.12); causal, no real query
    sees a padded key, and the padded queries' rows are dropped (zero cotangent)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b, h, t, dh = q.shape
    hk, padded = k.shape[-3], splash_padded(t)
    n = splash_block(t, block)
    # The fused backward (dq, dk and dv in one kernel) ran fwd+bwd 24% faster on a TPU v5e
    # (B16 H12 T1024 dh64, block 512: 3.25 ms against 4.26 ms; JAX 0.10.2); it takes no dq blocks.
    sizes = splash.BlockSizes(block_q=n, block_kv=n, block_kv_compute=n, block_q_dkv=n, block_kv_dkv=n,
                              block_kv_dkv_compute=n, use_fused_bwd_kernel=True)
    make = splash.make_splash_mqa if hk == 1 else splash.make_splash_mha

    def run(q, k, v):  # the kernel built where it runs: its mask tables are arrays of that trace
        kernel = make(masks.MultiHeadMask([masks.CausalMask((padded, padded))] * h), block_sizes=sizes,
                      head_shards=1, q_seq_shards=1, residual_checkpoint_name=ATTENTION_RESIDUALS,
                      interpret=target_backend() != "tpu")
        return jax.vmap(kernel)(q, k, v)

    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, padded - t), (0, 0)))  # noqa: E731
    q = pad(q * np.asarray(1 / np.sqrt(dh), q.dtype))
    k, v = pad(k), pad(v)
    if hk == 1:
        k, v = k[:, 0], v[:, 0]  # [B, T, dh]: the multi-query kernel's one kv head
    o = _unchecked(run, q, k, v) if varying_axes(q) | varying_axes(k) | varying_axes(v) else run(q, k, v)
    return o[:, :, :t]


def _unchecked(f, *args: Array) -> Array:
    """f(*args) of per-device arrays inside a check_vma shard_map (the manual twin), for a Pallas
    kernel whose output shapes carry no varying axes: JAX 0.12 refuses it there ("When
    `check_vma=True` on `jax.shard_map`, `manual_axis_type` on `jax.ShapeDtypeStruct` must not be
    `None`"), and autodiff through a nested check_vma=False shard_map types the inputs' cotangents
    invariant (measured). So f runs in a nested shard_map over no axes without the check, its
    output typed varying as the inputs, and the backward pass is a custom_vjp that recomputes f
    and takes its gradients the same way (bwd type checks off inside), typed as each input:
    values untouched, no collective; the cost is one more forward of f in the backward pass."""
    return _unchecked_vjp(f, *args)


def _untyped(f, *args):
    """f(*args) in a shard_map over no mesh axes with check_vma=False (jax_disable_bwd_checks on
    while it traces: the backward's cotangents are typed invariant in there)."""
    from jax._src import config  # jax_disable_bwd_checks, as a context (JAX 0.10 and 0.12)

    with config.disable_bwd_checks(True):
        return jax.shard_map(f, in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(),
                             axis_names=frozenset(), check_vma=False)(*args)


def _varying_as(x: Array, *like: Array) -> Array:
    """x typed varying over every mesh axis one of `like` varies over (a pcast: no data moves)."""
    axes = tuple(sorted(frozenset().union(*(varying_axes(a) for a in like)) - varying_axes(x)))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unchecked_vjp(f, *args):
    return _varying_as(_untyped(f, *args), *args)


def _unchecked_fwd(f, *args):
    return _unchecked_vjp(f, *args), args


def _unchecked_bwd(f, args, g):
    grads = lambda g, *a: jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=tuple(range(len(a))))(*a)  # noqa: E731
    return tuple(_varying_as(ct, a) for ct, a in zip(_untyped(grads, g, *args), args))


_unchecked_vjp.defvjp(_unchecked_fwd, _unchecked_bwd)


def recompute_attention(q: Array, k: Array, v: Array, positions: tuple[int, ...] | None = None) -> Array:
    """Causal softmax(q k^T / sqrt(dh)) v, [B, h, T, dh] x3 -> [B, h, T, dh], whose backward
    saves o and the rows' log-sum-exp [B, h, T, 1] and recomputes the probabilities from q and
    k: flash attention's backward, untiled. A layer keeps no [T, T] array for the backward.
    Grouped-query attention passes group_heads' layout (k, v broadcast over a size-1 group dim;
    their gradients are summed over the group).

    Autodiff of the reference (and of jax.nn.dot_product_attention's XLA path) saves the
    masked scores and the probabilities, 2 x [B, h, T, T] float32 per layer, which the
    scanned stack writes into [L, ...] buffers and reads back. Recomputing q k^T costs less
    than storing and reading the two arrays: faster steps and less memory per device, more so
    as T grows (BENCHMARKS.md has the numbers). Alone, without a layer stack to store into,
    fwd + bwd is slower than XLA's: the win is the saved bytes, not the arithmetic.
    Softmax statistics, the probabilities and every q k^T are float32; the two products
    with v take p in v's dtype (bf16 under --dtype=bfloat16, as cuDNN does).

    positions: the tokens' true places when the sequence is permuted (the GSPMD context-
    parallel twin's zig-zag layout, auto_parallel/cp.py): key j is seen by query i iff
    positions[j] <= positions[i]. None: arange(T), the causal mask. A static tuple (a
    nondiff argument), so the mask is a constant of the program, never a saved residual."""
    return _recompute_attention(q, k, v, positions)


def _causal_scores(q: Array, k: Array, positions: tuple[int, ...] | None) -> Array:
    """q k^T / sqrt(dh) in float32 (accumulated in f32 also for bf16 q, k), future keys -inf.
    The forward and the backward compute it the same way, so exp(s - lse) is the forward's p."""
    s = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32)
    s = s / np.sqrt(q.shape[-1]).astype(np.float32)
    return jnp.where(_keep_mask(q.shape[-2], positions), s, -jnp.inf)  # every row keeps its own key


def visible(q_pos, k_pos):
    """The causal keep-mask [Tq, Tk] from true positions: key j is seen by query i iff k_pos[j] <= q_pos[i].
    (numpy or jax arrays; equals causal_mask(T) when both are arange(T).)"""
    return k_pos[None, :] <= q_pos[:, None]


def _keep_mask(t: int, positions: tuple[int, ...] | None) -> Array:
    """[T, T] causal keep-mask by index (positions None) or by the tokens' true positions."""
    if positions is None:
        return causal_mask(t)
    pos = np.asarray(positions)
    return jnp.asarray(visible(pos, pos))




@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _recompute_attention(q: Array, k: Array, v: Array, positions: tuple[int, ...] | None) -> Array:
    return _recompute_attention_fwd(q, k, v, positions)[0]


def _recompute_attention_fwd(q: Array, k: Array, v: Array, positions: tuple[int, ...] | None):
    s = _causal_scores(q, k, positions)  # [B, h, T, T] f32
    m = row_max(s)  # [B, h, T, 1]
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    o = (jnp.einsum("...qk,...kd->...qd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
         / total).astype(v.dtype)  # [B, h, T, dh]
    lse = m + jnp.log(total)  # [B, h, T, 1] f32: p = exp(s - lse)
    name = functools.partial(checkpoint_name, name=ATTENTION_RESIDUALS)  # an identity without a policy naming it
    return o, (q, k, v, name(o), name(lse))


def _recompute_attention_bwd(positions, res, do: Array) -> tuple[Array, Array, Array]:
    q, k, v, o, lse = res
    p = jnp.exp(_causal_scores(q, k, positions) - lse)  # [B, h, T, T] f32, 0 on future keys
    dv = jnp.einsum("...qk,...qd->...kd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("...qd,...kd->...qk", do, v, preferred_element_type=jnp.float32)
    # softmax backward: ds = p (dp - sum_k dp p), and sum_k dp_qk p_qk = do_q . o_q
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    ds = p * (dp - delta) / np.sqrt(q.shape[-1]).astype(np.float32)  # d(q k^T) [B, h, T, T]
    dq = jnp.einsum("...qk,...kd->...qd", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("...qk,...qd->...kd", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
    return cotangent_like(dq, q), cotangent_like(_sum_to(dk, k.shape), k), cotangent_like(_sum_to(dv, v.shape), v)


def _sum_to(x: Array, shape: tuple[int, ...]) -> Array:
    """x summed over the dims where `shape` has 1 and x does not (kept as 1): the gradient of an
    operand the einsums broadcast (grouped-query attention's k, v [B, hk, 1, T, dh])."""
    dims = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return jnp.sum(x, axis=dims, keepdims=True) if dims else x


_recompute_attention.defvjp(_recompute_attention_fwd, _recompute_attention_bwd)


def split_heads(x: Array, head_dim: int) -> Array:
    """[B, T, h*dh] -> [B, h, T, dh]."""
    b, t, hd = x.shape
    return x.reshape(b, t, hd // head_dim, head_dim).transpose(0, 2, 1, 3)


def merge_heads(x: Array) -> Array:
    """[B, h, T, dh] -> [B, T, h*dh]."""
    b, h, t, dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * dh)


def attend_heads(q: Array, k: Array, v: Array, positions: Array, head_dim: int, theta: float, max_len: int,
                 attend=causal_attention) -> Array:
    """The attention core on projections: q [B, T, h*dh], k, v [B, T, hk*dh] -> [B, T, h*dh].

    Splits heads, rotates q and k by RoPE at `positions` [T] (the tokens' places in the
    whole sequence: arange(T) on one device; a context-parallel shard's own chunk
    positions), and runs `attend` (q [B, h, T, dh], k, v [B, hk, T, dh] -> [B, h, T, dh];
    causal_attention, or ring attention across sequence shards)."""
    q = apply_rope(split_heads(q, head_dim), positions, theta, max_len)
    k = apply_rope(split_heads(k, head_dim), positions, theta, max_len)
    return merge_heads(attend(q, k, split_heads(v, head_dim)))


def causal_self_attention(
    x: Array, wq: Array, wk: Array, wv: Array, wo: Array,
    head_dim: int, theta: float, max_len: int, attention: str = "auto",
) -> Array:
    """Causal multi-head (or grouped-query) self-attention with RoPE on q and k.

    x: [B, T, D]; wq: [D, h*dh]; wk/wv: [D, hk*dh]; wo: [h*dh, D]; h = wq.shape[1] // head_dim
    (all H heads on one device, H/tensor under Megatron TP), hk the key/value heads (h without
    GQA; a divisor of h with it). Returns [B, T, D]
    (a partial sum over heads under TP: the caller reduces it). The model runs the same
    steps through its strategy's hooks (transformer.CausalSelfAttention).
    """
    q, k, v = linears(x, (wq, wk, wv))
    attend = functools.partial(causal_attention, impl=attention)
    return linear(attend_heads(q, k, v, jnp.arange(x.shape[-2]), head_dim, theta, max_len, attend), wo)
