"""Loss curves of several training runs in one PNG, from each run's `<workdir>/metrics.jsonl`
(launch.train), with each curve's difference from the first run's below it.

int8 against bf16 on the embedded corpus (tiny on a CPU in ~2 minutes each; llama_v5e on a TPU):

    python -m launch.train --preset=tiny --dtype=bfloat16 --steps=300 --log_every=10 --workdir=runs/bf16
    python -m launch.train --preset=tiny --dtype=bfloat16 --steps=300 --log_every=10 --quantization=int8 \\
        --workdir=runs/int8
    python tools/loss_curves.py --run=bf16=runs/bf16 --run=int8=runs/int8 --out=int8_vs_bf16.png

Prints each run's loss at every step all runs logged, the largest |difference| from the first run, and
the last held-out loss of each. Every input is read, and --out checked, before anything is written.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import common  # noqa: E402

flags.DEFINE_multi_string("run", [], "LABEL=WORKDIR: a launch.train --workdir with a metrics.jsonl (at least one).")
flags.DEFINE_string("out", None, "The PNG to write (required).")
flags.DEFINE_bool("force", False, "Overwrite --out if it exists.")
FLAGS = flags.FLAGS


def read_run(spec: str) -> tuple[str, dict[int, float], dict[int, float]]:
    """--run=LABEL=WORKDIR -> (label, {step: training loss}, {step: held-out loss})."""
    label, sep, workdir = spec.partition("=")
    if not sep or not label or not workdir:
        raise ValueError(f"--run={spec}: expected LABEL=WORKDIR, e.g. --run=int8=runs/int8.")
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"--run={spec}: no {path}; train into it first (python -m launch.train --workdir={workdir}).")
    loss, held_out = {}, {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"--run={spec}: {path} line {n} is not JSON; rerun that training.") from None
            if "loss" in record:
                loss[int(record["step"])] = float(record["loss"])
            if "eval_loss" in record:
                held_out[int(record["step"])] = float(record["eval_loss"])
    if not loss:
        raise ValueError(f"--run={spec}: {path} has no training loss; train with --log_every at most --steps.")
    return label, loss, held_out


def report(runs: list[tuple[str, dict, dict]]) -> str:
    """The losses at the steps every run logged, the largest |difference| from the first run, the last held-out losses."""
    labels = [label for label, _, _ in runs]
    steps = sorted(set.intersection(*(set(loss) for _, loss, _ in runs)))
    lines = [f"{'step':>6} " + " ".join(f"{label:>10}" for label in labels)]
    lines += [f"{s:6d} " + " ".join(f"{loss[s]:10.4f}" for _, loss, _ in runs) for s in steps]
    first = runs[0][1]
    for label, loss, held_out in runs:
        gap = max((abs(loss[s] - first[s]) for s in steps), default=0.0)
        last = f", last held-out loss {held_out[max(held_out)]:.4f} (step {max(held_out)})" if held_out else ""
        lines.append(f"{label}: max |loss - {labels[0]}| {gap:.4f} over {len(steps)} steps{last}")
    return "\n".join(lines)


def plot(runs: list[tuple[str, dict, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    first_label, first, _ = runs[0]
    for i, (label, loss, held_out) in enumerate(runs):
        color = f"C{i}"
        sparse = len(loss) < 10  # a run that logged a few steps: its points alone, no line across the gaps
        top.plot(sorted(loss), [loss[s] for s in sorted(loss)], color=color, lw=2.4 - i * 0.6, ls="" if sparse else "-",
                 marker="s" if sparse else None, label=f"{label} (train{f', {len(loss)} steps logged' if sparse else ''})")
        if held_out:
            top.plot(sorted(held_out), [held_out[s] for s in sorted(held_out)], color=color, ls="", marker="o",
                     label=f"{label} (held out)")
        common_steps = sorted(set(loss) & set(first))
        if i:
            few = len(common_steps) < 10
            bottom.plot(common_steps, [loss[s] - first[s] for s in common_steps], color=color, ls="" if few else "-",
                        marker="s" if few else None, label=f"{label} - {first_label}")
    top.set_ylabel("loss")
    top.set_title(" vs ".join(label for label, _, _ in runs))
    top.legend()
    bottom.axhline(0.0, color="k", lw=0.8)
    bottom.set_xlabel("step")
    bottom.set_ylabel("training loss difference")
    if len(runs) > 1:
        bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    if not FLAGS.run:
        raise ValueError("--run: give at least one LABEL=WORKDIR, e.g. --run=bf16=runs/bf16 --run=int8=runs/int8.")
    if not FLAGS.out:
        raise ValueError("--out: the PNG to write is required, e.g. --out=int8_vs_bf16.png.")
    runs = [read_run(spec) for spec in FLAGS.run]
    labels = [label for label, _, _ in runs]
    if len(set(labels)) < len(labels):
        raise ValueError(f"--run: the labels {labels} repeat; give each run its own.")
    common.check_output_path(FLAGS.out, "out", FLAGS.force)
    print(report(runs))
    plot(runs, FLAGS.out)
    print(f"plot: {FLAGS.out}")


if __name__ == "__main__":
    common.run(main, "tools/loss_curves.py")
