"""tools/predict_chip.py: its runs are configurations the project accepts, its kinds are the
profile's, and a bad --only is one line before anything compiles (the predictions themselves
compile for a v5e and are a benchmark: BENCHMARKS.md, "Step time predicted from the compiled program")."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import pytest

from tools import predict_chip
from twinshard.config import preset


def test_every_run_is_a_configuration_the_project_accepts():
    for run in predict_chip.RUNS:
        cfg = preset(run.preset)
        model = dataclasses.replace(cfg.model, **run.model)  # an unknown or invalid field raises
        assert model.dtype == "bfloat16" and run.measured_ms > 0, run.name
        assert run.profile_ms is None or set(run.profile_ms) == set(predict_chip.KINDS), run.name


def test_the_predicted_kinds_are_the_profiles():
    pred = types.SimpleNamespace(by_kind=lambda: {"matmul": 0.010, "attention": 0.002, "memory": 0.003,
                                                  "custom": 0.001})
    assert predict_chip.by_kind(pred) == pytest.approx({"matmul": 10.0, "attention": 2.0, "memory": 4.0})


def test_an_unknown_run_is_one_line_before_compiling():
    out = subprocess.run([sys.executable, "-m", "tools.predict_chip", "--only=nope"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    (line,) = [l for l in out.stderr.splitlines() if "--only=nope" in l]
    assert "matches no run" in line and "llama_v5e no remat" in line
