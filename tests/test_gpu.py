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
    from fluxtrt.runtime.assembly import open_pipeline

    return open_pipeline(None, backend="torch", model=src, device="cuda", **kw)


@pytest.mark.parametrize("h,w,batch", [(256, 256, 1), (256, 384, 2)])
def test_tiny_on_gpu_matches_diffusers(tiny_gpu, h, w, batch):
    """fp32 on both sides: our pipeline over the torch executor vs diffusers' FluxPipeline, same GPU."""
    prompts = ["a red fox in the snow", "a lighthouse at night"][:batch]
    ours = _pipe(tiny_gpu, torch_dtype="fp32").generate(prompts, h, w, 6, 3.5, seed=11)
    assert _diff_to_diffusers(tiny_gpu, prompts, h, w, ours.images, "torch executor") <= MAX_UINT8_DIFF


def _diff_to_diffusers(src, prompts, h, w, images, label: str) -> int:
    """max |ours - diffusers' fp32 FluxPipeline on this GPU| in uint8 steps, 6 steps, guidance 3.5, seed 11."""
    dpipe = src.load_pipeline(torch.float32, "cuda")
    ref = dpipe(prompts, height=h, width=w, num_inference_steps=6, guidance_scale=3.5,
                generator=torch.Generator().manual_seed(11), output_type="np").images
    ref = (ref * 255).round().astype("uint8")
    diff = int(np.abs(images.astype(int) - ref.astype(int)).max())
    print(f"tiny {h}x{w} batch {len(prompts)}, {label}: max |ours - diffusers| = {diff}/255")
    return diff


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["cuda-graph", "eager"])
def test_no_host_sync_inside_the_denoising_loop(tiny_gpu, cuda_graph):
    pipe = _pipe(tiny_gpu, cuda_graph=cuda_graph)
    pipe.generate(["warm up"], 256, 256, 2, seed=0)  # first call: capture, lazy init (outside the check)
    pipe.sync_check = True  # torch.cuda.set_sync_debug_mode("error") around the loop
    res = pipe.generate(["a cat"], 256, 256, 4, seed=1)
    assert res.images.shape == (1, 256, 256, 3)


def test_cuda_graph_replay_equals_eager(tiny_gpu):
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.runtime.steps import CudaGraphStep

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
    first = dict(pipe.steps.graphs)
    pipe.generate(["b"], 256, 256, 3, seed=1)
    assert pipe.steps.graphs == first and len(first) == 1  # same shape: the same graph and static buffers
    pipe.generate(["c"], 256, 384, 2, seed=2)
    assert len(pipe.steps.graphs) == 2


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


# ---- ONNX Runtime on the GPU (onnxruntime-gpu: the CUDA execution provider, IOBinding on the pipeline's stream)


@pytest.fixture(scope="module")
def tiny_fp32_engines(tmp_path_factory):
    """fp32 tiny engines: ONNX Runtime runs the ONNX they were built from. FLUXTRT_TEST_ENGINES names a folder
    built elsewhere (the H200 has no TensorRT-RTX unless staged; scripts/ort_gpu_check.sh carries one), else
    they are built here."""
    import os
    from pathlib import Path

    from fluxtrt.gpus import load_gpu
    from fluxtrt.models.source import resolve_model

    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime {ort.__version__} has no CUDA provider (pip install 'fluxtrt[gpu]')")
    if os.environ.get("FLUXTRT_TEST_ENGINES"):
        return resolve_model("tiny"), Path(os.environ["FLUXTRT_TEST_ENGINES"])
    pytest.importorskip("tensorrt_rtx", reason="no FLUXTRT_TEST_ENGINES and no tensorrt-rtx to build them")
    from fluxtrt.stages.build import build_gpu

    root = tmp_path_factory.mktemp("ort-gpu")
    cfg = load_gpu("4090").with_precision({c: "fp32" for c in load_gpu("4090").precision})
    build_gpu(resolve_model("tiny"), cfg, root, components=["clip", "t5", "transformer", "vae_decoder"])
    return resolve_model("tiny"), root / "4090"


@pytest.mark.parametrize("h,w,batch", [(256, 256, 1), (256, 384, 2)])
def test_tiny_on_onnx_runtime_cuda_matches_diffusers(tiny_fp32_engines, h, w, batch):
    """fp32 on both sides, TF32 off on both (ONNX Runtime: use_tf32=0; PyTorch: matmul and cuDNN)."""
    from fluxtrt.runtime.assembly import open_pipeline

    src, engines = tiny_fp32_engines
    prompts = ["a red fox in the snow", "a lighthouse at night"][:batch]
    pipe = open_pipeline(engines, backend="onnxruntime", ort_provider="cuda")
    assert {str(ex.device) for ex in pipe.executors.values()} == {"cuda:0"}
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    ours = pipe.generate(prompts, h, w, 6, 3.5, seed=11)
    assert _diff_to_diffusers(src, prompts, h, w, ours.images, "ONNX Runtime CUDA") <= MAX_UINT8_DIFF


def test_onnx_runtime_cuda_queues_the_step_without_waiting(tiny_fp32_engines):
    """A transformer call returns before the GPU has run it: ~0.5 s of GPU sleep queued first on the
    pipeline's stream, then two calls, each of which must come back in well under that (a host synchronisation
    or device-to-host copy inside would wait for the sleep); the results equal a synchronous call's. Two, not
    more: CUDA's launch queue holds ~1024 pending launches (measured on the H200: the 1025th torch launch behind
    a sleep blocks) and one tiny transformer call on ONNX Runtime is ~300 kernels, so the fourth call waits for
    room whatever issues it. The loop then runs under torch's sync check too."""
    import time

    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.runtime.assembly import open_pipeline

    _, engines = tiny_fp32_engines
    pipe = open_pipeline(engines, backend="onnxruntime", ort_provider="cuda")
    pipe.generate(["warm up"], 256, 256, 2, seed=0)
    ex = pipe.executors["transformer"]
    spec = specs_for(pipe.geo, ["transformer"])["transformer"]
    feeds = {k: v.cuda() for k, v in spec.sample_inputs(ShapePoint(1, 256, 256), pipe.geo, seed=3).items()}
    with torch.cuda.stream(pipe.stream):
        want = ex.infer(feeds)["noise_pred"].clone()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s at H200 clocks (measured below)
        end.record()
        outs, hosts = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            outs.append(ex.infer(feeds)["noise_pred"])
            hosts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    slept = start.elapsed_time(end) / 1000
    print(f"GPU sleep {slept:.3f} s; ONNX Runtime transformer calls returned after "
          f"{', '.join(f'{h * 1000:.1f}' for h in hosts)} ms")
    assert slept > 0.2 and max(hosts) < slept / 4
    assert all(torch.equal(o, want) for o in outs)
    pipe.sync_check = True  # torch.cuda.set_sync_debug_mode("error") around the loop
    assert pipe.generate(["a cat"], 256, 256, 3, seed=1).images.shape == (1, 256, 256, 3)
