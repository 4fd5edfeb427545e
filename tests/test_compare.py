"""compare.py: the bounds every check uses and the relative error it measures."""

import numpy as np
import pytest

from fluxtrt.compare import RTOL_BY_DTYPE, bound_for, fake_quant_bound, relative_error, validation_points
from fluxtrt.components import Geometry
from fluxtrt.models.source import resolve_model


def test_relative_error_is_max_abs_over_the_reference_scale():
    rng = np.random.default_rng()
    ref = rng.standard_normal((4, 8))
    noise = rng.standard_normal((4, 8)) * 1e-3
    assert relative_error(ref + noise, ref) == pytest.approx(np.abs(noise).max() / np.abs(ref).max())
    assert relative_error(ref, ref) == 0.0


def test_bounds_follow_the_dtype_and_the_fake_quant_rule():
    assert bound_for("clip", "fp32", 1e-4) == 1e-4 and bound_for("clip", "bf16", 1e-4) == RTOL_BY_DTYPE["bf16"]
    assert fake_quant_bound(1e-4, 5e-3) == 5e-4 and fake_quant_bound(1e-4, 5e-4) == 1e-4


def test_validation_points_are_unlike_the_export_example():
    geo = Geometry.from_folder(resolve_model("tiny").path)
    a, b = validation_points(geo)
    assert a.batch == 1 and b.batch == 2 and b.height != b.width
    assert all(p.height % geo.pixel_multiple == 0 and p.width % geo.pixel_multiple == 0 for p in (a, b))
