"""runtime/choice.py: which executor runs what (`--backend auto` and the fallbacks), said to the user."""

import json

import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.runtime.choice import choose_backend, known_ort_provider
from tests.helpers import fake_engine_folder


@pytest.fixture()
def fake_folder(tmp_path):
    folder = tmp_path / "4090"
    manifest = fake_engine_folder("tiny", folder, engine_files=True)
    return folder, manifest


def test_auto_without_a_gpu_runs_the_engines_onnx(fake_folder, monkeypatch):
    import fluxtrt.core.backends as backends

    monkeypatch.setattr(backends, "local_gpu_capabilities", lambda: [])
    choice = choose_backend("auto", fake_folder[0])
    assert choice.backend == "onnxruntime" and choice.fallback == [] and "no NVIDIA GPU here" in choice.notes[0]


def test_missing_components_run_in_pytorch_unless_a_build_stopped_before_them(fake_folder):
    folder, manifest = fake_folder
    del manifest["components"]["t5"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    choice = choose_backend("onnxruntime", folder)
    assert choice.fallback == ["t5"] and choice.notes == ["no engine for t5: running PyTorch for it"]
    manifest["pending"] = ["t5"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FluxtrtError, match="is an unfinished build: it has no t5 engine"):
        choose_backend("onnxruntime", folder)
    assert choose_backend("onnxruntime", folder, fallback=["t5@cpu"]).fallback == ["t5"]


def test_unknown_names_are_one_line(fake_folder):
    with pytest.raises(FluxtrtError, match="--backend tpu: choose"):
        choose_backend("tpu", fake_folder[0])
    with pytest.raises(FluxtrtError, match="--ort-provider rocm: choose auto, cpu"):
        known_ort_provider("rocm")
    with pytest.raises(FluxtrtError, match="pass --engines DIR"):
        choose_backend("onnxruntime", None)
