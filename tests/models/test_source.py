"""Model sources: local diffusers folders, the embedded tiny models, and the errors for bad --model values."""

import json
import shutil

import pytest

from fluxtrt.errors import ModelSourceError
from fluxtrt.fileio import sha256_file
from fluxtrt.models.source import REQUIRED, resolve_model
from fluxtrt.models.tiny import write_tiny_pipeline


def test_tiny_variants_detected_from_guidance_embeds(tiny_dev, tiny_schnell):
    assert tiny_dev.variant == "dev" and tiny_dev.geometry.t5_length == 512
    assert tiny_schnell.variant == "schnell" and tiny_schnell.geometry.t5_length == 256
    for src in (tiny_dev, tiny_schnell):
        assert sorted(p.name for p in src.path.iterdir() if p.is_dir()) == sorted(REQUIRED)
        assert src.geometry.pixel_multiple == 16  # same VAE downsampling as FLUX.1 (8) x 2x2 packing


def test_tiny_is_deterministic(tmp_path):
    """Two independent builds of the tiny model give byte-identical files."""
    a = write_tiny_pipeline(tmp_path / "a", "dev")
    b = write_tiny_pipeline(tmp_path / "b", "dev")
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b and len(files_a) >= 12
    for rel in files_a:
        assert sha256_file(a / rel) == sha256_file(b / rel), rel


def test_local_folder_loads_like_a_flux_checkout(tiny_dev, tmp_path):
    """A copy of the tiny folder elsewhere is a plain local diffusers folder: it loads and generates."""
    import numpy as np
    import torch

    folder = tmp_path / "FLUX.1-copy"
    shutil.copytree(tiny_dev.path, folder)
    src = resolve_model(str(folder))
    assert src.variant == "dev" and src.path == folder.resolve()
    assert src.content_hash == tiny_dev.content_hash  # the hash is over contents, not location
    pipe = src.load_pipeline()
    img = pipe("a red fox", height=64, width=96, num_inference_steps=2, output_type="np",
               generator=torch.Generator().manual_seed(1)).images
    assert img.shape == (1, 64, 96, 3) and np.isfinite(img).all() and img.std() > 0


def test_schnell_folder_detected(tiny_schnell, tmp_path):
    folder = tmp_path / "schnell"
    shutil.copytree(tiny_schnell.path, folder)
    cfg = json.loads((folder / "transformer" / "config.json").read_text())
    assert cfg["guidance_embeds"] is False
    assert resolve_model(str(folder)).variant == "schnell"


@pytest.mark.parametrize("hub_id", ["black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-schnell"])
def test_hub_id_is_refused_with_the_fix(hub_id):
    with pytest.raises(ModelSourceError, match="never downloads.*--model ./FLUX.1"):
        resolve_model(hub_id)


def test_missing_folder_and_missing_components(tmp_path, tiny_dev):
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dev.path, broken)
    shutil.rmtree(broken / "text_encoder_2")
    with pytest.raises(ModelSourceError, match="missing the component folder.*text_encoder_2"):
        resolve_model(str(broken))


def test_wrong_architecture_is_refused(tmp_path, tiny_dev):
    wrong = tmp_path / "wrong"
    shutil.copytree(tiny_dev.path, wrong)
    (wrong / "transformer" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    with pytest.raises(ModelSourceError, match="does not look like a FLUX.1 model"):
        resolve_model(str(wrong))
