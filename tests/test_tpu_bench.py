"""tools/tpu_bench.sh --dry-run: the chip's one script runs its steps here on tiny shapes (JAX on the
CPU), so a broken flag or tool fails CI and not the session's few minutes on a TPU."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

import cli

ROOT = pathlib.Path(__file__).parents[1]


def test_tpu_bench_dry_run_benchmarks_profiles_and_prices_each_run(tmp_path):
    """Two runs (tiny, then int8_dw), each benchmarked and profiled in one process, each trace read back on
    the CPU and priced op by op."""
    # the launchers' environment (tests/cli.py): the fast compile setting and the compilation cache, no
    # device count in XLA_FLAGS (the script's launchers set their own devices)
    env = cli.env(OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(["bash", "tools/tpu_bench.sh", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    log = (tmp_path / "tpu_bench.log").read_text()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failed or timed out" not in log, log[-2000:]
    table = (tmp_path / "tpu_bench.md").read_text()
    assert table.count("\n| single |") == 2, table  # the run's row, then int8 matmuls beside it
    assert table.count("--quantization=int8_dw") == 1, table
    # each run's whole time and the call's, for a chip's call to show where its minutes go
    assert log.count(", process start to exit") == 2 and log.count("s into the call)") == 4 and "call: " in log, log
    assert "compiled in" in (tmp_path / "run2.log").read_text()
    for i in (1, 2):  # each run's own steps traced (launch.bench --profile), read back with no second compile
        assert "3 steps profiled into" in (tmp_path / f"run{i}.log").read_text()
        (run,) = json.loads((tmp_path / f"run{i}.json").read_text())["runs"]
        assert run["profile"] == str(tmp_path / f"trace{i}" / "single")
        profile = json.loads((tmp_path / f"profile{i}.json").read_text())
        assert profile["chip"] == "v5e" and profile["predicted_ms"] > 0
        ops = profile["ops"]
        measured = sum(o["measured_ms"] for o in ops)
        assert measured > 0 and {o["kind"] for o in ops} >= {"matmul", "memory"}
        # the profile's device time is the ops' time: every instruction it saw is one the prediction priced
        assert measured == pytest.approx(profile["measured_device_ms"], rel=1e-9)
