"""The traced gradient step's equations, for tests that assert what the step computes in which dtype."""

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from twinshard.train import trainer


def gradient_step_equations(cfg, batch: int) -> Iterator:
    """Every equation of jax.grad(loss_fn) traced at cfg's abstract params and a [batch, T] token batch,
    the sub-jaxprs of scans, checkpoints and custom rules included (a scanned layer's once)."""
    params = jax.eval_shape(functools.partial(trainer.create_params, cfg, 0))
    x = jax.ShapeDtypeStruct((batch, cfg.context_length), jnp.int32)
    yield from _equations(jax.make_jaxpr(jax.grad(functools.partial(trainer.loss_fn, cfg=cfg)))(params, x, x).jaxpr)


def _equations(jaxpr) -> Iterator:
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)
