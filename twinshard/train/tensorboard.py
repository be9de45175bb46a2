"""launch.train's records as TensorBoard scalars, beside metrics.jsonl, in the run's workdir.

`tensorboard --logdir=<workdir>` then shows the curves and, from the same folder, the traces of
`--profile_steps` (jax.profiler writes them to <workdir>/plugins/profile/<run>/, where TensorBoard's
profile plugin looks). Every number of a record becomes a scalar at the record's step, under the tag
`tag(key)`: the loss curves together under loss/, the throughput under speed/, memory under memory/.
The event files are tensorboardX's (TensorBoard's own protobuf records; float32 values).
"""

from __future__ import annotations

import os

# metrics.jsonl key -> TensorBoard tag; keys not named here go under tag()'s rule
TAGS = {
    "loss": "loss/train",
    "eval_loss": "loss/eval",
    "lr": "optimizer/lr",
    "grad_norm": "optimizer/grad_norm",
    "skipped": "optimizer/skipped",
    "tokens_per_s": "speed/tokens_per_s",
    "step_time": "speed/step_time_s",
    "tflops_per_device": "speed/tflops_per_device",
    "mfu": "speed/mfu",
    "peak_flops": "speed/peak_flops",
}


def tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key: TAGS's, memory/KEY for a byte count, train/KEY otherwise."""
    if key in TAGS:
        return TAGS[key]
    return f"memory/{key}" if "memory" in key or key.endswith("_bytes") else f"train/{key}"


def scalars(record: dict) -> dict[str, float]:
    """{tag: value} of every number in a metrics record but its step; a list of numbers (the router's
    tokens per expert) as one scalar per element, tagged `<tag>/<index>`."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if isinstance(v, (int, float)):
                out[tag(key) + (f"/{i}" if isinstance(value, list) else "")] = float(v)
    return out


class Scalars:
    """A TensorBoard event file in `logdir` that add() extends record by record (flushed each time: a
    preempted run keeps what it logged). A run resumed from step `start` > 0 opens a new file that
    marks step start + 1 as a restart: TensorBoard drops the earlier run's points from that step on,
    which the resumed run recomputes (as metrics.jsonl drops them)."""

    def __init__(self, logdir: str, start: int = 0):
        try:
            import tensorboardX
        except ImportError:
            raise ImportError("launch.train writes TensorBoard event files with tensorboardX, which is not "
                              "installed: `pip install tensorboardX` (uv sync installs it).") from None
        # tensorboardX names a file by the second it opened and the host, opened "wb": a run resumed
        # within the second of its predecessor would overwrite it without this suffix
        self.writer = tensorboardX.SummaryWriter(logdir=logdir, purge_step=start + 1 if start else None,
                                                 filename_suffix=f".from_step_{start}.{os.getpid()}")

    def add(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=record["step"])
        self.writer.flush()

    def __enter__(self) -> Scalars:
        return self

    def __exit__(self, *exc) -> None:
        self.writer.close()
