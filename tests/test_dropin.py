"""Drop-in for diffusers (fluxtrt/dropin.py): diffusers' own FLUX pipelines on engine-backed modules equal the
same pipelines on their PyTorch modules, latents at every step (callback_on_step_end) and images within 2/255,
for every pipeline class on its tiny model: the torch executor here, ONNX Runtime over real CPU builds (sm89) in
the slow tests; a user program that swaps only `pipe.transformer`; the README's example; the one-line refusals."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fluxtrt.core.workflows import ImageInputs
from fluxtrt.dropin import DropInError, EngineTransformer, load_pipeline
from fluxtrt.models.source import resolve_model
from tests.core.test_workflows import diffusers_call as call
from tests.core.test_workflows import inputs_for

MAX_UINT8_DIFF = 2  # of 255
LATENT_BOUND = {"torch": 1e-4, "onnxruntime": 1e-3}  # max |drop-in - diffusers| of the latents after every step
CASES = [("tiny", "FluxPipeline", "txt2img"), ("tiny-schnell", "FluxPipeline", "txt2img"),
         ("tiny", "FluxImg2ImgPipeline", "img2img"), ("tiny-fill", "FluxFillPipeline", "fill"),
         ("tiny-control", "FluxControlPipeline", "control"), ("tiny-kontext", "FluxKontextPipeline", "kontext")]
IDS = [f"{c[1]}-{c[0]}" for c in CASES]
ROOT = Path(__file__).resolve().parents[1]


def compare(ours, ref, src, workflow, executor, prompts=("a red fox in the snow", "a bowl of ramen"), h=256, w=384):
    rng = np.random.default_rng()
    seed, guidance = int(rng.integers(0, 2**31)), float(rng.uniform(2.0, 8.0))
    inputs = inputs_for(workflow, rng, h, w) if workflow != "txt2img" else ImageInputs()
    got, got_latents = call(ours, src, workflow, list(prompts), h, w, 3, guidance, seed, inputs)
    want, want_latents = call(ref, src, workflow, list(prompts), h, w, 3, guidance, seed, inputs)
    assert len(got_latents) == len(want_latents) >= 1
    for i, (a, b) in enumerate(zip(got_latents, want_latents)):
        err = float((a.float() - b.float()).abs().max())
        assert err < LATENT_BOUND[executor], f"{workflow}: latents diverge from diffusers at step {i}: {err:.2e}"
    assert got.shape == want.shape and got.shape[0] == len(prompts)
    diff = int(np.abs(got.astype(int) - want.astype(int)).max())
    assert diff <= MAX_UINT8_DIFF, f"{workflow}: image differs from diffusers' by {diff}/255"
    assert got.std() > 1  # not a constant image
    return diff


@pytest.mark.slow
@pytest.mark.parametrize("model,pipeline,workflow", CASES, ids=IDS)
def test_torch_executor_modules_equal_diffusers_modules(model, pipeline, workflow):
    src = resolve_model(model)
    ours = load_pipeline(model=model, backend="torch", torch_dtype="fp32", diffusers_pipeline=pipeline)
    assert type(ours).__mro__[1].__name__ == pipeline and ours.transformer.dtype == torch.float32
    compare(ours, src.load_pipeline(diffusers_pipeline=pipeline), src, workflow, "torch")


@pytest.mark.slow
@pytest.mark.parametrize("model,pipeline,workflow", CASES, ids=IDS)
def test_onnxruntime_engines_equal_diffusers_modules(engines, model, pipeline, workflow):
    """ONNX Runtime over the ONNX of a real fp32 build, batch 2 at a non-square size, step for step."""
    src, folder, manifest = engines(model)
    ours = load_pipeline(folder, backend="onnxruntime", diffusers_pipeline=pipeline)
    assert {m.executor.kind for m in (ours.transformer, ours.vae, ours.text_encoder)} == {"onnxruntime"}
    compare(ours, src.load_pipeline(diffusers_pipeline=pipeline), src, workflow, "onnxruntime")


@pytest.mark.slow
def test_a_user_program_that_swaps_only_the_transformer(engines):
    """The user's own FluxPipeline (from the model folder, their scheduler, tokenizers, encoders, VAE) with only
    `pipe.transformer` replaced; shapes outside the engines' profile are one line naming it."""
    import diffusers

    src, folder, manifest = engines("tiny")
    ref = src.load_pipeline()
    pipe = diffusers.FluxPipeline(**ref.components)  # the user's pipeline object, modules shared with ref
    pipe.transformer = EngineTransformer.load(folder, backend="onnxruntime")
    compare(pipe, ref, src, "txt2img", "onnxruntime", prompts=("a lighthouse on a rocky coast at night",))
    lo, hi = (manifest.components["transformer"].profile["hidden_states"][k] for k in ("min", "max"))
    side = int((hi[1] * 1.25) ** 0.5) * 16 // 16 * 16  # more image tokens than the profile's maximum
    with pytest.raises(Exception, match=re.escape(f"profile {lo}..{hi}")):
        pipe("too large", height=side, width=side, num_inference_steps=1,
             max_sequence_length=src.geometry.t5_length)


@pytest.mark.slow
def test_readme_example_runs(engines, tmp_path, monkeypatch):
    """The README's drop-in example, with its engines folder pointed at a real build and 2 steps."""
    src, folder, _ = engines("tiny")
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
               if "fluxtrt.dropin" in b]
    assert len(code.strip().splitlines()) <= 5 and '"engines/4090"' in code
    code = code.replace('"engines/4090"', repr(str(folder))).replace("num_inference_steps=28", "num_inference_steps=2")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102
    from PIL import Image

    png = next(tmp_path.glob("*.png"))
    assert np.asarray(Image.open(png)).std() > 1


def test_what_an_engine_cannot_do_is_one_line_naming_the_fluxtrt_way():
    pipe = load_pipeline(model="tiny", backend="torch", torch_dtype="fp32")
    t = pipe.transformer
    assert t.to("cpu") is t and t.eval() is t and pipe.to("cpu") is pipe  # where it already runs: no-op
    cases = [
        (lambda: t.to(torch.float16), "cannot become torch.float16"),
        (lambda: t.load_lora_adapter({}), "lora=['FILE:SCALE'"),
        (lambda: pipe.load_lora_weights({}), "lora=['FILE:SCALE'"),
        (lambda: pipe.enable_model_cpu_offload(), "low_vram=True"),
        (lambda: pipe.enable_vae_tiling(), "VAE"),
        (lambda: t.set_attn_processor(None), "fixed at build time"),
        (lambda: t.enable_cache(None), "no step cache"),
        (lambda: t.train(), "inference only"),
        (lambda: pipe("x", num_inference_steps=1, height=64, width=64, joint_attention_kwargs={"scale": 0.5}),
         "lora=['FILE:SCALE'"),
        (lambda: pipe.vae(torch.zeros(1)), "vae.decode"),
        (lambda: load_pipeline(model="tiny", backend="torch", steps=4), "unknown option steps"),
        (lambda: load_pipeline(model="tiny", backend="torch", diffusers_pipeline="StableDiffusionPipeline"),
         "not a diffusers FLUX"),
    ]
    for fn, message in cases:
        with pytest.raises(DropInError, match=re.escape(message)) as e:
            fn()
        assert "\n" not in str(e.value)
