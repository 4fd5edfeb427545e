"""The runtime's GPU discipline, exercised through the torch executor on a CUDA GPU (the lent H200 runs these
through scripts/gpu_check.sh). Without a GPU every test here is skipped with that reason."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA GPU on this machine (CI has none); "
                                                         "scripts/gpu_check.sh runs these on a GPU")]

MAX_UINT8_DIFF = 2


@pytest.fixture(scope="module")
def tiny_gpu():
    from fluxtrt.models.source import resolve_model

    return resolve_model("tiny")


def _pipe(src, **kw):
    from fluxtrt.runtime.pipeline import FluxEngines

    return FluxEngines(None, "torch", model=src, device="cuda", **kw)


@pytest.mark.parametrize("h,w,batch", [(256, 256, 1), (256, 384, 2)])
def test_tiny_on_gpu_matches_diffusers(tiny_gpu, h, w, batch):
    """fp32 on both sides: our pipeline over the torch executor vs diffusers' FluxPipeline, same GPU."""
    prompts = ["a red fox in the snow", "a lighthouse at night"][:batch]
    ours = _pipe(tiny_gpu, torch_dtype="fp32").generate(prompts, h, w, 6, 3.5, seed=11)
    dpipe = tiny_gpu.load_pipeline(torch.float32, "cuda")
    ref = dpipe(prompts, height=h, width=w, num_inference_steps=6, guidance_scale=3.5,
                generator=torch.Generator().manual_seed(11), output_type="np").images
    ref = (ref * 255).round().astype("uint8")
    diff = int(np.abs(ours.images.astype(int) - ref.astype(int)).max())
    print(f"tiny {h}x{w} batch {batch}: max |ours - diffusers| = {diff}/255")
    assert diff <= MAX_UINT8_DIFF


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["cuda-graph", "eager"])
def test_no_host_sync_inside_the_denoising_loop(tiny_gpu, cuda_graph):
    pipe = _pipe(tiny_gpu, cuda_graph=cuda_graph)
    pipe.generate(["warm up"], 256, 256, 2, seed=0)  # first call: capture, lazy init (outside the check)
    pipe.sync_check = True  # torch.cuda.set_sync_debug_mode("error") around the loop
    res = pipe.generate(["a cat"], 256, 256, 4, seed=1)
    assert res.images.shape == (1, 256, 256, 3)


def test_cuda_graph_replay_equals_eager(tiny_gpu):
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.runtime.pipeline import CudaGraphStep

    pipe = _pipe(tiny_gpu, torch_dtype="bf16")
    ex = pipe.executors["transformer"]
    spec = specs_for(pipe.geo)["transformer"]
    feeds = {k: v.cuda() for k, v in spec.sample_inputs(ShapePoint(2, 256, 384), pipe.geo, seed=5).items()}
    graph = CudaGraphStep(ex, feeds, pipe.stream)
    graph.set_call_inputs(feeds)
    for seed in (6, 7):  # replay with new step inputs each time
        step_in = spec.sample_inputs(ShapePoint(2, 256, 384), pipe.geo, seed=seed)
        lat, ts = step_in["hidden_states"].cuda(), step_in["timestep"].cuda()
        with torch.cuda.stream(pipe.stream):
            replay = graph(lat, ts).clone()
            eager = ex.infer(dict(feeds, hidden_states=lat, timestep=ts))["noise_pred"]
        torch.cuda.synchronize()
        assert torch.equal(replay, eager), float((replay.float() - eager.float()).abs().max())


def test_graphs_and_buffers_are_made_once_per_shape(tiny_gpu):
    pipe = _pipe(tiny_gpu, cuda_graph=True)
    pipe.generate(["a"], 256, 256, 2, seed=0)
    first = dict(pipe._graphs)
    pipe.generate(["b"], 256, 256, 3, seed=1)
    assert pipe._graphs == first and len(first) == 1  # same shape: the same graph and static buffers
    pipe.generate(["c"], 256, 384, 2, seed=2)
    assert len(pipe._graphs) == 2


def test_low_vram_frees_each_stage(tiny_gpu):
    pipe = _pipe(tiny_gpu, low_vram=True)
    res = pipe.generate(["a cat"], 256, 256, 2, seed=0)
    assert res.timings.peak_memory_gb is not None and res.timings.peak_memory_gb > 0
    assert all(not ex.active and ex.module is None for ex in pipe.executors.values())
    res2 = pipe.generate(["a cat"], 256, 256, 2, seed=0)  # stages come back from the CPU copy
    assert np.array_equal(res.images, res2.images)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda-graph"])
def test_true_cfg_on_gpu_matches_diffusers(tiny_gpu, cuda_graph):
    """--negative-prompt / --true-cfg on the GPU: two transformer calls per step (with a CUDA graph, one graph
    shared by both, refilled per call) equal diffusers' true_cfg_scale; no host sync inside the loop."""
    prompts, negative = ["a red fox in the snow"], "blurry"
    pipe = _pipe(tiny_gpu, torch_dtype="fp32", cuda_graph=cuda_graph)
    pipe.generate(prompts, 256, 256, 2, seed=0, negative_prompts=[negative], true_cfg=4.0)  # capture, warm-up
    pipe.sync_check = True
    ours = pipe.generate(prompts, 256, 256, 6, 3.5, seed=11, negative_prompts=[negative], true_cfg=4.0)
    dpipe = tiny_gpu.load_pipeline(torch.float32, "cuda")
    ref = dpipe(prompts, height=256, width=256, num_inference_steps=6, guidance_scale=3.5, negative_prompt=negative,
                true_cfg_scale=4.0, generator=torch.Generator().manual_seed(11), output_type="np").images
    ref = (ref * 255).round().astype("uint8")
    diff = int(np.abs(ours.images.astype(int) - ref.astype(int)).max())
    print(f"true CFG ({'graph' if cuda_graph else 'eager'}): max |ours - diffusers| = {diff}/255")
    assert diff <= MAX_UINT8_DIFF


def test_peak_memory_is_at_least_what_torch_saw(tiny_gpu):
    """MemoryWatch samples the device's used memory between stages (TensorRT allocates outside torch): never less
    than torch's own peak for the call."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    pipe = _pipe(tiny_gpu, torch_dtype="fp32")
    torch.cuda.reset_peak_memory_stats()
    res = pipe.generate(["a cat"], 512, 512, 2, seed=0)
    torch_peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    again = pipe.generate(["a cat"], 512, 512, 2, seed=0)  # weights already loaded: still counted
    print(f"peak GPU GB: reported {res.timings.peak_memory_gb:.3f} / {again.timings.peak_memory_gb:.3f}, "
          f"torch's {torch_peak:.3f}")
    assert res.timings.peak_memory_gb >= 0.99 * torch_peak > 0
    assert again.timings.peak_memory_gb >= 0.99 * torch_peak
