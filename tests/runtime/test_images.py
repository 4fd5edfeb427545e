"""runtime/images.py: PNGs written atomically with their settings; an output never replaces an input."""

import numpy as np
import pytest
from PIL import Image

from fluxtrt.errors import FluxtrtError
from fluxtrt.runtime.images import check_output_path, save_png


def test_a_png_carries_its_settings(tmp_path):
    img = np.random.default_rng().integers(0, 256, (16, 24, 3), dtype=np.uint8)
    save_png(img, tmp_path / "a.png", {"prompt": "a fox", "seed": 7})
    back = Image.open(tmp_path / "a.png")
    assert np.array_equal(np.asarray(back), img) and back.text == {"prompt": "a fox", "seed": "7"}


def test_an_output_replaces_no_input_and_lands_in_no_input_folder(tmp_path):
    (tmp_path / "in.png").write_bytes(b"x")
    (tmp_path / "engines").mkdir()
    for dest, inputs, folders, says in [
        (tmp_path / "x.jpg", None, None, "must end in .png"),
        (tmp_path / "in.png", {"--image": tmp_path / "in.png"}, None, "is the --image file"),
        (tmp_path / "engines" / "o.png", None, {"--engines": tmp_path / "engines"}, "lies inside the --engines folder"),
        (tmp_path / "engines", None, None, "must end in .png"),
    ]:
        with pytest.raises(FluxtrtError, match=says):
            check_output_path(dest, inputs, folders)
    check_output_path(tmp_path / "new" / "o.png")
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())
