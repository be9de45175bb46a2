"""Where an interleaved pipeline keeps its layers: chunks placed round-robin, stored device-major.

With S stages and V chunks per stage (--virtual_stages=V) the L layers form S V chunks of k = L/(S V)
consecutive layers. Chunk c (virtual stage c) runs on device c % S as that device's local chunk c // S,
as Megatron and torchtitan place them (pipeline.Action: virtual stage j on device j % S):

    L = 8, S = 2, V = 2, k = 2     chunk 0: layers 0 1 -> device 0, local chunk 0
                                   chunk 1: layers 2 3 -> device 1, local chunk 0
                                   chunk 2: layers 4 5 -> device 0, local chunk 1
                                   chunk 3: layers 6 7 -> device 1, local chunk 1

A stacked leaf [L, ...] split over `stage` gives device s the contiguous rows [s L/S, (s+1) L/S), so
the layers are stored in device-major order (`stored_order`, here layers 0 1 4 5 | 2 3 6 7): device
s's rows are its V chunks, local chunk 0 first, and [L, ...] reshapes to [S, V, k, ...] with no data
moving. MaxText stores its circular pipeline's weights so ([repeats, stages, layers per stage, ...]).
Reordering inside the step instead would move nearly every weight and gradient between devices once
per step (an all-to-all each way). The train state (params and optimizer moments) keeps the stored
order (in both twins: twinshard/placed.py's runners); `to_model` and `to_stored` convert a tree of
[L, ...] leaves under `layers` (V = 1: the identity)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

LAYERS = "layers"  # the param tree's key of the stacked blocks


def place(layer: int, num_layers: int, stages: int, virtual: int) -> tuple[int, int, int]:
    """(chunk, device, local chunk) of model layer `layer`: chunk c = layer // (L/(S V)), device
    c % S, local chunk c // S."""
    chunk = layer // (num_layers // (stages * virtual))
    return chunk, chunk % stages, chunk // stages


def stored_order(num_layers: int, stages: int, virtual: int) -> np.ndarray:
    """[L] int: the model layer stored at row p of a stacked leaf (device-major, then local chunk,
    then the layer's place in its chunk): rows [s L/S, (s+1) L/S) hold device s's chunks."""
    def key(layer):
        _, device, local = place(layer, num_layers, stages, virtual)
        return device, local, layer
    return np.asarray(sorted(range(num_layers), key=key))


def _permute_layers(tree: Any, rows: np.ndarray) -> Any:
    """Each leaf under a `layers` key with leading dim L, its rows taken in the order `rows` (the
    identity order: the tree itself, so that V = 1 adds no gather to a program)."""
    if np.array_equal(rows, np.arange(len(rows))):
        return tree
    def take(path, leaf):
        under = any(getattr(k, "key", None) == LAYERS for k in path)
        return _rows(leaf, rows) if under and getattr(leaf, "ndim", 0) and leaf.shape[0] == len(rows) else leaf
    return jax.tree_util.tree_map_with_path(take, tree)


def _rows(leaf: Any, rows: np.ndarray) -> Any:
    """leaf[rows], keeping an array's sharding. An array split over an Explicit mesh axis (the manual
    twin's state) names its gather's output sharding: JAX 0.12 refuses that gather without
    out_sharding, and refuses out_sharding naming an Auto axis (the GSPMD twin's), measured."""
    if isinstance(leaf, jax.Array):
        sharding = jax.typeof(leaf).sharding
        if jax.sharding.AxisType.Explicit in sharding.mesh.axis_types and any(sharding.spec):
            return leaf.at[rows].get(out_sharding=sharding)
    return leaf[rows]


def to_stored(tree: Any, num_layers: int, stages: int, virtual: int) -> Any:
    """A tree (params, gradients, a TrainState) in model order -> in stored order."""
    return _permute_layers(tree, stored_order(num_layers, stages, virtual))


def to_model(tree: Any, num_layers: int, stages: int, virtual: int) -> Any:
    """A tree in stored order -> in model order (row l: model layer l)."""
    return _permute_layers(tree, np.argsort(stored_order(num_layers, stages, virtual)))
