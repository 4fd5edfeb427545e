"""quantize/calibration.py: the prompts and sizes calibration runs at, and the activation ranges it measures."""

import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.models.source import resolve_model
from fluxtrt.quantize.calibration import read_prompts, resolutions_for


def test_prompts_are_lines_and_a_bad_file_is_one_line(tmp_path):
    (tmp_path / "p.txt").write_text("a fox\n\n  a lake  \n")
    assert read_prompts(tmp_path / "p.txt") == ["a fox", "a lake"]
    (tmp_path / "e.txt").write_text("\n \n")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe\x00")
    for path, says in ((tmp_path / "e.txt", "holds no prompts"), (tmp_path / "b.txt", "not UTF-8"),
                       (tmp_path / "none.txt", "cannot read")):
        with pytest.raises(FluxtrtError, match=says):
            read_prompts(path)


@pytest.mark.parametrize("opt", [256, 512, 1024])
def test_two_sizes_the_opt_and_a_smaller_non_square_one(opt):
    geo = resolve_model("tiny").geometry
    (a, b), m = resolutions_for(geo, opt), geo.pixel_multiple
    assert a == (opt, opt) and b[0] < opt and b[0] != b[1] and all(v % m == 0 for v in (*a, *b))
