"""runtime/steps.py: the transformer step the loop calls, eager or through First-Block Cache's parts."""

import pytest
import torch

from fluxtrt.components import ShapePoint
from fluxtrt.runtime.assembly import open_pipeline


@pytest.fixture(scope="module")
def pipe():
    return open_pipeline(None, backend="torch", model="tiny-schnell", device="cpu", torch_dtype="fp32")


def test_the_eager_step_is_the_executors_output_and_threshold_zero_is_no_cache(pipe):
    ex = pipe.executors["transformer"]
    feeds = ex.spec.sample_inputs(ShapePoint(1, 128, 128), pipe.geo, int(torch.randint(0, 10_000, ())))
    latents, t = feeds["hidden_states"].clone(), feeds["timestep"].clone()
    step = pipe.steps.step_function(dict(feeds))
    assert torch.equal(step(latents, t), ex.infer(dict(feeds, hidden_states=latents, timestep=t))["noise_pred"])
    assert pipe.steps.step_cache(0.0) is None


def test_the_cached_step_with_a_cache_that_always_computes_is_the_whole_transformer(pipe):
    """The parts (head, tail, out) chained equal the whole module within fp32 rounding."""
    ex = pipe.executors["transformer"]
    feeds = ex.spec.sample_inputs(ShapePoint(2, 128, 128), pipe.geo, int(torch.randint(0, 10_000, ())))
    whole = ex.infer(dict(feeds))["noise_pred"]
    parts = pipe.steps.cached_transformer(dict(feeds), [(None, slice(None))])
    assert (parts - whole).abs().max() <= 1e-5 * whole.abs().max()
