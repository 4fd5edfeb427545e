"""bench.py: measurements as median / min / max, ratios against the baseline of the same run, options checked."""

import numpy as np
import pytest

from fluxtrt.bench import BenchOptions, Measure, Row, add_ratios
from fluxtrt.errors import FluxtrtError


def row(system, scale, rng):
    m = lambda: Measure.of(rng.uniform(0.9, 1.1, 3) * scale)  # noqa: E731
    return Row(system=system, height=512, width=512, batch=1, steps=4, text_encoders_s=m(), transformer_step_s=m(),
               vae_decode_s=m(), end_to_end_s=m(), seconds_per_image=scale, images_per_minute=60 / scale,
               outside_transformer_share=0.1, peak_memory_gb=None)


def test_measures_and_ratios():
    rng = np.random.default_rng()
    values = list(rng.uniform(1, 2, 5))
    m = Measure.of(values)
    assert (m.median, m.min, m.max) == (float(np.median(values)), min(values), max(values))
    ours, base = row("fluxtrt", 1.0, rng), row("diffusers", 3.0, rng)
    add_ratios(ours, base)
    for key, ratio in ours.ratios.items():
        assert ratio == pytest.approx(getattr(base, key).median / getattr(ours, key).median) and ratio > 2


@pytest.mark.parametrize("opts,says", [(BenchOptions(sizes=[]), "positive integers"), (BenchOptions(runs=0), "--runs"),
                                       (BenchOptions(baseline="torch"), "--baseline"),
                                       (BenchOptions(cache_threshold=-1), "--cache-threshold")])
def test_options_are_checked(opts, says):
    with pytest.raises(FluxtrtError, match=says):
        opts.check()
