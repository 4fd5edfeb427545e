"""stages/fp32_plan.py: the copying plan (fp32 export, then optimize and quantize at the engine's precision)."""

import pytest

from fluxtrt.models.source import resolve_model
from fluxtrt.records import CalibrationSettings
from fluxtrt.stages.fp32_plan import onnx_dir_for


def test_each_model_and_dtype_has_its_own_onnx_folder(tmp_path):
    tiny, schnell = resolve_model("tiny"), resolve_model("tiny-schnell")
    folders = {onnx_dir_for(tmp_path, m, d) for m in (tiny, schnell) for d in ("fp32", "bf16")}
    assert len(folders) == 4 and all(f.parent == tmp_path / "onnx" for f in folders)


@pytest.mark.slow
def test_weight_only_recipes_read_no_calibration_prompts(tiny_dev, tmp_path, monkeypatch):
    """int8-wo / int4-wo need no activation ranges: their stage neither reads nor hashes a prompts file (a
    missing one is no error for them)."""
    from fluxtrt.stages.fp32_plan import ensure_fp32_plan

    def no_prompts(calib):
        raise AssertionError("a weight-only recipe hashed the calibration prompts")

    monkeypatch.setattr("fluxtrt.stages.base.prompts_sha256", no_prompts)
    calib = CalibrationSettings(prompts_file=tmp_path / "missing.txt")
    path, results = ensure_fp32_plan(tiny_dev, "transformer", "int4-wo", tmp_path, False, on_phase=lambda p: None, calib=calib,
                                     validate=False)
    assert path.exists() and {(r.stage, r.status) for r in results} >= {("quantize", "built")}
