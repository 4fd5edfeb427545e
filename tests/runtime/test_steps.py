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


def test_an_executor_that_cannot_be_captured_is_one_line_naming_the_fix(monkeypatch):
    """CudaGraphStep: an executor whose call waits on the host (the default AOTI container did: "operation not
    permitted when stream is capturing") fails the capture; that is one FluxtrtError naming --cuda-graph, not a
    traceback. torch's CUDA graph API stood in for on this CPU: the capture raises as torch's does."""
    import contextlib

    from fluxtrt.errors import FluxtrtError
    from fluxtrt.runtime import steps

    class Capture:
        def __enter__(self):
            self.capturing = True

        def __exit__(self, *exc):
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    class Executor:
        kind, calls = "pt2", 0

        def infer(self, feeds):
            self.calls += 1
            return {"noise_pred": feeds["hidden_states"] * 2}

    ex = Executor()
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda g, stream=None, capture_error_mode="global": Capture())
    stream = type("Stream", (), {"synchronize": lambda self: None})()
    feeds = {"hidden_states": torch.randn(1, 16, 8), "timestep": torch.rand(1)}
    with pytest.raises(FluxtrtError, match=r"^--cuda-graph: the pt2 transformer cannot be captured as a CUDA graph "
                                           r"\(CUDA error: .*\); run without --cuda-graph$"):
        steps.CudaGraphStep(ex, feeds, stream)
    assert ex.calls == 3  # two warm-up calls, then the one captured


def test_the_capture_waits_for_weights_read_ahead(monkeypatch):
    """A package folder's weights are read ahead on a background thread (PackageExecutor.prefetch). A read that
    copies to the GPU while the step is captured spoils the capture (the H200's fresh `run --cuda-graph` failed
    so while the VAE's weights were still being read): CudaGraphStep waits for the reader first, and captures in
    thread_local mode. torch's CUDA graph API stood in for on this CPU."""
    import contextlib
    import threading

    from fluxtrt.runtime import executors, steps

    release, seen = threading.Event(), {}
    read = executors._reader().submit(lambda: release.wait(10) and "read")  # a read still under way

    class Capture:
        def __enter__(self):
            seen["read_done_at_capture"] = read.done()

        def __exit__(self, *exc):
            return False

    class Executor:
        kind = "pt2"

        def infer(self, feeds):
            return {"noise_pred": feeds["hidden_states"] * 2}

    def graph(g, stream=None, capture_error_mode="global"):
        seen["mode"] = capture_error_mode
        return Capture()

    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    stream = type("Stream", (), {"synchronize": lambda self: None})()
    threading.Timer(0.2, release.set).start()
    steps.CudaGraphStep(Executor(), {"hidden_states": torch.randn(1, 16, 8), "timestep": torch.rand(1)}, stream)
    assert seen == {"read_done_at_capture": True, "mode": "thread_local"}
    assert read.result() == "read"
