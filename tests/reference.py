"""Independent NumPy float64 reference of the JAX-LM model, written from the spec.

Nothing here imports twinshard's math: it works on the CS336 state dict
(PyTorch layout: Linear weights [out, in]) so it also checks the interop layout.
"""

from __future__ import annotations

import numpy as np


def linear(x, w_out_in):
    return x @ w_out_in.T


def rms_norm(x, g, eps=1e-5):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * g


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(x, w1, w2, w3):
    return linear(silu(linear(x, w1)) * linear(x, w3), w2)


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rope(x, positions, theta):
    """x: [..., T, d]; rotate pairs (x[2k], x[2k+1]) by angle pos * theta^(-2k/d), one by one."""
    out = np.empty_like(x)
    d = x.shape[-1]
    for i, pos in enumerate(positions):
        for k in range(d // 2):
            a = pos / theta ** (2 * k / d)
            c, s = np.cos(a), np.sin(a)
            x0, x1 = x[..., i, 2 * k], x[..., i, 2 * k + 1]
            out[..., i, 2 * k] = c * x0 - s * x1
            out[..., i, 2 * k + 1] = s * x0 + c * x1
    return out


def attention(q, k, v, mask):
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    scores = np.where(mask, scores, -np.inf)
    return softmax(scores) @ v


def attention_vjp(q, k, v, mask, do):
    """attention's output and the gradients (dq, dk, dv) of sum(out * do), by hand: p = softmax(s),
    s = q k^T / sqrt(d); dv = p^T do, dp = do v^T, ds = p (dp - rowsum(dp p)) / sqrt(d), dq = ds k,
    dk = ds^T q. Rows with no visible key are not supported (every causal row sees its own)."""
    d = q.shape[-1]
    scores = np.where(mask, q @ np.swapaxes(k, -1, -2) / np.sqrt(d), -np.inf)
    p = softmax(scores)
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) / np.sqrt(d)
    return p @ v, (ds @ k, np.swapaxes(ds, -1, -2) @ q, np.swapaxes(p, -1, -2) @ do)


def large_logits(rng, shape, peak=100.0):
    """q, k, v [B, h, T, dh] (float64) whose causal scores reach about +-peak, with maxima that
    differ by position: per (batch, head) a unit direction u; q_i = +-a u (random sign per query)
    and k_j = level_j u with level_j falling from +peak to -peak along the sequence as
    1 - 2 sqrt(j / (T-1)), plus N(0, 1/4) noise on both. A query of sign + finds its row max at
    the sequence's first keys, one of sign - at its latest visible key; a block of keys (a ring
    step's) has its own max, ~peak apart from the furthest block's. v ~ N(0, 1)."""
    b, h, t, dh = shape
    u = rng.normal(size=(b, h, 1, dh))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    a = 10.0
    level = peak * np.sqrt(dh) / a * (1 - 2 * np.sqrt(np.arange(t) / (t - 1)))  # [T]
    sign = rng.choice([-1.0, 1.0], size=(b, h, t, 1))
    q = a * sign * u + rng.normal(size=shape) / 2
    k = level[:, None] * u + rng.normal(size=shape) / 2
    return q, k, rng.normal(size=shape)


def gqa_attention(q, k, v, mask):
    """Grouped-query attention: q [..., H, T, d], k and v [..., Hkv, T, d]; query head i attends
    with kv head i // (H / Hkv) (each kv head repeated over its group of consecutive query heads)."""
    group = q.shape[-3] // k.shape[-3]
    return attention(q, np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3), mask)


def mha(x, wq, wk, wv, wo, num_heads, theta):
    """Multi-head attention, or grouped-query attention when wk, wv [Hkv*dh, D] are narrower than wq."""
    b, t, d = x.shape
    dh = wq.shape[0] // num_heads
    heads = lambda y: y.reshape(b, t, -1, dh).transpose(0, 2, 1, 3)  # noqa: E731
    pos = np.arange(t)
    q, k, v = rope(heads(linear(x, wq)), pos, theta), rope(heads(linear(x, wk)), pos, theta), heads(linear(x, wv))
    out = gqa_attention(q, k, v, np.tril(np.ones((t, t), bool)))
    return linear(out.transpose(0, 2, 1, 3).reshape(b, t, num_heads * dh), wo)


def transformer_lm(sd, tokens, num_layers, num_heads, theta, eps=1e-5, ffn=None):
    """Logits [B, T, V] (unpadded) from a CS336 state dict of float64 arrays.
    ffn(i, h) -> [B, T, D]: layer i's feed-forward of its ln2 output h (default: the dense SwiGLU)."""
    x = sd["token_embeddings.weight"][tokens]
    for i in range(num_layers):
        p = lambda n: sd[f"layers.{i}.{n}"]  # noqa: E731
        h = rms_norm(x, p("ln1.weight"), eps)
        x = x + mha(h, p("attn.q_proj.weight"), p("attn.k_proj.weight"), p("attn.v_proj.weight"),
                    p("attn.output_proj.weight"), num_heads, theta)
        h = rms_norm(x, p("ln2.weight"), eps)
        x = x + (ffn(i, h) if ffn else swiglu(h, p("ffn.w1.weight"), p("ffn.w2.weight"), p("ffn.w3.weight")))
    return linear(rms_norm(x, sd["ln_final.weight"], eps), sd["lm_head.weight"])


def moe_ffn(x, router, w1, w2, w3, k, capacity, group_size):
    """The mixture-of-experts feed-forward, token by token. x [B, T, D]; router [E, D]; w1, w3
    [E, F, D]; w2 [E, D, F] (torch layout: layers.{i}.ffn.router.weight, ffn.experts.w*.weight).

    Each group of group_size consecutive tokens: router probabilities softmax(x router^T); a
    token's k most probable experts, weights renormalised over the k; expert buffers of
    `capacity` places filled first choices first (all of the group's first choices in token
    order, then the second choices...), a choice finding its expert full is dropped; the
    output is the weighted sum of the kept experts' SwiGLU. Returns (y [B, T, D], stats):
    aux (Switch loss E sum_i f_i P_i per group, f over all k choices before dropping, mean over
    groups), z (mean over tokens of logsumexp(logits)^2), tokens_per_expert [E] and dropped
    (choices kept / dropped), lost [B, T] (tokens whose every choice was dropped)."""
    b, t, d = x.shape
    e = router.shape[0]
    groups = x.reshape(-1, group_size, d)
    y = np.zeros_like(groups)
    lost = np.zeros(groups.shape[:2], bool)
    per_expert, dropped, aux, z = np.zeros(e, np.int64), 0, [], []
    for g, tokens in enumerate(groups):
        logits = linear(tokens, router)  # [S, E]
        probs = softmax(logits)
        top = [list(np.argsort(-p, kind="stable")[:k]) for p in probs]
        load = np.zeros(e, np.int64)
        kept = np.zeros((group_size, k), bool)
        for j in range(k):
            for s in range(group_size):
                if load[top[s][j]] < capacity:
                    load[top[s][j]] += 1
                    kept[s, j] = True
        for s in range(group_size):
            weights = probs[s, top[s]] / probs[s, top[s]].sum()
            for j, ex in enumerate(top[s]):
                if kept[s, j]:
                    y[g, s] += weights[j] * swiglu(tokens[s], w1[ex], w2[ex], w3[ex])
        per_expert += load
        dropped += int((~kept).sum())
        lost[g] = ~kept.any(axis=1)
        share = np.bincount(np.ravel(top), minlength=e) / (k * group_size)
        aux.append(e * np.sum(share * probs.mean(axis=0)))
        m = logits.max(axis=1)
        z.extend((m + np.log(np.exp(logits - m[:, None]).sum(axis=1))) ** 2)
    stats = {"aux": np.mean(aux), "z": np.mean(z), "tokens_per_expert": per_expert, "dropped": dropped,
             "lost": lost.reshape(b, t)}
    return y.reshape(b, t, d), stats


def cross_entropy(logits, targets):
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    return np.mean(lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0])


def cs336_lr(t, a_max, a_min, tw, tc):
    """The CS336 get_lr_cosine_schedule, as written in the assignment."""
    import math
    if t < tw:
        return t / tw * a_max
    if t <= tc:
        return a_min + 0.5 * (1 + math.cos((t - tw) / (tc - tw) * math.pi)) * (a_max - a_min)
    return a_min


def random_batches(batch: int, context: int, vocab: int, n: int, seed: int = 0):
    """n (x, y) batches of uniform random int32 tokens, y = x shifted by one: [batch, context] each."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = rng.integers(0, vocab, (batch, context + 1))
        out.append((b[:, :-1].astype(np.int32), b[:, 1:].astype(np.int32)))
    return out


def max_diff(a, b) -> float:
    """Largest absolute difference between two pytrees of arrays."""
    import jax

    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def first_step_gradients(opt_state, train) -> dict:
    """The gradients an AdamW train step took from a fresh state, read back from the state it returns
    (in the model's layer order): optax.scale_by_adam's first moment is then (1 - beta1) g s, where
    clip_and_guard scaled g by s = min(1, grad_clip / (norm + 1e-6)) with the norm it keeps
    (GuardState.grad_norm). Two float32 roundings away from g (~1e-7 relative)."""
    import jax

    norm = float(opt_state.grad_norm)
    scale = min(1.0, train.grad_clip / (norm + 1e-6)) if train.grad_clip > 0 else 1.0
    return jax.tree.map(lambda mu: np.asarray(mu, np.float64) / ((1 - train.beta1) * scale), opt_state.inner[0].mu)


def train_record(runner, cfg, steps: int, grads: bool | str = True, start=None, step=None) -> dict:
    """A runner's step-1 gradients, then the losses, reported grad norms and final params of
    `steps` train steps on random_batches of `cfg`: what the twin tests compare with single device.
    grads=False: no step-1 gradients ("grads" is None), one program fewer to compile (the
    separate loss_and_grads: ~3.5 s of CPU for the tiny model, measured). The suite's GSPMD
    twins train without them: equal losses over the steps, equal reported norms and equal
    params after AdamW steps leave a wrong gradient no place to hide but a per-leaf constant
    scale (AdamW is scale-free per leaf), which changes the global norm; tests/test_data_tensor.py
    compares the dp/fsdp/tp/fsdp_tp GSPMD gradients themselves (their train step's first AdamW moment).
    start: another record's "start" (its initial state on the host, in the model's layer order),
    placed on this runner's shardings instead of its own init: one program fewer to compile
    (placing host arrays compiles nothing), where another test proves this strategy's init.
    grads="first_step": the step-1 gradients read from the first train step's AdamW moment
    (first_step_gradients): the gradients the train step itself computed, with no loss_and_grads to
    compile (AdamW only).
    step: the runner's train step compiled ahead (train_step.lower(...).compile()), trained with instead
    of runner.train_step: a test that also reads that compiled program traces and lowers it once."""
    import jax

    batches = random_batches(cfg.train.batch_size, cfg.model.context_length, cfg.model.vocab_size, steps)
    state = (runner.init_state(cfg.train.seed) if start is None
             else jax.device_put(runner.to_stored(start), runner.state_shardings))
    first = jax.device_get(runner.to_model(state))
    init = first.params  # (the params and grads in the model's layer order)
    step1 = (jax.device_get(runner.to_model(runner.loss_and_grads(state.params, *runner.place_batch(*batches[0]))[1]))
             if grads is True else None)
    losses, norms = [], []
    for x, y in batches:
        state, m = (step or runner.train_step)(state, *runner.place_batch(x, y))
        if grads == "first_step" and not losses:  # (read before the next step donates the state)
            assert cfg.train.optimizer == "adamw", cfg.train.optimizer
            step1 = first_step_gradients(jax.device_get(runner.to_model(state).opt_state), cfg.train)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return {"init": init, "start": first, "grads": step1, "losses": np.array(losses), "grad_norms": np.array(norms),
            "params": jax.device_get(runner.to_model(state.params)), "state": state, "runner": runner}
