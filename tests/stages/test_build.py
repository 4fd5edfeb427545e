"""stages/build.py: a GPU folder's build: one model per folder, the engine stage's key, the pending list."""

import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.gpus import load_gpu
from fluxtrt.models.source import resolve_model
from fluxtrt.stages.build import build_key, check_same_model
from tests.helpers import fake_engine_folder


def test_a_folder_holds_one_models_engines(tmp_path):
    folder = tmp_path / "4090"
    fake_engine_folder("tiny", folder, engine_files=True)
    check_same_model(folder, resolve_model("tiny"), force=False)  # the same model: resumed or rebuilt
    check_same_model(tmp_path / "new", resolve_model("tiny-schnell"), force=False)  # nothing there yet
    with pytest.raises(FluxtrtError, match="holds engines of tiny, not tiny-schnell"):
        check_same_model(folder, resolve_model("tiny-schnell"), force=False)
    check_same_model(folder, resolve_model("tiny-schnell"), force=True)


def test_the_engine_key_changes_with_each_input():
    cfg = load_gpu("4090")
    base = dict(onnx_sha="a" * 64, backend="tensorrt-rtx", backend_version="1.7", cfg=cfg, profile={"x": 1})
    key = build_key(**base, weight_streaming=False)
    changed = [build_key(**{**base, k: v}, weight_streaming=False) for k, v in
               (("onnx_sha", "b" * 64), ("backend_version", "1.8"), ("profile", {"x": 2}), ("cfg", load_gpu("3090")))]
    changed += [build_key(**base, weight_streaming=True), build_key(**base, weight_streaming=False, weightless=True)]
    assert len({key, *changed}) == 7
