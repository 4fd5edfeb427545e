"""Bad input everywhere gets one clear line and exit code 2: property-based checks of request validation and
the run command's arguments, out-of-memory, and engines with embedded host code."""

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def fake_engines(tmp_path_factory):
    """An engine folder whose manifest declares profiles (no engine is built: request checks need none)."""
    from tests.helpers import fake_engine_folder

    folder = tmp_path_factory.mktemp("fake") / "4090"
    fake_engine_folder("tiny-schnell", folder)
    return folder


def _valid(batch, h, w, steps):
    return 1 <= batch <= 4 and steps >= 1 and all(v % 16 == 0 and 256 <= v <= 1024 for v in (h, w))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(-2, 8), h=st.integers(-64, 2048), w=st.integers(-64, 2048), steps=st.integers(-3, 60))
def test_request_validation_property(fake_engines, batch, h, w, steps):
    from fluxtrt.runtime.assembly import open_pipeline
    from fluxtrt.runtime.pipeline import RequestError

    pipe = open_pipeline(fake_engines, backend="onnxruntime")
    if _valid(batch, h, w, steps):
        pipe.check_request(batch, h, w, steps)
    else:
        with pytest.raises(RequestError) as e:
            pipe.check_request(batch, h, w, steps)
        assert "\n" not in str(e.value) and len(str(e.value)) < 200


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(h=st.integers(-100, 5000), w=st.integers(-100, 5000), steps=st.integers(-5, 50), batch=st.integers(-3, 9),
       seed=st.integers(-5, 2**64))
def test_run_arguments_property(fake_engines, h, w, steps, batch, seed):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    assume(not (_valid(batch, h, w, steps) and 0 <= seed < 2**63))  # valid requests would generate an image
    res = CliRunner().invoke(app, ["run", "--engines", str(fake_engines), "--backend", "onnxruntime", "--prompt", "x",
                                   "--height", str(h), "--width", str(w), "--steps", str(steps),
                                   "--batch", str(batch), "--seed", str(seed)])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 or "Invalid value" in res.output  # typer's own one-line usage error


def test_out_of_memory_is_one_line_with_the_fixes(fake_engines, monkeypatch):
    import torch
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr("fluxtrt.runtime.pipeline.Pipeline.generate", oom)
    res = CliRunner().invoke(app, ["run", "--engines", str(fake_engines), "--backend", "onnxruntime", "--prompt", "x",
                                   "--height", "256", "--width", "256"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert re.search(r"out of GPU memory; try `--low-vram`.*lower precision", res.output)


def test_host_code_engines_are_refused_unless_allowed(tmp_path):
    pytest.importorskip("tensorrt_rtx")
    from fluxtrt.errors import FluxtrtError
    from fluxtrt.fileio import sha256_file
    from fluxtrt.runtime.tensorrt import TensorRTExecutor
    from tests import fake_trt
    from tests.helpers import entry as make_entry

    engine = fake_trt.write_plan(tmp_path / "x.engine", [], [], {})
    seen = {}

    class Runtime(fake_trt.Runtime):
        def __setattr__(self, k, v):
            seen[k] = v
            object.__setattr__(self, k, v)

        def deserialize_cuda_engine(self, reader):
            self.logger.errors.append("engine contains host code and host code is not allowed")
            return None

    backend = fake_trt.Backend()
    backend.trt.Runtime = Runtime
    entry = make_entry(sha256=sha256_file(engine), bytes=engine.stat().st_size)
    streams = fake_trt.Streams()
    with pytest.raises(FluxtrtError, match="embeds host code: pass --allow-host-code only if you trust"):
        TensorRTExecutor("transformer", entry, engine, backend, streams=streams).activate()
    assert seen["engine_host_code_allowed"] is False
    with pytest.raises(FluxtrtError):
        TensorRTExecutor("transformer", entry, engine, backend, allow_host_code=True, streams=streams).activate()
    assert seen["engine_host_code_allowed"] is True


def test_very_long_prompt_is_truncated_with_a_warning(caplog):
    import logging

    from fluxtrt.models.source import resolve_model
    from fluxtrt.runtime.assembly import open_pipeline

    pipe = open_pipeline(None, backend="torch", model=resolve_model("tiny-schnell"), torch_dtype="fp32", device="cpu")
    long_prompt = " ".join(["a red fox jumping over a sleepy dog in the snow"] * 120)
    with caplog.at_level(logging.WARNING, logger="fluxtrt"):
        res = pipe.generate([long_prompt], 256, 256, 1, seed=0)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("prompt truncated to 77 CLIP tokens" in m for m in msgs)
    assert any("prompt truncated to 256 T5 tokens" in m for m in msgs)  # schnell: T5's own length, not CLIP's
    for m in msgs:  # one short line with the counts, not the dropped text
        assert "\n" not in m and len(m) < 120 and "words dropped" in m, m
    assert res.images.shape == (1, 256, 256, 3)
