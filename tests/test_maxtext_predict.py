"""tools/maxtext_predict.py: MaxText's published v5e-256 models rebuilt from its pyconfig rules, the
presets that stand for them, and bad input refused before anything compiles."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))

import maxtext_predict as mp  # noqa: E402  (tools/ is not a package)
from twinshard.config import preset  # noqa: E402


def test_scales_rotate_heads_and_mlp_then_emb_then_layers():
    # pyconfig.get_individual_scales: 2 -> heads+mlp, 4 -> +emb, 8 -> +layers, then again
    assert [mp.individual_scales(s) for s in (1, 2, 4, 8, 16, 128)] == [
        (0, 0, 0, 0), (0, 1, 1, 0), (1, 1, 1, 0), (1, 1, 1, 1), (1, 2, 2, 1), (2, 3, 3, 2)]
    with pytest.raises(ValueError, match="global_parameter_scale=24 must be a power of 2"):
        mp.individual_scales(24)


@pytest.mark.parametrize("p", mp.PUBLISHED, ids=lambda p: p.case)
def test_published_model_has_its_name_and_its_mfu_is_its_tflops(p):
    billions = mp.maxtext_params(mp.maxtext_dims(p.scale)) / 1e9
    assert billions == pytest.approx(int(p.case.rstrip("b")), rel=0.02)
    assert p.tflops / (mp.PEAK_V5E / 1e12) == pytest.approx(p.mfu, abs=0.003)  # MFU = TFLOP/s / 197


@pytest.mark.parametrize("p", mp.PUBLISHED, ids=lambda p: p.case)
def test_preset_is_the_equivalent_with_a_layer_of_maxtexts_matmul_params(p):
    cfg = preset(p.preset)
    assert cfg.model == mp.equivalent(p)
    assert cfg.train.batch_size == p.per_device_batch * 256
    d = mp.maxtext_dims(p.scale)
    ours = 4 * cfg.model.d_model ** 2 + 3 * cfg.model.d_model * cfg.model.d_ff
    assert ours == pytest.approx(mp.maxtext_layer_params(d), rel=0.001)
    assert (cfg.model.d_model, cfg.model.num_layers, cfg.model.head_dim) == (d["emb"], d["layers"], mp.head_dim(p))
    assert "layer's matmul params" in mp.differences(p, cfg.model)


def test_compile_refuses_an_existing_case(tmp_path):
    (tmp_path / "16b.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="16b.json exists; pass --force"):
        mp.compile_case(mp.CASES["16b"], str(tmp_path), force=False)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["16b.json"]


def test_the_128b_runs_in_maxtexts_layout_with_heads_that_split_over_tensor():
    """MaxText's fsdp 16 x tensor 16 as fsdp_tp_sp; its 40 heads of 256 would not split over tensor 16,
    so the equivalent's are 80 of 128 (the same [D, D] projections), named as a difference."""
    p = mp.CASES["128b"]
    assert (p.mesh, p.our_mesh, p.strategy) == ({"data": 16, "tensor": 16}, {"data": 16, "tensor": 16}, "fsdp_tp_sp")
    cfg = preset(p.preset).model
    assert (cfg.num_heads, cfg.head_dim) == (80, 128) and cfg.num_heads % p.mesh["tensor"] == 0
    assert "head_dim 128 (MaxText: 256): 80 heads split over tensor 16" in mp.differences(p, cfg)
    assert "head_dim" not in mp.differences(mp.CASES["16b"], preset("maxtext_v5e_16b").model)


def test_planner_rows_without_compiled_cases(tmp_path):
    table = mp.rows(str(tmp_path))
    assert [r["published"].case for r in table] == ["16b", "32b", "64b", "128b"]
    for r in table:
        assert r["pred"] is None and r["pred+flags"] is None and r["pred+auto"] is None
        # over 256 chips the planner's serial step is compute plus the data axis's traffic
        assert r["plan"]["serial_s"] == pytest.approx(r["plan"]["compute_s"] + r["plan"]["comm_s"])
        assert 0 < r["plan"]["comm_s"] < r["plan"]["compute_s"]
    text = mp.markdown(table)
    assert text.count("not compiled") == 12 and "| 16b (16.4B, 6/chip) | 120, 61.10%, 10.66 s |" in text


def test_bad_input_is_one_line_before_anything_compiles(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        mp.main(["--matmul_efficiency=92.5"])
    assert e.value.code == 2 and "--matmul_efficiency=92.5 must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        mp.main(["--compile=16b", "--maxtext_flags", "--auto", f"--out={tmp_path}"])
    assert e.value.code == 2 and "two variants of a case" in capsys.readouterr().err
    (tmp_path / "16b+flags.hlo.gz").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        mp.main(["--compile=16b", "--maxtext_flags", f"--out={tmp_path}"])
    assert e.value.code == 2 and "16b+flags.hlo.gz or" in capsys.readouterr().err
    assert [x.name for x in tmp_path.iterdir()] == ["16b+flags.hlo.gz"]


def test_program_text_ignores_where_ops_came_from_only():
    a = ('HloModule m\nFileNames\n1 "/a/x.py"\n%d = f32[2]{0} add(%p, %q), metadata={op_name="a" source_line=3}\n')
    b = ('HloModule m\nFileNames\n1 "/b/y.py"\n%d = f32[2]{0} add(%p, %q), metadata={op_name="b" source_line=9}\n')
    assert mp.program_text(a) == mp.program_text(b)
    assert mp.program_text(a) != mp.program_text(a.replace("add", "multiply"))
