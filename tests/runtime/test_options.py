"""runtime/options.py: the one record of how a pipeline opens, checked once, and what it says it does not do."""

import dataclasses

import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.runtime.options import FIELDS, PipelineOptions


def test_gpu_only_flags_are_said_on_onnx_runtime():
    from fluxtrt.runtime.options import PipelineOptions

    opts = PipelineOptions(cuda_graph=True, weight_streaming_budget=100, compile=True)
    (line,) = opts.notes("onnxruntime")
    assert "--cuda-graph" in line and "--weight-streaming-budget" in line and "--compile" in line
    assert PipelineOptions().notes("onnxruntime") == []
    assert opts.notes("tensorrt") == []
    assert opts.notes("torch") == [  # the PyTorch step is captured too
        "--weight-streaming-budget: TensorRT engine options, unused by the PyTorch modules"]
    low = PipelineOptions(low_vram=True)
    assert "--low-vram" in low.notes("onnxruntime", "cpu")[0]  # nothing to free on the CPU
    assert low.notes("onnxruntime", "cuda") == []  # sessions leave the GPU stage by stage


@pytest.mark.parametrize("change, message", [
    ({"weight_streaming_budget": -5}, "at least 0"),
    ({"torch_dtype": "fp64"}, "--torch-dtype"),
    ({"lora": ("a.safetensors:11",)}, r"--lora a.safetensors: the scale after ':' is a number within \+-10, got 11"),
    ({"lora": ("a.safetensors:nan",)}, "got nan"),
    ({"fallback": ("t5", "t5")}, "t5 given twice in --fallback"),
    ({"kernel_specialization": "sometimes"}, "eager or lazy"),
])
def test_options_refuse_what_would_be_silent_and_normalise_the_rest(change, message):
    with pytest.raises(FluxtrtError, match=message):
        PipelineOptions(**change).check()
    ok = PipelineOptions(engines="engines/4090", fallback=["clip,t5", "vae_decoder@cpu"],
                         lora=["a.safetensors:-10", "dir:x/b.safetensors", ("c.safetensors", 0.5)]).check()
    assert ok.fallback == ("clip", "t5", "vae_decoder@cpu") and ok.engines.name == "4090"
    assert [(str(r.path), r.scale) for r in ok.lora] == [("a.safetensors", -10.0), ("dir:x/b.safetensors", 1.0),
                                                         ("c.safetensors", 0.5)]  # a colon in a path is the path's
    assert PipelineOptions(lora="one.safetensors").check().lora[0].path.name == "one.safetensors"
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen: one record, never patched after it was checked
        ok.backend = "torch"
    assert "engines" in FIELDS and "steps" not in FIELDS  # the request's settings are not the pipeline's
