"""launch.compare: single vs auto vs manual from one init, on the same batches.

On tests/runners.py's CFG (tiny, num_heads 8, grad_clip 0.25): its dp runners are
test_manual's, so their programs load from the compilation cache."""

import numpy as np

from launch import compare
from runners import CFG


def test_compare_runs_three_and_reports(tmp_path):
    cfg = CFG
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        b = rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.context_length + 1))
        batches.append((b[:, :-1].astype(np.int32), b[:, 1:].astype(np.int32)))
    result = compare.run_three("dp", None, cfg, batches)
    assert set(result["losses"]) == {"single", "auto", "manual"}
    for impl in ("auto", "manual"):
        np.testing.assert_allclose(result["losses"][impl], result["losses"]["single"], atol=2e-5)
        assert result[f"max_grad_diff_{impl}_vs_single"] < 1e-6
        assert result[f"max_param_diff_{impl}_vs_single"] < 2e-5
    text = compare.report(result, compare.model_comparison(result, cfg))
    assert "manual ledger vs cost model" in text and text.count(" ok") >= 2
    png = tmp_path / "losses.png"
    compare.plot(result, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
