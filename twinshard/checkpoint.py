"""Orbax checkpoints of the train state, with a compatibility check before restore.

Layout: `<workdir>/checkpoints/<step>/{state,meta}`. `meta` is JSON: the model
config (must match to restore), the train config and the data description.
Orbax writes each step into a temporary directory and renames it when complete,
so an interrupted save never leaves a checkpoint that looks valid.

Restore takes an *abstract* state (ShapeDtypeStructs, with shardings under a
strategy), so a checkpoint written under one strategy restores under another:
Orbax reads each shard where the target sharding wants it.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from twinshard.trainer import TrainState


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into this run (corrupt or incompatible)."""


def _manager(directory: str, create: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=3, create=create)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                 item_names=("state", "meta"))


class Checkpointer:
    def __init__(self, directory: str):
        self.directory = directory
        self._mgr = _manager(directory, create=True)

    def save(self, step: int, state: TrainState, meta: dict[str, Any]) -> None:
        self._mgr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self._mgr.wait_until_finished()

    def restore(self, abstract: TrainState, expect: dict[str, Any], step: int | None = None
                ) -> tuple[TrainState, dict[str, Any]]:
        """Restore `step` (default: latest) into the layout of `abstract`.

        `expect` maps metadata keys to what this run needs, e.g. {"model": asdict(model_cfg)};
        any difference is a CheckpointError naming the fields, raised before reading arrays.
        """
        step = self._mgr.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory!r}; drop --resume or pass "
                                  "the --workdir of an earlier run.")
        meta = self.read_meta(step)
        for key, want in expect.items():
            _check_same(key, meta.get(key), want, f"{self.directory}/{step}")
        try:
            restored = self._mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))
        except Exception as e:  # orbax raises many types for truncated/garbled files
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} is corrupt or unreadable ({type(e).__name__}: "
                f"{str(e)[:300]}); delete that step directory to fall back to an earlier one, "
                "or start a fresh --workdir.") from e
        return restored.state, meta

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of `step` (default: latest): configs, data, strategy."""
        step = self._mgr.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory!r}; train first or pass the "
                                  "--workdir of an earlier run.")
        try:
            return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} has no readable metadata ({type(e).__name__}); "
                "it is corrupt or not a twinshard checkpoint: delete it or use a fresh --workdir.") from e


def _check_same(key: str, saved: Any, want: Any, where: str) -> None:
    if saved == want:
        return
    if isinstance(want, dict) and isinstance(saved, dict):
        diff = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
    else:
        diff = {key: (saved, want)}
    raise CheckpointError(
        f"checkpoint {where} was written with a different {key} ((checkpoint, this run) = {diff}); "
        "pass the same settings as the run that wrote it, or use a fresh --workdir.")
