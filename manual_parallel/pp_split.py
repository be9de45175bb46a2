"""zb_h1's split backward in the manual twin: B, the gradient of a stage's input alone, and W, the
gradient of its blocks' weights alone, from what B keeps (docs/pipelines.md, "The split backward").

B (`SplitBackward.input_grad`), on the stage's input [B/M, T, D]: the stage's blocks with every op
that applies a parameter tapped (twinshard/model/taps.py: each matmul and norm gain records its
weight-free operand and adds a zero probe to its output), then jax.vjp with respect to (the input,
the probes) alone. Out come the input's gradient [B/M, T, D], sent back at once, and each probe's
cotangent, its op's output gradient dy. The blocks' params are not differentiated: no weight-gradient
matmul. B keeps the operands and the dy's (the stash, stacked [L/S, ...]) until W.
W (`SplitBackward.weight_grad`): each op re-applied to its kept operand and the vjp of those outputs
with respect to the params, with the dy's: x^T dy per matrix, sum_rows(dy x^) per norm gain, added
layer by layer into the gradient sums in place. No input-gradient matmul, no attention, no forward
re-run.

Only the blocks are split. The head (ln_final, lm_head, the loss; the last stage) runs its whole
backward in B, its weight gradient added in place under its lax.cond (manual_parallel/pp.py
`_output_grad`): deferring it would keep the logits' gradient [B/M, T, V] in every stage's stash. The
embedding's gradient is added in B too, under its own lax.cond on virtual stage 0 (pp.py
`_add_embedding_grad`), as in 1F1B's backward.
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

EMBED, HEAD = ("token_embeddings",), ("ln_final", "lm_head")  # the params outside the blocks


def add_rows(sums, d_rows, start):
    """sums (leaves [n, ...]) with d_rows (leaves [k, ...]) added into rows [start, start + k), in place: a
    dynamic-update-slice of those rows' sum, so only they are read and written (the transpose of a slice
    would zero-fill all n rows and add them all). W adds a layer's rows, pp.py a chunk's."""
    def add(s, d):
        k = d.shape[0]
        return lax.dynamic_update_slice_in_dim(s, lax.dynamic_slice_in_dim(s, start, k, 0) + d.astype(s.dtype),
                                               start, 0)

    return jax.tree.map(add, sums, d_rows)


class Shapes(NamedTuple):
    """A block's recording, traced once: its probes' (= its dy's) and its operands' shapes, and the
    operand each op reads (taps.Tape.slots)."""

    probes: list
    inputs: list
    slots: list[int]


class SplitBackward:
    """B and W of one stage's blocks in a pipeline run by hand (manual_parallel/pp.py `_scheduled`), on
    `layers` (the stage's [L/S, ...] block params) with hooks `par`; `varying` types an array as the
    stage's activations (PipelineRunner._varying); `act`: one micro-batch's activations [B/M, T, D]."""

    def __init__(self, cfg, layers, par, varying, act: jax.Array):
        self.cfg, self.layers, self.varying, self.act = cfg, layers, varying, act
        # the hooks with the head not checkpointed (FSDP's `head` is: manual_parallel/fsdp.py): a tape's
        # operands must be values of the trace that records them, and B's forward and backward share a tick
        self.par = copy.copy(par)
        self.par.head = lambda lm_head, x: lm_head(x)
        self.layer_def = layer_graphdef(cfg)
        self.shapes = self._trace(jax.tree.map(lambda w: w[0], layers))
        self.depth = jax.tree.leaves(layers)[0].shape[0]  # L/S

    def _block(self, layer: dict, x: jax.Array) -> jax.Array:
        return nnx.merge(self.layer_def, layer)(x, self.par)

    def _trace(self, layer) -> Shapes:
        """A block's recording without probes, traced for its shapes (jax.eval_shape)."""
        found = {}

        def record(p):
            with taps.recording() as tape:
                self._block(p, self.act)
            tape.check(len(jax.tree.leaves(p)), "the split backward, a block")
            found.update(probes=tape.outputs, slots=tape.slots)
            return tape.inputs

        inputs = jax.eval_shape(record, layer)
        return Shapes(found["probes"], inputs, found["slots"])

    def _zeros(self, shapes) -> list:
        """Zeros of each shape stacked [L/S, ...], typed as the stage's activations."""
        return [self.varying(jnp.zeros((self.depth, *s.shape), s.dtype)) for s in shapes]

    def stash_shapes(self) -> list:
        """Zeros of the stash one B keeps for its W (the blocks' operands, then their dy's): a ring slot."""
        return self._zeros(self.shapes.inputs) + self._zeros(self.shapes.probes)

    def _blocks(self, x, probes: list):
        """(the blocks' output [B/M, T, D], their operands stacked [L/S, ...]) on x with the probes added."""
        def block(x, layer_and_probes):  # x [B/M, T, D]; one layer's params and probes
            layer, layer_probes = layer_and_probes
            with taps.recording(layer_probes) as tape:
                x = self._block(layer, x)
            return x, [self.varying(a) for a in tape.inputs]

        return lax.scan(block, x, (self.layers, probes))

    def input_grad(self, inputs, output_grad):
        """B: (the gradient of the blocks' input [B/M, T, D], the stash for W, aux) where output_grad maps
        the blocks' output to (its gradient, aux) (pp.py `_output_grad`: the head's backward on the last
        stage, what the next stage sent elsewhere)."""
        out, pullback, operands = jax.vjp(self._blocks, inputs, self._zeros(self.shapes.probes), has_aux=True)
        d_out, aux = output_grad(out)
        d_inputs, dys = pullback(d_out)
        return d_inputs, operands + dys, aux

    def weight_grad(self, stash: list, sums: dict) -> dict:
        """W: `sums` (like the blocks' params [L/S, ...]) with the blocks' weight gradient from a B's stash
        added, layer by layer in place (`add_rows` of layer l's row: no [L/S, ...] gradient built and then
        added)."""
        n = len(self.shapes.inputs)
        operands, dys = stash[:n], stash[n:]

        def outputs(ins):
            def replayed(p):
                with taps.replaying(ins, self.shapes.slots) as tape:
                    self._block(p, self.act)
                return tape.outputs
            return replayed

        def block(sums, xs):  # layer l's params, operands and dy's
            l, layer, ins, dy = xs
            d_layer = jax.vjp(outputs(ins), layer)[1](dy)[0]
            return add_rows(sums, jax.tree.map(lambda d: d[None], d_layer), l), None

        # unrolled: in a loop the stash's slot and the sums travel as the loop's operands, in its layout, and
        # XLA:TPU copied each whole stash ring and the w1 / w3 sums into it every W (gpt2_350m, v5e:2x2: 1.85
        # GB, 3.0 of the W's 4.9 ms); unrolled, each dot reads its layer's rows where they are
        return lax.scan(block, sums, (jnp.arange(self.depth), self.layers, operands, dys), unroll=True)[0]
