"""First-Block Cache (fluxtrt/stepcache.py) against diffusers' own hook (`transformer.enable_cache(
FirstBlockCacheConfig(threshold=T))`): at thresholds where diffusers skips some steps but not all, the torch
executor skips the same steps and gives the same latents and images, for every workflow and true CFG; T = 0 is
the uncached run bit for bit; served images equal `fluxtrt run` with the same T; the CLI records it."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from fluxtrt.cli import app
from fluxtrt.core.workflows import WORKFLOWS, ImageInputs
from fluxtrt.models.source import resolve_model
from fluxtrt.runtime.assembly import open_pipeline
from tests.core.test_workflows import inputs_for

MAX_UINT8_DIFF = 2
LATENT_BOUND = 1e-4  # torch executor (fp32, CPU) vs diffusers, max |diff| of the latents after every step
THRESHOLDS = (0.3, 0.5, 0.8, 1.2, 2.0)  # tried in order: the first at which diffusers skips some, not all
CASES = [("tiny", "txt2img", 6), ("tiny-schnell", "txt2img", 4), ("tiny", "img2img", 8),
         ("tiny-fill", "fill", 6), ("tiny-control", "control", 6), ("tiny-kontext", "kontext", 5)]


def diffusers_run(src, workflow, prompts, h, w, steps, guidance, seed, inputs, threshold, negative=None):
    """(uint8 images, latents per step, steps that ran the tail: the cond branch's with true CFG) of diffusers'
    pipeline with its own cache."""
    from diffusers.hooks import FirstBlockCacheConfig

    pipe = src.load_pipeline(diffusers_pipeline=WORKFLOWS[workflow].diffusers_pipeline)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    ran, latents = [], []  # per transformer call: whether its tail ran (true CFG: cond, then uncond, each step)
    pipe.transformer.register_forward_pre_hook(lambda *a: ran.append(False))
    pipe.transformer.single_transformer_blocks[-1].attn.register_forward_pre_hook(
        lambda *a: ran.__setitem__(-1, True))  # runs only when the tail runs
    extra = {"negative_prompt": [negative] * len(prompts), "true_cfg_scale": 2.5} if negative else {}
    import contextlib

    # FluxPipeline names its branches itself; diffusers' image pipelines call the transformer outside any cache
    # context (the hook then raises), so their one branch is named here, as fluxtrt names it
    own = workflow == "txt2img"
    with contextlib.nullcontext() if own else pipe.transformer.cache_context("cond"):
        img = pipe(prompt=prompts, height=h, width=w, num_inference_steps=steps, guidance_scale=guidance,
                   max_sequence_length=src.geometry.t5_length, generator=torch.Generator().manual_seed(seed),
                   output_type="np", callback_on_step_end=lambda p, i, t, kw: (latents.append(kw["latents"].clone()),
                                                                               {})[1],
                   **WORKFLOWS[workflow].diffusers_kwargs(inputs), **extra).images
    # fluxtrt counts a true-CFG step by its cond branch (stepcache.FirstBlockCache.record): the branches decide
    # apart, and may disagree
    return (img * 255).round().astype("uint8"), latents, sum(ran[::2] if negative else ran)


def compare(model, workflow, steps, negative=None, pipe=None, bound=LATENT_BOUND):
    """`pipe` (default: the torch executor, fp32) with First-Block Cache against diffusers' own, at the first
    threshold where diffusers skips some steps but not all."""
    src = resolve_model(model)
    pipe = pipe or open_pipeline(None, backend="torch", model=src, device="cpu", torch_dtype="fp32")
    rng = np.random.default_rng()
    prompts, h, w = ["a red fox in the snow", "a bowl of ramen"], 256, 320
    seed, guidance = int(rng.integers(0, 2**31)), float(rng.uniform(2.0, 8.0))
    inputs = inputs_for(workflow, rng, h, w) if workflow != "txt2img" else ImageInputs()
    for threshold in THRESHOLDS:
        ref, ref_latents, computed = diffusers_run(src, workflow, prompts, h, w, steps, guidance, seed, inputs,
                                                   threshold, negative)
        if 1 <= computed < len(ref_latents):
            break
    else:
        pytest.fail(f"{model}: diffusers skipped no step or all steps at every threshold in {THRESHOLDS}")
    res = pipe.generate(prompts, h, w, steps, guidance, seed=seed, trace=True, inputs=inputs, cache_threshold=threshold,
                        negative_prompts=[negative] * 2 if negative else None, true_cfg=2.5 if negative else 1.0)
    assert res.timings.cache == {"threshold": threshold, "computed": computed,
                                 "skipped": len(ref_latents) - computed}, (res.timings.cache, computed)
    for i, (a, b) in enumerate(zip(res.latents_per_step, ref_latents, strict=True)):
        err = float((a - b).abs().max())
        assert err < bound, f"{model}: latents diverge from diffusers' at step {i}: {err:.2e}"
    diff = int(np.abs(res.images.astype(int) - ref.astype(int)).max())
    assert diff <= MAX_UINT8_DIFF and res.images.std() > 1, diff
    uncached = pipe.generate(prompts, h, w, steps, guidance, seed=seed, inputs=inputs,
                             negative_prompts=[negative] * 2 if negative else None, true_cfg=2.5 if negative else 1.0)
    assert np.abs(uncached.images.astype(int) - res.images.astype(int)).max() > 0  # the skipped steps show
    return pipe, threshold, seed, computed


@pytest.mark.slow
@pytest.mark.parametrize("model,workflow,steps", CASES, ids=[f"{m}-{w}" for m, w, _ in CASES])
def test_torch_executor_skips_the_steps_diffusers_skips(model, workflow, steps):
    compare(model, workflow, steps)


def test_true_cfg_branches_keep_their_own_cache():
    compare("tiny", "txt2img", 6, negative="blurry, low quality")


def test_zero_threshold_is_the_uncached_run_bit_for_bit():
    pipe = open_pipeline(None, backend="torch", model=resolve_model("tiny"), device="cpu", torch_dtype="fp32")
    seed = int(np.random.default_rng().integers(0, 2**31))
    a = pipe.generate(["a lighthouse"], 256, 256, 4, 3.5, seed=seed, cache_threshold=0.0)
    b = pipe.generate(["a lighthouse"], 256, 256, 4, 3.5, seed=seed)
    assert np.array_equal(a.images, b.images) and a.timings.cache is None


def test_served_images_equal_run_with_the_same_threshold():
    """Three requests in one continuous batch, each deciding for itself (one uncached), against `fluxtrt run`
    batch 1 with the same threshold and seed: same steps skipped, images within 2/255."""
    from fluxtrt.runtime.batching import ContinuousBatcher

    pipe = open_pipeline(None, backend="torch", model=resolve_model("tiny"), device="cpu", torch_dtype="fp32")
    batcher = ContinuousBatcher(pipe, max_batch=4)
    seeds = [int(s) for s in np.random.default_rng().integers(0, 2**31, 3)]
    asks = [(0.5, seeds[0]), (0.0, seeds[1]), (1.2, seeds[2])]
    futures = [batcher.submit("a red fox", 256, 256, 6, 3.5, seed=seed, n=1, cache_threshold=t) for t, seed in asks]
    batcher.run_until_idle()
    assert batcher.stats.batch_histogram[3] >= 1  # they did share the transformer
    for (t, seed), fut in zip(asks, futures):
        done = fut.result()
        alone = pipe.generate(["a red fox"], 256, 256, 6, 3.5, seed=seed, cache_threshold=t)
        assert done.caches[0] == alone.timings.cache
        assert int(np.abs(done.images[0].astype(int) - alone.images[0].astype(int)).max()) <= MAX_UINT8_DIFF
    assert futures[2].result().caches[0]["skipped"] > 0  # the test exercises a skip


def test_cli_records_the_cache_and_refuses_where_it_cannot_run(tmp_path):
    runner = CliRunner()
    out = tmp_path / "a.png"
    res = runner.invoke(app, ["run", "--backend", "torch", "--model", "tiny", "--prompt", "a fox", "--steps", "6",
                              "--height", "256", "--width", "256", "--torch-dtype", "fp32", "--cache-threshold", "1.2",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    meta = Image.open(out).text
    assert float(meta["cache_threshold"]) == 1.2 and int(meta["steps_computed"]) + int(meta["steps_skipped"]) == 6
    assert int(meta["steps_skipped"]) > 0 and "computed / skipped" in res.output
    bad = runner.invoke(app, ["run", "--backend", "torch", "--model", "tiny", "--prompt", "x", "--cache-threshold",
                              "-1", "--out", str(tmp_path / "b.png")])
    assert bad.exit_code == 2 and "--cache-threshold must be at least 0" in bad.output
    bench = runner.invoke(app, ["bench", "--backend", "torch", "--model", "tiny", "--sizes", "256", "--steps", "6",
                                "--runs", "1", "--warmup", "0", "--torch-dtype", "fp32", "--cache-threshold", "1.2",
                                "--json", str(tmp_path / "b.json")])
    assert bench.exit_code == 0, bench.output
    rows = json.loads((tmp_path / "b.json").read_text())
    row = rows["rows"][0] if isinstance(rows, dict) else rows[0]
    assert row["cache"]["threshold"] == 1.2 and row["cache"]["skipped"] > 0


@pytest.mark.parametrize("value,message", [(-0.1, "in 0.0..10.0"), ("0.2", "must be a number"), (float("inf"), "number"),
                                           (True, "must be a number")])
def test_a_request_threshold_is_checked(value, message):
    from fluxtrt.serving import BadRequest, parse_request

    with pytest.raises(BadRequest, match=message):
        parse_request(json.dumps({"prompt": "x", "cache_threshold": value}).encode(), (256, 256), 4)
    assert parse_request(b'{"prompt": "x"}', (256, 256), 4, 0.2).cache_threshold == 0.2  # the server's default


# --- the split engines: real TensorRT-RTX builds (sm89), their ONNX in ONNX Runtime ------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("model,workflow,steps", [c for c in CASES if c[0] != "tiny-control"],
                         ids=[f"{m}-{w}" for m, w, _ in CASES if m != "tiny-control"])
def test_split_onnx_in_onnxruntime_skips_the_steps_diffusers_skips(engines, model, workflow, steps):
    """ONNX Runtime over the parts' ONNX of a real fp32 build (`fluxtrt build --first-block-cache`)."""
    src, folder, manifest = engines(model)
    pipe = open_pipeline(folder, backend="onnxruntime")
    assert {"transformer_head", "transformer_tail", "transformer_out"} <= set(pipe.executors)
    compare(model, workflow, steps, pipe=pipe, bound=1e-3)


@pytest.mark.slow
def test_split_parts_take_weights_and_lora_from_a_checkpoint(engines, tmp_path):
    """--weights and --lora fill every part through its weight map: the cached image equals the one from the
    engines' own weights, and a LoRA changes it as it changes the uncached one."""
    from tests.core.test_refit import write_lora

    src, folder, _ = engines("tiny")
    seed = int(np.random.default_rng().integers(0, 2**31))

    def image(pipe, t):
        return pipe.generate(["a red fox"], 256, 256, 6, 3.5, seed=seed, cache_threshold=t)

    own = image(open_pipeline(folder, backend="onnxruntime"), 0.5)
    from_ckpt = image(open_pipeline(folder, backend="onnxruntime", weights=src.path), 0.5)
    assert own.timings.cache == from_ckpt.timings.cache and own.timings.cache["skipped"] > 0
    assert np.abs(own.images.astype(int) - from_ckpt.images.astype(int)).max() <= 1
    write_lora(src, tmp_path / "lora.safetensors")
    lora = open_pipeline(folder, backend="onnxruntime", weights=src.path, lora=tmp_path / "lora.safetensors")
    assert np.abs(image(lora, 0.5).images.astype(int) - own.images.astype(int)).max() > 10


@pytest.mark.slow
@pytest.mark.parametrize("gpu,checkpoint", [("4090", "bf16"), ("5090", "bf16"), ("4090", "fp32")])
def test_split_engines_build_and_inspect(gpu, checkpoint, tiny_bf16, tmp_path):
    """The parts build for the 4090 (sm89) and the 5090 (sm120) at the config's transformer precision (bf16), from
    a bf16 checkpoint (the zero-copy path FLUX.1 checkpoints take) and from an fp32 one (the copying path: bf16
    placed on the fp32 graph, every part validated against PyTorch; the head's temb, a graph output the head also
    reads on, used to reach a bf16 Gemm as fp32 there), and `fluxtrt inspect` lists them; their layer and size
    reports are what docs/benchmarks.md tabulates."""
    from fluxtrt import api
    from fluxtrt.components import TRANSFORMER_PARTS

    model = str(tiny_bf16.path) if checkpoint == "bf16" else "tiny"
    summary = api.build(gpu=gpu, model=model, out_dir=tmp_path, components=["transformer"], first_block_cache=True,
                        precision=["transformer=bf16"])
    comps = summary.manifest.components
    assert set(TRANSFORMER_PARTS) | {"transformer"} == set(comps)
    assert {comps[p].precision for p in TRANSFORMER_PARTS} == {comps["transformer"].precision} == {"bf16"}
    for p in TRANSFORMER_PARTS:
        assert comps[p].layers > 10 and comps[p].bytes > 10_000 and comps[p].refittable
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / gpu)])
    assert res.exit_code == 0 and all(p in res.output for p in TRANSFORMER_PARTS), res.output
    computed = sum(comps[p].computed_layers for p in TRANSFORMER_PARTS)
    print(f"{gpu}: transformer {comps['transformer'].computed_layers} computed layers, {comps['transformer'].bytes} B;"
          f" parts {computed} computed layers, {sum(comps[p].bytes for p in TRANSFORMER_PARTS)} B")


def test_cache_threshold_on_engines_without_parts_is_one_line(tmp_path):
    from fluxtrt.runtime.pipeline import RequestError

    pipe = open_pipeline(None, backend="torch", model=resolve_model("tiny"), device="cpu", torch_dtype="fp32")
    import types

    pipe.executors["transformer"] = types.SimpleNamespace(kind="tensorrt")  # an engine without the parts beside it
    with pytest.raises(RequestError, match="rebuild with `fluxtrt build --first-block-cache`"):
        pipe.steps.step_cache(0.2)
