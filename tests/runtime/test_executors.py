"""The ONNX Runtime executor without a GPU: IOBinding on the CPU provider (the same binding code the CUDA
provider runs), graphs of any dtype through it, outputs preallocated from the component specs, and the choice
of execution provider (`--ort-provider`). Its GPU side is in tests/test_gpu.py."""

import os

import numpy as np
import pytest
import torch

from fluxtrt.components import ComponentSpec, ShapePoint, TensorSpec, specs_for
from fluxtrt.errors import BackendUnavailableError, FluxtrtError
from fluxtrt.records import ComponentEntry


def _entry(onnx_path):
    from fluxtrt.fileio import sha256_file

    return ComponentEntry(engine="", sha256="", bytes=0, precision="", onnx=str(onnx_path),
                          onnx_sha256=sha256_file(onnx_path), build_key="", layers=0, inputs=[], outputs=[], profile={})


@pytest.mark.parametrize("model", ["tiny", "tiny-schnell"])
def test_output_shapes_from_input_shapes_for_every_component(model):
    """What the executor preallocates equals the spec's shapes at the request's size, for sizes and batches
    drawn fresh (Kontext's reference tokens included)."""
    from fluxtrt.components import ALL
    from fluxtrt.models.source import resolve_model

    geo = resolve_model(model).geometry
    rng = np.random.default_rng()
    for _ in range(5):
        m = geo.pixel_multiple
        point = ShapePoint(int(rng.integers(1, 5)), int(rng.integers(8, 40)) * m, int(rng.integers(8, 40)) * m,
                           reference=(int(rng.integers(8, 20)) * m, int(rng.integers(8, 20)) * m))
        for name, spec in specs_for(geo, list(ALL)).items():
            assert spec.output_shapes_for(spec.input_shapes(point, geo), geo) == spec.output_shapes(point, geo), name


def _toy_bf16_graph(path):
    """y = bf16(2 * float(x) + w), x and y bf16 [batch, image_tokens, 4]: ops ONNX Runtime's CPU provider has
    bf16 kernels for, so the session binds bf16 as it is (no widening)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng().standard_normal(4).astype(np.float32), "w")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xf", "two"], ["x2"]), helper.make_node("Add", ["x2", "w"], ["yf"]),
             helper.make_node("Cast", ["yf"], ["y"], to=TensorProto.BFLOAT16)]
    dims = ["batch", "image_tokens", 4]
    g = helper.make_graph(nodes, "toy", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, dims)],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, dims)], [w, two])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    spec = ComponentSpec("toy", "", (TensorSpec("x", "float32", ("batch", "image_tokens", 4)),),
                         (TensorSpec("y", "float32", ("batch", "image_tokens", 4)),), 0.0, lambda m: m)
    return spec, numpy_helper.to_array(w)


def test_bf16_bound_as_bf16_through_iobinding(tmp_path, monkeypatch):
    """A bf16 graph whose inputs and outputs stay bf16 (as on a GPU provider): fp32 feeds are cast to the
    graph's type on the way in, the output is a preallocated bf16 torch tensor, values exact."""
    from fluxtrt.models.source import resolve_model
    from fluxtrt.onnxio import ort_session
    from fluxtrt.runtime.executors import OnnxRuntimeExecutor

    spec, w = _toy_bf16_graph(tmp_path / "toy.onnx")
    # the session as a GPU provider would make it: bf16 kept (the CPU path would widen the graph to fp32)
    monkeypatch.setattr("fluxtrt.core.sessions.runnable_session", lambda p, providers, *_: ort_session(p, providers))
    ex = OnnxRuntimeExecutor("toy", _entry(tmp_path / "toy.onnx"), tmp_path / "toy.onnx", spec,
                             resolve_model("tiny").geometry)
    x = torch.randn(3, int(np.random.default_rng().integers(5, 50)), 4)
    y = ex.infer({"x": x})["y"]
    want = (2 * x.to(torch.bfloat16).float() + torch.from_numpy(w)).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and torch.equal(y, want)
    assert [i.type for i in ex.session.get_inputs()] == ["tensor(bfloat16)"]


def test_fp32_widens_a_bf16_graph_a_gpu_provider_keeps(tmp_path):
    """`fluxtrt validate --fp32`: a bf16 graph that a GPU provider runs as bf16 is run widened to fp32 instead
    (weights widened exactly, bf16 casts made fp32), and computes the fp32 result exactly."""
    import warnings

    from fluxtrt.core.sessions import runnable_session

    _, w = _toy_bf16_graph(tmp_path / "toy.onnx")
    gpu_first = ["CUDAExecutionProvider", "CPUExecutionProvider"]  # this machine's ONNX Runtime falls back to CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = runnable_session(tmp_path / "toy.onnx", gpu_first)
        wide = runnable_session(tmp_path / "toy.onnx", gpu_first, None, True)
    assert [i.type for i in kept.get_inputs()] == ["tensor(bfloat16)"] and not getattr(kept, "_fluxtrt_widened", False)
    assert [i.type for i in wide.get_inputs()] == ["tensor(float)"] and wide._fluxtrt_widened
    x = np.random.default_rng().standard_normal((2, 7, 4)).astype(np.float32)
    y = wide.run(None, {"x": x})[0]
    assert y.dtype == np.float32 and np.array_equal(y, 2 * x + w)


@pytest.fixture(scope="module")
def bf16_transformer(tiny_bf16, tmp_path_factory):
    """The tiny transformer stored in bf16, through the zero-copy path (linked bf16 weights, graph passes)."""
    from fluxtrt.stages.build import ensure_onnx

    path, _ = ensure_onnx(tiny_bf16, "transformer", "bf16", tmp_path_factory.mktemp("zc"), validate=False)
    return tiny_bf16, path


def test_zero_copy_bf16_transformer_through_the_executor(bf16_transformer):
    """The executor (IOBinding, CPU provider: the bf16 graph widened) gives exactly what ONNX Runtime's plain
    numpy run gives, and matches the PyTorch module with the same bf16-rounded weights in fp32 within the
    fp32 bound (bf16 inputs given: cast to the session's type on the way in)."""
    from fluxtrt.core.sessions import cpu_session
    from fluxtrt.runtime.executors import OnnxRuntimeExecutor

    src, path = bf16_transformer
    geo = src.geometry
    spec = specs_for(geo, ["transformer"])["transformer"]
    ex = OnnxRuntimeExecutor("transformer", _entry(path), path, spec, geo)
    feeds = spec.sample_inputs(ShapePoint(2, 256, 320), geo, seed=int(np.random.default_rng().integers(0, 2**31)))
    feeds = {k: v.to(torch.bfloat16) if v.is_floating_point() and k in ("hidden_states",) else v
             for k, v in feeds.items()}
    out = ex.infer(feeds)["noise_pred"]
    assert out.shape == spec.output_shapes(ShapePoint(2, 256, 320), geo)["noise_pred"]
    plain = cpu_session(path).run(None, {k: v.float().numpy() for k, v in feeds.items()})[0]
    assert np.array_equal(out.numpy(), plain)
    module = spec.wrap(src.load_component(spec.subfolder, torch.float32, "cpu")).eval()
    with torch.inference_mode():
        ref = module(*[feeds[t.name].float() for t in spec.inputs])
    rel = float((out - ref).abs().max() / ref.abs().max())
    print(f"zero-copy bf16 transformer via IOBinding vs PyTorch: {rel:.1e}")
    assert 0 < rel <= spec.rtol_fp32


def test_provider_choice(monkeypatch):
    import onnxruntime as ort

    from fluxtrt.runtime.choice import ort_provider

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ort_provider("auto") == "cpu" and ort_provider("cpu") == "cpu"
    with pytest.raises(FluxtrtError, match="--ort-provider rocm: choose auto, cpu, cuda, tensorrt, tensorrt-rtx"):
        ort_provider("rocm")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(BackendUnavailableError, match=r"offers CPUExecutionProvider; pip install "
                                                      r"'fluxtrt\[gpu\]'.*or use --ort-provider cpu"):
        ort_provider("cuda")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        ort_provider("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ort_provider("auto") == "cuda" and ort_provider("cuda") == "cuda"
    with pytest.raises(BackendUnavailableError, match="TensorrtExecutionProvider"):
        ort_provider("tensorrt")


def test_gpu_provider_options_follow_the_pipeline_stream(tmp_path):
    """On a GPU provider the session runs on the pipeline's stream and TF32 is off (fp32 as PyTorch's)."""
    from fluxtrt.runtime.executors import OnnxRuntimeExecutor

    class Stream:
        cuda_stream = 140_000_123

    spec, _ = _toy_bf16_graph(tmp_path / "toy.onnx")
    ex = OnnxRuntimeExecutor("toy", _entry(tmp_path / "toy.onnx"), tmp_path / "toy.onnx", spec, None, provider="tensorrt")
    ex.stream = Stream()
    trt, cuda, cpu = ex.providers()
    assert trt == ("TensorrtExecutionProvider", {"device_id": "0", "has_user_compute_stream": "1",
                                                 "user_compute_stream": "140000123"})
    assert cuda[0] == "CUDAExecutionProvider" and cuda[1]["use_tf32"] == "0" and cpu == "CPUExecutionProvider"
    assert str(ex.device) == "cuda:0"
    with pytest.raises(FluxtrtError, match="choose cpu, cuda, tensorrt, tensorrt-rtx"):
        OnnxRuntimeExecutor("toy", None, tmp_path / "toy.onnx", spec, None, provider="directml")


def test_torch_executor_pads_a_batch_to_its_bucket_and_cuts_it_back():
    """A server's compiled transformer sees only its batch buckets: 3 samples run as 4 (the last repeated) and
    come back as 3, equal to the same samples run unpadded (the samples never mix); the First-Block Cache parts
    pad the same way."""
    from fluxtrt.models.source import resolve_model
    from fluxtrt.runtime.executors import TorchExecutor

    src = resolve_model("tiny")
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    feeds = spec.sample_inputs(ShapePoint(3, 256, 256), src.geometry, int(np.random.default_rng().integers(1 << 30)))
    plain = TorchExecutor("transformer", src, spec, "cpu", "fp32")
    padded = TorchExecutor("transformer", src, spec, "cpu", "fp32", batch_buckets=(1, 2, 4))
    want, got = plain.infer(feeds)["noise_pred"], padded.infer(feeds)["noise_pred"]
    assert got.shape == want.shape and got.shape[0] == 3
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    head = specs_for(src.geometry, ["transformer_head"])["transformer_head"]
    part_feeds = {k: v for k, v in feeds.items() if k in {t.name for t in head.inputs}}
    a, b = plain.infer_part(head, part_feeds), padded.infer_part(head, part_feeds)
    assert all(b[k].shape == a[k].shape and torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
    assert padded.padded(spec, feeds)[0]["hidden_states"].shape[0] == 4 and plain.padded(spec, feeds)[1] is None


def test_compiled_modules_keep_their_kernels_in_fluxtrts_cache(tmp_path, monkeypatch):
    """torch.compile's on-disk caches go to fluxtrt's cache folder (FLUXTRT_CACHE), which outlives /tmp, unless
    the user chose TORCHINDUCTOR_CACHE_DIR; set before the first compile, so Inductor reads it."""
    from fluxtrt.models.source import resolve_model
    from fluxtrt.runtime.executors import TorchExecutor

    src = resolve_model("tiny")
    spec = specs_for(src.geometry, ["vae_decoder"])["vae_decoder"]
    seen = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: seen.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR")) or m)
    monkeypatch.setenv("FLUXTRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    TorchExecutor("vae_decoder", src, spec, "cpu", "fp32").activate()
    assert seen == [] and "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # eager: nothing set
    TorchExecutor("vae_decoder", src, spec, "cpu", "fp32", compile=True).activate()
    assert seen == [str(tmp_path / "cache" / "inductor")]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    TorchExecutor("vae_decoder", src, spec, "cpu", "fp32", compile=True).activate()
    assert seen[-1] == str(tmp_path / "mine")


def test_load_probe_runs_one_child_for_the_folder_and_remembers(packages, tmp_path, monkeypatch):
    """LoadProbe: the folder's packages loaded in one child process, once; a later probe of the same packages
    (another process, the same torch) starts no child; a crash in the child is the probe's one line, raised by
    wait() and by every wait after it. Packages linking the shared libstdc++ (as fluxtrt builds them) need no
    child at all."""
    from fluxtrt.core import packages as pk
    from fluxtrt.errors import FluxtrtError
    from fluxtrt.runtime.executors import LoadProbe

    _, folder, manifest = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    monkeypatch.setenv("FLUXTRT_CACHE", str(tmp_path))  # where loaded packages are remembered
    entries = {n: (folder / manifest.components[n].engine, manifest.components[n].sha256)
               for n in ("transformer", "transformer_head")}
    calls = []
    real = pk.probe_load
    monkeypatch.setattr(pk, "probe_load", lambda paths, device: calls.append(sorted(paths)) or real(paths, device))
    LoadProbe(entries, "cpu").wait()
    assert calls == []  # these link the shared libstdc++: no child
    monkeypatch.setattr(pk, "links_shared_libstdcxx", lambda path: False)  # as a statically linked package
    monkeypatch.setenv("FLUXTRT_CACHE", str(tmp_path / "again"))
    probe = LoadProbe(entries, "cpu")
    probe.start()
    probe.wait()
    LoadProbe(entries, "cpu").wait()
    assert calls == [["transformer", "transformer_head"]]
    crashing = LoadProbe({"transformer_out": (folder / "transformer_out.pt2", "f" * 64)}, "cpu")
    monkeypatch.setattr(pk, "_PROBE", "import os; os.kill(os.getpid(), 11)")
    for _ in range(2):
        with pytest.raises(FluxtrtError, match="^transformer_out: this torch .* crashes loading transformer_out.pt2"):
            crashing.wait()
