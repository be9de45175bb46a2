"""Rematerialization: the named jax.checkpoint policies of one scanned layer (ModelConfig.remat),
and the rules the strategies add to them (`Parallelism.layer_policy`)."""

from __future__ import annotations

from typing import Callable

import jax

from twinshard.config import ModelConfig
from twinshard.model import attention, layers

Array = jax.Array
Policy = Callable[..., bool]  # a jax.checkpoint policy
_POLICIES = jax.checkpoint_policies


# ModelConfig.remat -> the jax.checkpoint policy of ONE layer (the scan body). A policy is
# asked, for each primitive of the layer, whether its output may be saved for the backward
# pass; what it refuses is recomputed from what it saved, inside the backward loop.
REMAT_POLICIES: dict[str, Policy | None] = {
    # No checkpoint: autodiff saves whatever the backward pass reads: per layer the norm
    # outputs and statistics, q and k after RoPE, v, the attention output and its rows'
    # log-sum-exp (layers.recompute_attention, the default off-GPU, saves no [b,H,T,T]
    # array), SwiGLU's three [b,T,F] (h1, h3 and W2's input: layers.swiglu_gate recomputes the
    # sigmoid in its backward); twinshard/cost/memory.py lists them exactly.
    "none": None,
    # Save nothing inside the layer: the forward loop keeps each layer's input [b,T,D] (the
    # checkpoint's argument), the backward loop re-runs the layer's forward first.
    "full": _POLICIES.nothing_saveable,
    # Save every dot_general output: the 7 projections AND attention's QK^T scores
    # [b,H,T,T] and AV output; recompute norms, RoPE, softmax, SiLU (elementwise work).
    "dots": _POLICIES.dots_saveable,
    # Save the dot_generals without batch dimensions. `layers.linear` is a 2-D dot on
    # [B*T, in] rows (or einsum('...i,io->...o'): B and T free dimensions either way), so the
    # 7 projections ARE saved; attention's two einsums batch over (B, h) and are recomputed
    # (no [b,H,T,T] residual; Korthikanti et al. 2022's "selective recomputation" of the
    # attention core).
    "dots_no_batch": _POLICIES.dots_with_no_batch_dims_saveable,
    # By name (jax.ad_checkpoint.checkpoint_name in the layer math; MaxText's policies): q, k, v
    # after projection; the backward loop recomputes the rest of the layer from them and the input.
    "save_qkv_proj": _POLICIES.save_only_these_names(*attention.QKV_NAMES),
    # Every projection (q, k, v, the attention output before and after output_proj, SwiGLU's w1,
    # w3 and w2 outputs) and the attention kernel's out and log-sum-exp: the backward loop
    # recomputes norms, RoPE and SwiGLU's gate alone, never a matmul or the attention core.
    # (MaxText's "minimal" is dots_with_no_batch_dims, which here recomputes the attention core.)
    "minimal": _POLICIES.save_only_these_names(*attention.QKV_NAMES, attention.CONTEXT, attention.OUT_PROJ,
                                               *layers.MLP_IN, layers.MLP_OUT, layers.ATTENTION_RESIDUALS),
}
# Not offered (JAX 0.12's jax.checkpoint_policies): the offload policies
# (`offload_dot_with_no_batch_dims`, `save_and_offload_only_these_names`) move residuals to
# pinned host memory, which XLA:CPU does not separate from device memory (nothing the tests
# could measure). `save_anything_except_these_names` is a stub in 0.12.0.1 (read: it returns
# `lambda *_, **__: True`, saving everything); `save_any_names_but_these` is its working form.


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
    """FSDP's remat rule, the same in the manual and explicit twins (mixed in before the twin's
    hooks class): no gathered weight is kept for the backward pass. Each layer is checkpointed
    under every ModelConfig.remat with its policy (none: everything autodiff saves) minus the
    gathered weights, so the backward loop re-gathers each layer's matrices in its own iteration;
    the lm_head likewise. A twin says what a gathered weight is in a jaxpr: `gathers(prim, **params)`.
    A checkpoint around the whole loss would override the layer's policy and re-gather every
    layer's weights at once: jax.checkpoint policies do not nest (measured, JAX 0.12)."""

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
        """lm_head(x) checkpointed: the backward pass re-gathers the lm_head weight instead of
        keeping it (the embedding's backward is a scatter-add that reads no table)."""
        return jax.checkpoint(lm_head, policy=self.never_gathered(jax.checkpoint_policies.everything_saveable))(x)
