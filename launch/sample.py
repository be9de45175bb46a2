"""Generate text from a checkpoint: `python -m launch.sample --workdir=runs/small --prompt="ROMEO:"`.

Temperature / top-k sampling with the model's full context window; padded
vocabulary ids are masked out so they are never sampled.
"""

from __future__ import annotations

import os

from absl import flags, logging

from launch import common

common.define(flags.DEFINE_string, "workdir", "runs/default", "Run directory written by launch.train.")
flags.DEFINE_string("prompt", "ROMEO:", "Text to continue.")
flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.8, "Softmax temperature (0: greedy).")
flags.DEFINE_integer("top_k", 40, "Sample among the k most likely tokens (0: all).")
common.define(flags.DEFINE_integer, "seed", None, "Sampling seed (default 0).")
FLAGS = flags.FLAGS


def _next_token(logits, vocab_size: int, temperature: float, top_k: int, key):
    import jax
    import jax.numpy as jnp

    from twinshard.model.loss import mask_padded_logits

    logits = mask_padded_logits(logits, vocab_size)
    if temperature == 0:
        return jnp.argmax(logits)
    logits = logits / temperature
    if top_k and top_k < vocab_size:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits)


def generate(params, model_cfg, prompt_ids: list[int], max_new_tokens: int, temperature: float,
             top_k: int, seed: int) -> list[int]:
    """Autoregressive sampling (recomputes the window each step: simple, fine for demos)."""
    import jax
    import jax.numpy as jnp

    from twinshard.train.trainer import graphdef
    from flax import nnx

    model = nnx.merge(graphdef(model_cfg), params)
    ctx = model_cfg.context_length

    @jax.jit
    def step(window, length, key):  # window: [1, ctx], valid up to `length`
        logits = model(window)[0, length - 1]
        return _next_token(logits, model_cfg.vocab_size, temperature, top_k, key)

    ids, key = list(prompt_ids), jax.random.key(seed)
    for _ in range(max_new_tokens):
        window = ids[-ctx:]
        key, sub = jax.random.split(key)
        padded = jnp.asarray(window + [0] * (ctx - len(window)), jnp.int32)[None]
        ids.append(int(step(padded, len(window), sub)))  # causal: padding after `length` is unseen
    return ids


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    common.default_platform()
    if FLAGS.temperature < 0:
        raise ValueError(f"--temperature={FLAGS.temperature} must be >= 0 (0: greedy).")
    if FLAGS.top_k < 0 or FLAGS.max_new_tokens < 0:
        raise ValueError(f"--top_k={FLAGS.top_k} and --max_new_tokens={FLAGS.max_new_tokens} must be >= 0.")
    if FLAGS.seed is not None and FLAGS.seed < 0:
        raise ValueError(f"--seed={FLAGS.seed} must be >= 0.")
    ckpt_dir = os.path.join(FLAGS.workdir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        raise ValueError(f"--workdir={FLAGS.workdir}: no checkpoints in {ckpt_dir!r}; train first with "
                         f"`python -m launch.train --workdir={FLAGS.workdir}`, or pass the right --workdir.")

    from twinshard.train.checkpoint import Checkpointer  # imports jax: after the cheap checks
    from twinshard.config import ModelConfig, TrainConfig
    from twinshard.train.tokenizer import get_encoding
    from twinshard.train.trainer import SingleDevice
    ckpt = Checkpointer(ckpt_dir, create=False)
    meta = ckpt.read_meta()
    model_cfg, train_cfg = ModelConfig(**meta["model"]), TrainConfig(**meta["train"])
    state, _ = ckpt.restore(SingleDevice(model_cfg, train_cfg).abstract_state(), {"model": meta["model"]})
    enc = get_encoding(train_cfg.tokenizer)
    prompt = enc.encode_ordinary(FLAGS.prompt)
    if not prompt:
        raise ValueError("--prompt is empty; give at least one character to continue.")
    ids = generate(state.params, model_cfg, prompt, FLAGS.max_new_tokens, FLAGS.temperature,
                   FLAGS.top_k, FLAGS.seed or 0)
    print(enc.decode(ids))


if __name__ == "__main__":
    common.run(main, "launch.sample")
