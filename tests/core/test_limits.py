"""core/limits.py: request limits, checked in one line naming the option."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fluxtrt.core.limits import check_number
from fluxtrt.errors import FluxtrtError


@given(lo=st.integers(-100, 100), span=st.integers(0, 100), value=st.floats(allow_nan=True, allow_infinity=True))
def test_a_number_passes_exactly_when_finite_and_in_range(lo, span, value):
    hi = lo + span
    ok = math.isfinite(value) and lo <= value <= hi
    if ok:
        check_number("--x", value, lo, hi)
    else:
        with pytest.raises(FluxtrtError, match="^--x must be"):
            check_number("--x", value, lo, hi)


def test_none_means_not_given():
    check_number("--x", None, 1, 2)
