"""zb_h1's split backward in the manual twin: B, the gradient of a stage's input alone, and W, the
gradient of its weights alone, from what B keeps (docs/pipelines.md, "The split backward").

B (`SplitBackward.input_grad`), on the stage's saved input [B/M, T, D]: the stage's forward with every
op that applies a parameter tapped (twinshard/model/taps.py: each matmul, norm gain and the embedding
records its weight-free operand and adds a zero probe to its output), then jax.vjp with respect to
(the input, the probes) alone. Out come the input's gradient [B/M, T, D], sent back at once, and each
probe's cotangent, its op's output gradient dy. The params are not differentiated: no weight-gradient
matmul. B keeps the operands and the dy's (the stash) until W.
W (`SplitBackward.weight_grad`): each op re-applied to its kept operand and the vjp of those outputs
with respect to the params, with the dy's: x^T dy per matrix, sum_rows(dy x^) per norm gain, a
scatter-add for the embedding. No input-gradient matmul, no attention, no forward re-run.

Three segments, each its own tape: the embedding (virtual stage 0, under lax.cond), the stage's L/S
blocks (one lax.scan; probes, operands and dy's stacked [L/S, ...]), the head (ln_final and lm_head,
the last stage, under lax.cond). A lax.cond's branches have one shape, so every stage keeps the
embedding's and the head's stash, zeros where the branch did not run.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from twinshard.model import taps
from twinshard.model.transformer import layer_graphdef
from twinshard.train.trainer import graphdef

EMBED, HEAD = ("token_embeddings",), ("ln_final", "lm_head")  # the params of the embedding and head segments


class Segments(NamedTuple):
    """One value per segment: the embedding's, the blocks' (stacked [L/S, ...]) and the head's lists."""

    embed: list
    layers: list
    head: list


class Shapes(NamedTuple):
    """A segment's recording, traced once: its probes' (= its dy's) and its operands' shapes, and the
    operand each op reads (taps.Tape.slots)."""

    probes: list
    inputs: list
    slots: list[int]


class SplitBackward:
    """B and W of one stage of a pipeline run by hand (manual_parallel/pp.py `_scheduled`), on `params`
    (the stage's: token_embeddings, layers [L/S, ...], ln_final, lm_head) with hooks `par`; `varying`
    types an array as the stage's activations (PipelineRunner._varying); `act`: one micro-batch's
    activations [B/M, T, D], `tokens` its ids [B/M, T]."""

    def __init__(self, cfg, params, par, varying, act: jax.Array, tokens: jax.Array):
        if set(params) != {*EMBED, "layers", *HEAD}:
            raise NotImplementedError(f"the split backward knows the params {EMBED + ('layers',) + HEAD}, "
                                      f"not {sorted(set(params) - {*EMBED, 'layers', *HEAD})}.")
        self.cfg, self.params, self.varying = cfg, params, varying
        # the hooks with the head not checkpointed (FSDP's `head` is: manual_parallel/fsdp.py): a tape's
        # operands must be values of the trace that records them, and B's forward and backward share a tick
        self.par = copy.copy(par)
        self.par.head = lambda lm_head, x: lm_head(x)
        self.layer_def = layer_graphdef(cfg)
        layer0 = jax.tree.map(lambda w: w[0], params["layers"])
        targets = jnp.zeros(tokens.shape, jnp.int32)
        self.shapes = Segments(
            self._trace(lambda p: self._model(p).embed(tokens, self.par), {k: params[k] for k in EMBED}, "the embedding"),
            self._trace(lambda p: self._block(p, act), layer0, "a block"),
            self._trace(lambda p: self._model(p).head_loss(act, targets, self.par), {k: params[k] for k in HEAD},
                        "the head"))
        self.depth = jax.tree.leaves(params["layers"])[0].shape[0]  # L/S
        self.act, self.tokens = act, tokens

    def _model(self, part: dict):
        """The model on the params with `part` (some of their top-level entries) swapped in."""
        return nnx.merge(graphdef(self.cfg), {**self.params, **part})

    def _block(self, layer: dict, x: jax.Array) -> jax.Array:
        return nnx.merge(self.layer_def, layer)(x, self.par)

    @staticmethod
    def _trace(segment, part, where: str) -> Shapes:
        """The segment's recording without probes, traced for its shapes (jax.eval_shape)."""
        found = {}

        def record(p):
            with taps.recording() as tape:
                segment(p)
            tape.check(len(jax.tree.leaves(p)), f"the split backward, {where}")
            found.update(probes=tape.outputs, slots=tape.slots)
            return tape.inputs

        inputs = jax.eval_shape(record, part)
        return Shapes(found["probes"], inputs, found["slots"])

    def _zeros(self, shapes, stack: int = 0) -> list:
        """Zeros of each shape (stacked [stack, ...] when stack > 0), typed as the stage's activations."""
        lead = (stack,) if stack else ()
        return [self.varying(jnp.zeros(lead + tuple(s.shape), s.dtype)) for s in shapes]

    def _kept(self, tape) -> list:
        return [self.varying(a) for a in tape.inputs]

    def _segments(self, field: str) -> Segments:
        """Zeros of each segment's probes or operands (`field`), the blocks' stacked [L/S, ...]."""
        return Segments(*(self._zeros(getattr(s, field), n) for s, n in zip(self.shapes, (0, self.depth, 0))))

    def stash_shapes(self) -> list:
        """Zeros of the stash one B keeps for its W (operands, then dy's, per segment): a ring slot."""
        return jax.tree.leaves((self._segments("inputs"), self.probes()))

    def probes(self) -> Segments:
        return self._segments("probes")

    def _unstash(self, stash: list) -> tuple[Segments, Segments]:
        return jax.tree.unflatten(jax.tree.structure((self._segments("inputs"), self.probes())), stash)

    def _forward(self, arrived, probes: Segments, tokens, targets, first, last):
        """((the stage's output [B/M, T, D], its loss), the operands per segment) with the probes added."""
        def embedded():
            with taps.recording(probes.embed) as tape:
                x = self._model({}).embed(tokens, self.par)
            return x, self._kept(tape)

        x, embed_in = lax.cond(first, embedded, lambda: (arrived, self._zeros(self.shapes.embed.inputs)))

        def block(x, layer_and_probes):  # x [B/M, T, D]; one layer's params and probes
            layer, layer_probes = layer_and_probes
            with taps.recording(layer_probes) as tape:
                x = self._block(layer, x)
            return x, self._kept(tape)

        out, layer_in = lax.scan(block, x, (self.params["layers"], probes.layers))

        def head(o):
            with taps.recording(probes.head) as tape:
                loss = self._model({}).head_loss(o, targets, self.par)
            return loss, self._kept(tape)

        loss, head_in = lax.cond(last, head, lambda o: (self.varying(jnp.zeros((), jnp.float32)),
                                                        self._zeros(self.shapes.head.inputs)), out)
        return (out, loss), Segments(embed_in, layer_in, head_in)

    def input_grad(self, arrived, tokens, targets, out_grad, seed, first, last) -> tuple[jax.Array, list]:
        """B: (the gradient of the stage's input [B/M, T, D], the stash for W) given its output's gradient
        and `seed`, d(step loss)/d(this micro-batch's loss) (first / last: virtual stage 0 / the last)."""
        _, pullback, inputs = jax.vjp(lambda a, p: self._forward(a, p, tokens, targets, first, last),
                                      arrived, self.probes(), has_aux=True)
        d_arrived, dys = pullback((out_grad, seed))
        return d_arrived, jax.tree.leaves((inputs, dys))

    def weight_grad(self, stash: list, first, last) -> dict:
        """W: the gradient of every param (like `params`) from a B's stash."""
        inputs, dys = self._unstash(stash)

        def replayed(segment, shapes: Shapes, ins):
            def outputs(p):
                with taps.replaying(ins, shapes.slots) as tape:
                    segment(p)
                return tape.outputs
            return outputs

        def vjp(f, p, ct):
            return jax.vjp(f, p)[1](ct)[0]

        def block(_, xs):  # one layer's params, operands and dy's
            layer, ins, dy = xs
            return None, vjp(replayed(lambda p: self._block(p, self.act), self.shapes.layers, ins), layer, dy)

        _, d_layers = lax.scan(block, None, (self.params["layers"], inputs.layers, dys.layers))
        embed = replayed(lambda p: self._model(p).embed(self.tokens, self.par), self.shapes.embed, inputs.embed)
        head = replayed(lambda p: self._model(p).head_loss(self.act, jnp.zeros(self.tokens.shape, jnp.int32), self.par),
                        self.shapes.head, inputs.head)
        part = lambda keys: {k: self.params[k] for k in keys}  # noqa: E731
        zeros = lambda keys: jax.tree.map(jnp.zeros_like, part(keys))  # noqa: E731
        d_embed = lax.cond(first, lambda: vjp(embed, part(EMBED), dys.embed), lambda: zeros(EMBED))
        d_head = lax.cond(last, lambda: vjp(head, part(HEAD), dys.head), lambda: zeros(HEAD))
        return {**d_embed, "layers": d_layers, **d_head}
