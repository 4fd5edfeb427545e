"""runtime/assembly.py: the one opener of pipelines; executors of the kind each engine file is."""

import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.runtime.assembly import open_pipeline
from fluxtrt.runtime.executors import OnnxRuntimeExecutor, TorchExecutor
from fluxtrt.runtime.options import PipelineOptions


def test_an_unknown_option_or_nothing_to_open_is_one_line():
    with pytest.raises(FluxtrtError, match=r"^unknown option steps; a pipeline takes engines, model, backend"):
        open_pipeline(None, model="tiny", steps=4)
    with pytest.raises(FluxtrtError, match=r"^pass --engines DIR"):
        open_pipeline()


def test_a_model_name_opens_its_pytorch_modules_and_keywords_replace_the_options_fields():
    base = PipelineOptions(model="tiny-schnell", torch_dtype="bf16", device="cpu")
    pipe = open_pipeline(options=base, torch_dtype="fp32")
    assert pipe.backend_name == "torch" and pipe.options.torch_dtype == "fp32" and base.torch_dtype == "bf16"
    assert all(isinstance(ex, TorchExecutor) for ex in pipe.executors.values())
    assert pipe.geo.guidance is False  # schnell's configs, read from the model folder


def test_an_engines_folder_opens_each_component_from_its_onnx_with_pytorch_for_what_is_asked(engines):
    _, folder, _ = engines("tiny")
    pipe = open_pipeline(folder, backend="onnxruntime", fallback=["vae_decoder"], device="cpu", torch_dtype="fp32")
    assert isinstance(pipe.executors["transformer"], OnnxRuntimeExecutor)
    assert isinstance(pipe.executors["vae_decoder"], TorchExecutor)
    assert any("ONNX Runtime runs on the CPU" in n for n in pipe.notes)


def test_low_vram_frees_every_stage_after_its_use():
    """--low-vram on the PyTorch modules: after a generation no executor holds its weights (Pipeline.release)."""
    import numpy as np

    pipe = open_pipeline(None, backend="torch", model="tiny-schnell", device="cpu", torch_dtype="fp32", low_vram=True)
    seed = int(np.random.default_rng().integers(1000))
    res = pipe.generate(["a cat"], 128, 128, 1, seed=seed)
    assert res.images.shape == (1, 128, 128, 3) and res.images.std() > 0
    assert not any(ex.active for ex in pipe.executors.values())
