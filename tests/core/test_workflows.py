"""img2img, Fill, Control and Kontext against diffusers' own pipelines (FluxImg2ImgPipeline, FluxFillPipeline,
FluxControlPipeline, FluxKontextPipeline) on the embedded tiny models: the PyTorch executor here, ONNX Runtime
over real TensorRT-RTX builds (sm89) in the slow tests; and the one-line refusals of requests a model cannot
serve."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from fluxtrt.components import ShapePoint, ShapeRange
from fluxtrt.core.workflows import WORKFLOWS, ImageInputs, WorkflowError, profile_range, select
from fluxtrt.models.source import resolve_model
from fluxtrt.runtime.assembly import open_pipeline

MAX_UINT8_DIFF = 2  # of 255, image vs diffusers
LATENT_BOUND = {"torch": 1e-4, "onnxruntime": 1e-3}  # max |ours - diffusers| of the latents after every step
MODEL = {"img2img": "tiny", "fill": "tiny-fill", "control": "tiny-control", "kontext": "tiny-kontext"}


def random_image(rng, h, w):
    """A smooth random RGB image (noise upsampled), so resizing and encoding see structure, not white noise."""
    base = rng.integers(0, 256, (max(h // 16, 2), max(w // 16, 2), 3), dtype=np.uint8)
    return Image.fromarray(base).resize((w, h), Image.BILINEAR)


def random_mask(rng, h, w):
    m = np.zeros((h, w), np.uint8)
    y, x = rng.integers(0, h // 2), rng.integers(0, w // 2)
    m[y:y + h // 2, x:x + w // 2] = 255
    return Image.fromarray(m)


def inputs_for(workflow, rng, h, w):
    """Fresh random inputs; the image's size differs from the output's (both sides resize it)."""
    ih, iw = h + 16 * int(rng.integers(-3, 4)), w + 16 * int(rng.integers(-3, 4))
    if workflow == "img2img":
        return ImageInputs(image=random_image(rng, ih, iw), strength=float(rng.uniform(0.5, 0.95)))
    if workflow == "fill":
        return ImageInputs(image=random_image(rng, h, w), mask=random_mask(rng, h, w),
                           strength=float(rng.choice([1.0, 0.8])))
    if workflow == "control":
        return ImageInputs(control_image=random_image(rng, ih, iw))
    return ImageInputs(image=random_image(rng, ih, iw), max_area=h * w)


def diffusers_call(pipe, src, workflow, prompts, h, w, steps, guidance, seed, inputs):
    """One call of a diffusers pipeline as a user writes it: (uint8 images, latents after every step)."""
    latents = []

    def keep(p, i, t, kw):
        latents.append(kw["latents"].clone())
        return {}

    img = pipe(prompt=prompts, height=h, width=w, num_inference_steps=steps, guidance_scale=guidance,
               max_sequence_length=src.geometry.t5_length, generator=torch.Generator().manual_seed(seed),
               output_type="np", callback_on_step_end=keep, **WORKFLOWS[workflow].diffusers_kwargs(inputs)).images
    return (img * 255).round().astype("uint8"), latents


def reference(src, workflow, prompts, h, w, steps, guidance, seed, inputs):
    pipe = src.load_pipeline(diffusers_pipeline=WORKFLOWS[workflow].diffusers_pipeline)
    return diffusers_call(pipe, src, workflow, prompts, h, w, steps, guidance, seed, inputs)


def compare(pipe, src, workflow, prompts, h, w, steps, executor):
    rng = np.random.default_rng()
    seed, guidance = int(rng.integers(0, 2**31)), float(rng.uniform(2.0, 8.0))
    inputs = inputs_for(workflow, rng, h, w)
    ref, ref_latents = reference(src, workflow, prompts, h, w, steps, guidance, seed, inputs)
    res = pipe.generate(prompts, h, w, steps, guidance, seed=seed, trace=True, inputs=inputs)
    assert res.workflow == workflow
    assert len(res.latents_per_step) == len(ref_latents) >= 1
    for i, (a, b) in enumerate(zip(res.latents_per_step, ref_latents)):
        err = float((a - b).abs().max())
        assert err < LATENT_BOUND[executor], f"{workflow}: latents diverge from diffusers at step {i}: {err:.2e}"
    assert res.images.shape == ref.shape == (len(prompts), h, w, 3)
    diff = int(np.abs(res.images.astype(int) - ref.astype(int)).max())
    assert diff <= MAX_UINT8_DIFF, f"{workflow}: image differs from diffusers' by {diff}/255"
    assert res.images.std() > 1  # not a constant image
    return res


@pytest.mark.slow
@pytest.mark.parametrize("workflow", list(MODEL))
def test_torch_executor_matches_diffusers(workflow):
    """Each workflow through the PyTorch executor (fp32, CPU), batch 2 at a non-square size, step for step."""
    src = resolve_model(MODEL[workflow])
    pipe = open_pipeline(None, backend="torch", model=src, device="cpu", torch_dtype="fp32")
    compare(pipe, src, workflow, ["a red fox in the snow", "a bowl of ramen"], 256, 320, 3, "torch")


@pytest.mark.slow
def test_conditioning_changes_the_image():
    """The image inputs are used: another mask, control map or reference moves the latents far beyond the
    executor's 1e-4 agreement with diffusers (the tiny Kontext's near-uniform attention over 4000+ reference
    tokens moves them least: about 1e-2 after two steps, vs 0.7-1.8 for Control and Fill)."""
    rng = np.random.default_rng()
    for workflow in ("fill", "control", "kontext"):
        src = resolve_model(MODEL[workflow])
        pipe = open_pipeline(None, backend="torch", model=src, device="cpu", torch_dtype="fp32")
        a, b = (pipe.generate(["a cat"], 256, 256, 2, seed=1, trace=True, inputs=inputs_for(workflow, rng, 256, 256))
                .latents_per_step[-1] for _ in range(2))
        assert float((a - b).abs().max()) > 1e-3, workflow


@pytest.mark.parametrize("model,given,message", [
    ("tiny", dict(mask="m"), "--mask cannot be used with these engines: they are FLUX.1-dev or FLUX.1-schnell "
     "(txt2img, img2img); it needs a FLUX.1-Fill-dev model"),
    ("tiny", dict(control_image="c"), "it needs a FLUX.1-Canny-dev or FLUX.1-Depth-dev model"),
    ("tiny", dict(strength=0.5), "(img2img) needs --image"),
    ("tiny", dict(image="i", strength=1.5), "--strength must be in (0, 1]"),
    ("tiny", dict(image="i", strength=0.0), "--strength must be in (0, 1]"),
    ("tiny", dict(image="i", max_area=10**6), "--max-area cannot be used"),
    ("tiny-fill", dict(image="i"), "FLUX.1-Fill-dev (fill) needs --mask"),
    ("tiny-fill", dict(), "needs --image and --mask"),
    ("tiny-control", dict(), "needs --control-image"),
    ("tiny-control", dict(image="i", control_image="c"), "--image cannot be used"),
    ("tiny-kontext", dict(), "FLUX.1-Kontext-dev (kontext) needs --image"),
    ("tiny-kontext", dict(image="i", max_area=1000), "--max-area is the output's area in px²"),
])
def test_requests_a_model_cannot_serve_are_one_line(model, given, message):
    with pytest.raises(WorkflowError) as e:
        select(resolve_model(model).geometry, ImageInputs(**given))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_workflow_follows_model_and_flags():
    geo = resolve_model("tiny").geometry
    assert select(geo, ImageInputs()).name == "txt2img"
    assert select(geo, ImageInputs(image="x")).name == "img2img"
    assert select(resolve_model("tiny-kontext").geometry, ImageInputs(image="x")).name == "kontext"


def test_kontext_sizes_and_profile_follow_diffusers():
    """Output at max_area with the requested aspect; the reference at the nearest preferred resolution; the
    transformer's profile covers target + reference tokens and the encoder every preferred resolution."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    wf, geo = WORKFLOWS["kontext"], resolve_model("tiny-kontext").geometry
    assert wf.output_size(512, 512, ImageInputs()) == (1024, 1024)  # diffusers' default max_area 1024²
    assert wf.output_size(600, 800, ImageInputs(max_area=256 * 256)) == (208, 288)
    rng = np.random.default_rng()
    for _ in range(5):
        h, w = (int(v) for v in rng.integers(100, 900, 2))
        rh, rw = wf.reference_size(ImageInputs(image=random_image(rng, h, w)), geo)
        aspect = (w - w % 16) / (h - h % 16)
        best = min(abs(aspect - pw / ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
        assert (rw, rh) in PREFERRED_KONTEXT_RESOLUTIONS and abs(aspect - rw / rh) == best
    cfg = ShapeRange(ShapePoint(1, 256, 256), ShapePoint(1, 1024, 1024), ShapePoint(4, 1536, 1536))
    tr = profile_range(geo, "transformer", cfg)
    tokens = sorted((h // 16) * (w // 16) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    sym = [p.symbols(geo)["image_tokens"] for p in (tr.min, tr.opt, tr.max)]
    assert sym == [16 * 16 + tokens[0], 64 * 64 * 2, 96 * 96 + tokens[-1]]
    enc = profile_range(geo, "vae_encoder", cfg)
    sides = [s for wh in PREFERRED_KONTEXT_RESOLUTIONS for s in wh]
    assert (enc.min.height, enc.max.height) == (min(sides), max(sides)) == (672, 1568)
    base = resolve_model("tiny").geometry
    assert profile_range(base, "transformer", cfg) == cfg == profile_range(base, "vae_encoder", cfg)


def test_model_class_and_channels_must_agree(tmp_path):
    """A folder whose model_index.json class does not match its transformer's channels is refused."""
    import shutil

    src = resolve_model("tiny")
    shutil.copytree(src.path, tmp_path / "m")
    index = tmp_path / "m" / "model_index.json"
    index.write_text(json.dumps(dict(json.loads(index.read_text()), _class_name="FluxFillPipeline")))
    with pytest.raises(WorkflowError, match="FluxFillPipeline model's transformer takes 288 channels"):
        resolve_model(tmp_path / "m")
    index.write_text(json.dumps(dict(json.loads(index.read_text()), _class_name="FluxPriorReduxPipeline")))
    with pytest.raises(WorkflowError, match="names FluxPriorReduxPipeline; fluxtrt runs FluxPipeline"):
        resolve_model(tmp_path / "m")


def test_mask_of_another_size_is_resized_and_said(caplog):
    rng = np.random.default_rng()
    src = resolve_model("tiny-fill")
    pipe = open_pipeline(None, backend="torch", model=src, device="cpu", torch_dtype="fp32")
    with caplog.at_level("WARNING", logger="fluxtrt"):
        pipe.generate(["a cat"], 256, 256, 1, inputs=ImageInputs(image=random_image(rng, 256, 256),
                                                                   mask=random_mask(rng, 128, 192)))
    assert "--mask is 192x128 and --image 256x256: both are resized to 256x256" in caplog.text


def test_strength_that_leaves_no_step_is_refused():
    """diffusers runs int(steps * strength) rounded up from the end: a strength so small that no step is left
    (steps - steps * strength rounds to steps) is refused, any larger one runs at least one step."""
    rng = np.random.default_rng()
    pipe = open_pipeline(None, backend="torch", model=resolve_model("tiny"), device="cpu", torch_dtype="fp32")
    with pytest.raises(WorkflowError, match="--strength 1e-17 with 4 steps leaves no step"):
        pipe.generate(["a cat"], 256, 256, 4, inputs=ImageInputs(image=random_image(rng, 64, 64), strength=1e-17))
    res = pipe.generate(["a cat"], 256, 256, 4, trace=True, inputs=ImageInputs(image=random_image(rng, 64, 64),
                                                                                strength=0.01))
    assert len(res.latents_per_step) == 1


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing.png", "--image {}: no such file"),
    (lambda p: (p / "t.png").write_text("not an image") and p / "t.png", "--image {} is not a readable image"),
])
def test_cli_unreadable_image_is_one_line(tmp_path, make, message):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    path = make(tmp_path)
    res = CliRunner().invoke(app, ["run", "--backend", "torch", "--model", "tiny", "--prompt", "x", "--image",
                                   str(path), "--out", str(tmp_path / "o.png")])
    assert res.exit_code == 2 and message.format(path) in " ".join(res.output.split()), res.output
    assert not (tmp_path / "o.png").exists()


# --- engines: real TensorRT-RTX builds for sm89, run with ONNX Runtime -----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("workflow", list(MODEL))
def test_engines_build_with_the_workflows_profile(engines, workflow):
    src, folder, manifest = engines(MODEL[workflow])
    assert workflow in manifest.workflows and manifest.model.model_class == src.geometry.model_class
    parts = set() if workflow == "control" else {"transformer_head", "transformer_tail", "transformer_out"}
    assert set(manifest.components) == {"clip", "t5", "transformer", "vae_decoder", "vae_encoder"} | parts
    for name, e in manifest.components.items():
        assert (folder / e.engine).stat().st_size > 10_000 and e.layers > 10, name
    hidden = manifest.components["transformer"].profile["hidden_states"]
    assert hidden["max"][2] == src.geometry.in_channels  # 288 (Fill), 32 (Control), 16
    if workflow == "kontext":  # target tokens + the largest preferred reference's (800x1328: 4150)
        assert hidden["min"][1] == 16 * 16 + 4042 and hidden["max"][1] == 96 * 96 + 4150
        assert manifest.components["vae_encoder"].profile["image"]["max"][2:] == [1568, 1568]


@pytest.mark.slow
@pytest.mark.parametrize("workflow", list(MODEL))
@pytest.mark.parametrize("prompts,h,w", [
    (["a lighthouse on a rocky coast at night"], 256, 384),
    (["an oil painting of a lake", "a bowl of ramen"], 320, 256),
], ids=["non-square", "batch2"])
def test_onnxruntime_matches_diffusers(engines, workflow, prompts, h, w):
    src, folder, _ = engines(MODEL[workflow])
    compare(open_pipeline(folder, backend="onnxruntime"), src, workflow, prompts, h, w, 3, "onnxruntime")


@pytest.mark.slow
def test_cli_runs_a_workflow_and_says_which(engines, tmp_path):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    _, folder, _ = engines("tiny-fill")
    rng = np.random.default_rng()
    random_image(rng, 256, 256).save(tmp_path / "in.png")
    random_mask(rng, 256, 256).save(tmp_path / "mask.png")
    res = CliRunner().invoke(app, ["run", "--engines", str(folder), "--backend", "onnxruntime", "--prompt", "a cat",
                                   "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "mask.png"),
                                   "--height", "256", "--width", "256", "--steps", "2", "--out", str(tmp_path / "o.png")])
    assert res.exit_code == 0, res.output
    meta = Image.open(tmp_path / "o.png").text
    assert (meta["workflow"], meta["image"], meta["mask"], meta["strength"], meta["guidance"]) == \
        ("fill", "in.png", "mask.png", "1.0", "30.0")  # FluxFillPipeline's defaults
    res = CliRunner().invoke(app, ["run", "--engines", str(folder), "--backend", "onnxruntime", "--prompt", "a cat",
                                   "--control-image", str(tmp_path / "in.png")])
    assert res.exit_code == 2 and "--control-image cannot be used with these engines" in res.output


@pytest.mark.slow
def test_text_to_image_engines_without_an_encoder_refuse_img2img(tmp_path):
    """Engines built without the vae_encoder say how to get it."""
    pytest.importorskip("tensorrt_rtx")
    from fluxtrt.gpus import load_gpu
    from fluxtrt.runtime.pipeline import RequestError
    from fluxtrt.stages.build import build_gpu

    src = resolve_model("tiny-schnell")
    build_gpu(src, load_gpu("4090"), tmp_path, components=["clip", "t5", "transformer", "vae_decoder"])
    pipe = open_pipeline(tmp_path / "4090", backend="onnxruntime")
    with pytest.raises(RequestError, match="img2img needs the vae_encoder engine.*--components vae_encoder"):
        pipe.generate(["a cat"], 256, 256, 2, inputs=ImageInputs(image=random_image(np.random.default_rng(), 64, 64)))
