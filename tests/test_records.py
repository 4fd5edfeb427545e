"""records.py: typed records with to_json / from_json, the manifest's checks, and settings checked once."""

import json

import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.records import BuildRequest, CalibrationSettings, Manifest, read_manifest
from tests.helpers import fake_engine_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    gpu = tmp_path_factory.mktemp("records") / "4090"
    fake_engine_folder("tiny", gpu, engine_files=True)
    return gpu


def test_a_manifest_round_trips_and_keeps_what_a_stopped_build_lacks(folder, tmp_path):
    import shutil

    m = read_manifest(folder)
    m.pending = ["transformer"]
    dest = tmp_path / "4090"
    shutil.copytree(folder, dest)
    m.write(dest)
    again = read_manifest(dest)
    assert again.to_json() == m.to_json() and again.missing(["clip", "vae_encoder"]) == ["vae_encoder"]
    with pytest.raises(FluxtrtError, match="is an unfinished build: it has no transformer engine.*run the same"):
        Manifest.from_json({**m.to_json(), "components": {}}).component("transformer")


def test_a_manifest_of_the_older_model_field_name_still_reads(folder):
    data = json.loads((folder / "manifest.json").read_text())
    data["model"]["pipeline"] = data["model"].pop("model_class", "FluxPipeline")
    assert Manifest.from_json(data).model.model_class == "FluxPipeline"


@pytest.mark.parametrize("edit,field", [
    (lambda m: m.update(pending=[3]), "pending"),
    (lambda m: m.update(workflows="txt2img"), "workflows"),
    (lambda m: m["model"].update(variant=7), "variant"),
    (lambda m: m.update(shape_range={"min": [1], "opt": [1, 2, 3], "max": [1, 2, 3]}), "shape_range"),
    (lambda m: m["components"]["transformer"].update(recipe={"name": "fp8-attn", "scales": {}, "attention_module": {
        "file": "flashinfer/m/m.so", "sha256": "not hex", "flashinfer": "0.7.4", "head_dim": 128}}), "attention_module"),
    (lambda m: m["components"]["transformer"].update(recipe={"name": "fp8-attn", "scales": {}, "attention_module": {
        "file": "../../m.so", "sha256": "ab" * 32, "flashinfer": "0.7.4", "head_dim": 128}}),
     r"transformer.attention_module '\.\./\.\./m\.so' leads outside"),
])
def test_a_field_of_the_wrong_type_is_one_line_naming_it(folder, tmp_path, edit, field):
    import shutil

    dest = tmp_path / "4090"
    shutil.copytree(folder, dest)
    data = json.loads((dest / "manifest.json").read_text())
    edit(data)
    (dest / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(FluxtrtError, match=field):
        read_manifest(dest)


@pytest.mark.parametrize("settings,says", [
    (CalibrationSettings(size=0), "at least 1"), (CalibrationSettings(alpha=1.5), "smoothquant-alpha"),
    (CalibrationSettings(opt_resolution=1000), "multiple of 16"), (CalibrationSettings(device="tpu"), "--device tpu"),
])
def test_calibration_settings_are_checked_once(settings, says):
    with pytest.raises(FluxtrtError, match=says):
        settings.check()


def test_a_build_request_takes_known_fields_only():
    req = BuildRequest.of(gpu="4090", components=["clip"], out_dir="x")
    assert req.components == ("clip",) and str(req.out_dir) == "x"
    with pytest.raises(FluxtrtError, match="unknown build option"):
        BuildRequest.of(gpu="4090", colour="red")
