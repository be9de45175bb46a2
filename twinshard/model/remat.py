"""Rematerialization: the named jax.checkpoint policies of one scanned layer (ModelConfig.remat),
and the rules the strategies add to them (`Parallelism.layer_policy`)."""

from __future__ import annotations

from typing import Callable

import jax

from twinshard.config import ModelConfig
from twinshard.model import attention, layers
from twinshard.model.hooks import Policy

Array = jax.Array
_POLICIES = jax.checkpoint_policies


# ModelConfig.remat -> the jax.checkpoint policy of ONE layer (the scan body); what each saves:
# docs/memory.md (--remat).
REMAT_POLICIES: dict[str, Policy | None] = {
    "none": None,  # no checkpoint: twinshard/cost/memory.py lists what autodiff saves
    "full": _POLICIES.nothing_saveable,  # each layer's input [b,T,D] alone
    "dots": _POLICIES.dots_saveable,  # every dot_general, attention's [b,H,T,T] scores included
    "dots_no_batch": _POLICIES.dots_with_no_batch_dims_saveable,  # the 7 projections, not attention's einsums
    "save_qkv_proj": _POLICIES.save_only_these_names(*attention.QKV_NAMES),
    # q, k, v, the attention kernel's out and log-sum-exp, context and out_proj: the norms, RoPE and the MLP are recomputed
    "save_dot_except_mlp": _POLICIES.save_only_these_names(*attention.QKV_NAMES, attention.CONTEXT, attention.OUT_PROJ,
                                                           layers.ATTENTION_RESIDUALS),
    # every projection and the attention kernel's out and log-sum-exp
    "minimal": _POLICIES.save_only_these_names(*attention.QKV_NAMES, attention.CONTEXT, attention.OUT_PROJ,
                                               *layers.MLP_IN, layers.MLP_OUT, layers.ATTENTION_RESIDUALS),
}
# Not offered: `save_anything_except_these_names` is a stub in JAX 0.12.0.1 (it saves everything).


def remat_policy(cfg: ModelConfig) -> Policy | None:
    """The jax.checkpoint policy of one scanned layer for `cfg.remat` (None: no checkpoint)."""
    return REMAT_POLICIES[cfg.remat]


def either(*policies: Policy) -> Policy:
    """A residual is saved if any of `policies` saves it."""
    return lambda prim, *args, **params: any(p(prim, *args, **params) for p in policies)


def also_saving(policy: Policy | None, *saved: Policy) -> Policy | None:
    """A layer's `policy` that also saves what `saved` save (None: the layer is not checkpointed):
    a checkpointed layer's backward pass recomputes matmuls, never a collective."""
    return None if policy is None else either(policy, *saved)


class RegathersWeights:
    """FSDP's remat rule (manual and explicit twins): no gathered weight (`gathers`) is kept for the
    backward pass, per layer and for the lm_head; jax.checkpoint policies do not nest (measured, JAX 0.12)."""

    @staticmethod
    def gathers(prim, **params) -> bool:
        raise NotImplementedError("a FSDP twin says which primitive's output is a gathered weight")

    def never_gathered(self, policy: Policy) -> Policy:
        """`policy`, except that a gathered weight is never saved: it is gathered again."""
        return lambda prim, *args, **params: not self.gathers(prim, **params) and policy(prim, *args, **params)

    def layer_policy(self, policy: Policy | None) -> Policy:
        inner = super().layer_policy(policy)  # the twin's own additions (fsdp_tp: Megatron g's outputs saved)
        return self.never_gathered(jax.checkpoint_policies.everything_saveable if inner is None else inner)

    def head(self, lm_head: Callable[[Array], Array], x: Array) -> Array:
        """lm_head(x) checkpointed: the backward pass re-gathers the lm_head weight."""
        return jax.checkpoint(lm_head, policy=self.never_gathered(jax.checkpoint_policies.everything_saveable))(x)
