"""Orbax checkpoints of the train state, with a compatibility check before restore.

Layout: `<workdir>/checkpoints/<step>/{state,meta}`, `meta` the JSON configs and data description.
Restore reads every array into the sharding its abstract leaf names, so a checkpoint written on N
devices under one strategy restores on M under another. Measured (orbax-checkpoint 0.12.8): a leaf
without a sharding falls back to the writer's devices ("Topology mismatch detected"), so such leaves
are placed on this process's first device. A failed restore is called corrupt only if the files
cannot be read at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import tempfile
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import SingleDeviceSharding

from twinshard.train.trainer import TrainState


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into this run (unreadable or incompatible)."""


# Orbax (0.12.8) saves a replicated array "replica-parallel": each replica slices off its share of the
# shard with an eager jax.lax.slice_in_dim, one XLA compile per leaf shape, sharding and slice
# (measured: 150 compiles and 22 of 33 s of CPU to save the tiny model's initial state under 11
# strategies, tests/test_train.py). The shares spread a large array's writes over hosts; below
# MIN_REPLICA_SLICE_BYTES a share is not worth its compile, and one replica writes the whole shard.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _use_replica_parallel_only_above(min_bytes: int) -> None:
    """Set Orbax's registered jax.Array handler to save replica-parallel only slices of at least
    `min_bytes` (ArrayHandler's min_slice_bytes_for_replica_parallel). Set on the handler itself:
    registering a new one makes Orbax log a warning on stderr (tests/test_multiprocess.py reads a
    lost run's stderr as one line). An Orbax without the attribute keeps its own behaviour."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if hasattr(handler, "_min_slice_bytes_for_replica_parallel"):
        handler._min_slice_bytes_for_replica_parallel = min_bytes


_use_replica_parallel_only_above(MIN_REPLICA_SLICE_BYTES)


def _manager(directory: str, create: bool, keep: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                 item_names=("state", "meta"))


def on_local_device(abstract: TrainState) -> TrainState:
    """Give every leaf that has no sharding one: this process's first device."""
    device = SingleDeviceSharding(jax.local_devices()[0])

    def fill(leaf):
        if getattr(leaf, "sharding", None) is not None:
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device)

    return jax.tree.map(fill, abstract)


class Checkpointer:
    def __init__(self, directory: str, create: bool = True, keep: int = 3):
        """`create=False` (readers such as launch.sample) never makes the directory; `keep` latest kept."""
        self.directory = directory
        self._mgr = _manager(directory, create=create, keep=keep)

    def save(self, step: int, state: TrainState, meta: dict[str, Any], wait: bool = True) -> None:
        """Save `state` as step `step`; wait=False returns once the arrays are off the devices (an
        incomplete checkpoint never appears under its step's name)."""
        self._mgr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until every save in flight is on disk."""
        self._mgr.wait_until_finished()

    def delete(self, step: int) -> None:
        self.wait()
        self._mgr.delete(step)

    def steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def restore(self, abstract: TrainState, expect: dict[str, Any], step: int | None = None
                ) -> tuple[TrainState, dict[str, Any]]:
        """Restore `step` (default: latest) into `abstract`'s layout; a metadata difference from `expect`
        is a CheckpointError naming the fields, raised before reading arrays."""
        step = self._step(step)
        meta = self.read_meta(step)
        for key, want in expect.items():
            _check_same(key, meta.get(key), want, self.step_dir(step))
        _ignore_late_callbacks()
        with _stderr_held_on_failure():
            try:
                restored = self._mgr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(on_local_device(abstract))))
            except Exception as e:  # orbax raises many types; say which kind of failure it is
                raise self._restore_error(step, e) from None
        return restored.state, meta

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of `step` (default: latest): configs, data, strategy."""
        step = self._step(step)
        with _stderr_held_on_failure():
            try:
                return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            except Exception as e:
                raise self._restore_error(step, e) from None

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _step(self, step: int | None) -> int:
        step = self._mgr.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory!r}; train first, or pass the "
                                  "--workdir of an earlier run.")
        return step

    def _restore_error(self, step: int, error: Exception) -> CheckpointError:
        """'corrupt' only if the files cannot be read without any target layout."""
        where = self.step_dir(step)
        problem = unreadable(where)
        if problem is None:
            return CheckpointError(
                f"checkpoint step {step} in {where} is readable but does not restore into this run: "
                f"{_first_line(error)}. It may come from another twinshard version; run the version "
                "and settings that wrote it, or start a fresh --workdir (the checkpoint is left as it is).")
        earlier = [s for s in self.steps() if s < step]
        fallback = (f"To resume from step {earlier[-1]}, move {where} out of {self.directory}, "
                    "or start a fresh --workdir." if earlier else "Start a fresh --workdir.")
        return CheckpointError(f"checkpoint step {step} in {where} is corrupt: {problem}.\n{fallback}")


def unreadable(step_dir: str) -> str | None:
    """Why the checkpoint in `step_dir` cannot be read at all, as plain NumPy (None: it reads)."""
    _ignore_late_callbacks()
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            if name in ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata") \
                    or os.path.basename(root) == "array_metadatas":
                try:
                    with open(path, "rb") as f:
                        json.loads(f.read())
                except (OSError, ValueError) as e:
                    return f"{path} is not readable JSON ({_first_line(e)})"
    state_dir = os.path.join(step_dir, "state")
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # Orbax warns that a plain PyTree read lacks step metadata
    try:
        checkpointer = ocp.PyTreeCheckpointer()
        metadata = checkpointer.metadata(state_dir).item_metadata
        if metadata is None:  # Orbax logs why and returns None
            return f"the array index in {state_dir} (manifest.ocdbt and d/) does not read"
        tree = metadata.tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=args))
    except Exception as e:
        return f"the arrays in {state_dir} do not read ({_first_line(e)})"
    finally:
        logging.set_verbosity(verbosity)
    return None


@contextlib.contextmanager
def _stderr_held_on_failure():
    """Hold fd 2 while Orbax reads; pass it on if the read works, drop it on failure (measured, orbax
    0.12.8: a failed read's abandoned coroutines print tracebacks when collected)."""
    sys.stderr.flush()
    real = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            if failed:
                gc.collect()
            sys.stderr.flush()
            os.dup2(real, 2)
            os.close(real)
            if not failed or os.environ.get("TWINSHARD_DEBUG", "0") not in ("", "0"):
                held.seek(0)
                with os.fdopen(os.dup(2), "wb") as err:
                    err.write(held.read())


def _ignore_late_callbacks() -> None:
    """Drop tensorstore's late callbacks into Orbax's closed event loop (measured, orbax 0.12.8,
    tensorstore 0.1.86: dozens of 'Event loop is closed' tracebacks after one failed read)."""
    previous = sys.excepthook
    if getattr(previous, "_twinshard_quiet", False):
        return

    def late(kind, value) -> bool:
        return kind is RuntimeError and str(value) == "Event loop is closed"

    def hook(kind, value, tb):
        if not late(kind, value):
            previous(kind, value, tb)

    # under load some arrive through sys.unraisablehook and threading.excepthook instead (measured)
    previous_unraisable, previous_thread = sys.unraisablehook, threading.excepthook

    def unraisable(u):
        if not late(u.exc_type, u.exc_value):
            previous_unraisable(u)

    def thread(args):
        if not late(args.exc_type, args.exc_value):
            previous_thread(args)

    hook._twinshard_quiet = True
    sys.excepthook, sys.unraisablehook, threading.excepthook = hook, unraisable, thread


def _first_line(error: BaseException) -> str:
    """The innermost cause's message, first line, at most 300 characters (Orbax nests them)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def _field_defaults() -> dict[str, dict[str, Any]]:
    from twinshard.config import ModelConfig, TrainConfig

    return {key: {f.name: f.default for f in dataclasses.fields(c)}
            for key, c in (("model", ModelConfig), ("train", TrainConfig))}


def model_difference(saved: Any, want: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (checkpoint's, this run's)} where a checkpoint's model config differs from `want` (a checkpoint
    without one: every field)."""
    return _differing("model", saved if isinstance(saved, dict) else {}, want)


def _differing(key: str, saved: dict[str, Any], want: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """A field added after a checkpoint was written reads as its default there (its value shown as None)."""
    defaults = _field_defaults().get(key, {})
    return {k: (saved.get(k), v) for k, v in want.items() if saved.get(k, defaults.get(k)) != v}


def _check_same(key: str, saved: Any, want: Any, where: str) -> None:
    """A field added after a checkpoint was written reads as its default there, so older checkpoints restore."""
    if saved == want:
        return
    if isinstance(want, dict) and isinstance(saved, dict):
        diff = _differing(key, saved, want)
        if not diff:
            return
    else:
        diff = {key: (saved, want)}
    raise CheckpointError(
        f"checkpoint {where} was written with a different {key} ((checkpoint, this run) = {diff}); "
        "pass the same settings as the run that wrote it, or use a fresh --workdir.")
