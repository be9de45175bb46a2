"""The predicted step beside a measured profile of the same program, in one trace for Perfetto UI.

    uv run --extra tpu python -m launch.collectives ... --topology=v5e:1x1 --trace=predicted.json
    python -m launch.bench ... --profile=prof                      # on the chip: the measured steps
    python tools/trace_beside.py --predicted=predicted.json \\
        --measured=prof/single/plugins/profile/*/perfetto_trace.json.gz --out=both.json.gz

writes one trace-event file (gzipped where --out ends in .gz) holding the measured trace's events as
they are and the prediction's (twinshard/hlo/trace.py) as processes after them, its step starting where
the first measured event named --step starts (or at --at_us): open it in ui.perfetto.dev.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from twinshard.hlo.trace import beside  # noqa: E402

flags.DEFINE_string("predicted", None, "launch.collectives --trace's file.", required=True)
flags.DEFINE_string("measured", None, "A jax.profiler perfetto_trace.json.gz (or .json); a glob matching one file.",
                    required=True)
flags.DEFINE_string("out", None, "The file to write (.json or .json.gz).", required=True)
flags.DEFINE_string("step", "train_step", "Align the prediction with the first measured event whose name has this.")
flags.DEFINE_float("at_us", None, "Put the prediction's start here (µs of the measured trace) instead.")
FLAGS = flags.FLAGS


def _open(path: str, mode: str):
    return gzip.open(path, mode) if path.endswith(".gz") else open(path, mode)


def main(argv):
    del argv
    found = sorted(glob.glob(FLAGS.measured))
    if len(found) != 1:
        sys.exit(f"--measured={FLAGS.measured} matches {len(found)} files ({found[:3]}); name one trace.")
    if os.path.isdir(FLAGS.out) or not os.path.isdir(os.path.dirname(os.path.abspath(FLAGS.out))):
        sys.exit(f"--out={FLAGS.out}: pass a file path in an existing directory.")
    with _open(FLAGS.predicted, "rt") as f:
        predicted = json.load(f)
    with _open(found[0], "rt") as f:
        measured = json.load(f)
    try:
        both, at = beside(predicted, measured, FLAGS.step, FLAGS.at_us)
    except ValueError as e:
        sys.exit(str(e))
    with _open(FLAGS.out, "wt") as f:
        json.dump(both, f)
    print(f"wrote {FLAGS.out}: {found[0]} and the prediction from {at:.3f} us (ui.perfetto.dev: Open trace file)")


if __name__ == "__main__":
    app.run(main)
