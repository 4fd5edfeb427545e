"""core/image_inputs.py: images a request brings, read as untrusted files (the hostile ones: test_untrusted.py)."""

import math

import numpy as np
import pytest
from PIL import Image


def test_images_16_bit_bomb_tiny_and_resized(tmp_path, caplog):
    from fluxtrt.core.image_inputs import MAX_IMAGE_PIXELS, WorkflowError, load_image, load_resized

    ramp = (np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16)  # 0..65520
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode.startswith("I")
    rgb = np.asarray(load_image(tmp_path / "deep.png", "--image"))
    want = np.rint(ramp.astype(np.float64) * 255 / 65535)
    assert np.abs(rgb[..., 0] - want).max() <= 1 and rgb.min() == 0 and 250 <= rgb.max() <= 255  # scaled, not clipped
    side = int(math.isqrt(MAX_IMAGE_PIXELS)) + 64
    Image.new("1", (side, side)).save(tmp_path / "bomb.png")  # a few KB that decode to > 64 MP
    with pytest.raises(WorkflowError, match="MP limit"):
        load_image(tmp_path / "bomb.png", "--image")
    Image.new("RGB", (1, 1)).save(tmp_path / "dot.png")
    with pytest.raises(WorkflowError, match="at least 16 px"):
        load_image(tmp_path / "dot.png", "--image")
    Image.new("RGB", (40, 24), (1, 2, 3)).save(tmp_path / "small.png")
    with caplog.at_level("WARNING", logger="fluxtrt"):
        load_resized(tmp_path / "small.png", "--image", 256, 256)
    assert "--image is 40x24: resized to 256x256" in caplog.text
