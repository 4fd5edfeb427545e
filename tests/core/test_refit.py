"""Engines and ONNX that take the user's own weights (#7): the build writes a weight map and a weight-free
ONNX per component; `fluxtrt run --weights` fills them from a checkpoint. ONNX Runtime runs the whole flow
here; TensorRT's refit path (refit_engine) needs a GPU and is checked with a stand-in refitter."""

import json
import shutil

import numpy as np
import onnx
import pytest

from fluxtrt.checkpoint import CheckpointReader
from fluxtrt.core import weightmap
from fluxtrt.core.refit import refit_engine
from fluxtrt.dtypes import np_dtype
from fluxtrt.errors import FluxtrtError
from fluxtrt.gpus import load_gpu
from fluxtrt.models.source import resolve_model
from fluxtrt.onnxio import external_info
from fluxtrt.runtime.assembly import open_pipeline
from fluxtrt.stages.build import build_gpu

RUN = ("clip", "t5", "transformer", "vae_decoder")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    src = resolve_model("tiny")
    root = tmp_path_factory.mktemp("weights-build")
    manifest, _ = build_gpu(src, load_gpu("4090"), root, components=list(RUN))
    return src, root / "4090", manifest


def test_build_writes_weight_map_and_weight_free_onnx(built):
    src, gpu_dir, manifest = built
    for name in RUN:
        e = manifest.components[name]
        assert e.refittable and not e.weightless
        wmap = json.loads((gpu_dir / e.weight_map).read_text())
        assert wmap["weights"] and wmap["subfolder"]
        free = onnx.load(str(gpu_dir / e.weightfree_onnx), load_external_data=False)
        mapped = {w["name"] for w in wmap["weights"]}
        for t in free.graph.initializer:
            if t.name in mapped:  # stripped: no bytes, only where they come from
                assert not t.raw_data and external_info(t)["location"] == weightmap.CHECKPOINT_LOCATION
        # the file shrank by the mapped weights' bytes (what stays: graph structure and the graph's constants)
        mapped_bytes = sum(int(np.prod(w["shape"])) * np_dtype(w["dtype"]).itemsize for w in wmap["weights"])
        full = (gpu_dir.parent / e.onnx).stat().st_size
        slack = 4096 + 64 * len(mapped)  # each stripped tensor keeps a few bytes saying where it comes from
        assert (gpu_dir / e.weightfree_onnx).stat().st_size <= full - mapped_bytes + slack, name


def generate(pipe):
    return pipe.generate(["a red fox in the snow"], 256, 384, 3, 3.5, seed=11).images


def test_weights_from_checkpoint_give_the_same_image(built, tmp_path, reweighted_copy):
    src, gpu_dir, _ = built
    normal = generate(open_pipeline(gpu_dir, backend="onnxruntime"))
    from_ckpt = generate(open_pipeline(gpu_dir, backend="onnxruntime", weights=src.path))
    assert normal.std() > 1
    assert np.array_equal(normal, from_ckpt)  # the same bits: every weight re-attached exactly
    # and the weights really come from the checkpoint: other weights, other image
    other = reweighted_copy(src, tmp_path / "other", seed=5)
    changed = generate(open_pipeline(gpu_dir, backend="onnxruntime", weights=other.path))
    assert np.abs(changed.astype(int) - normal.astype(int)).max() > 10


def test_checkpoint_mismatch_is_refused(built, tmp_path):
    from safetensors.torch import load_file, save_file

    src, gpu_dir, _ = built
    with pytest.raises(FluxtrtError, match="FLUX.1-schnell, the engines were built for FLUX.1-dev"):
        open_pipeline(gpu_dir, backend="onnxruntime", weights=resolve_model("tiny-schnell").path)
    broken = tmp_path / "broken"
    shutil.copytree(src.path, broken)
    f = next((broken / "transformer").glob("*.safetensors"))
    tensors = load_file(f)
    tensors.pop("proj_out.weight")
    save_file(tensors, f)
    pipe = open_pipeline(gpu_dir, backend="onnxruntime", weights=broken)
    with pytest.raises(FluxtrtError, match="has no tensor 'proj_out.weight'"):
        generate(pipe)
    # a tensor of another shape (another architecture's checkpoint)
    tensors["proj_out.weight"] = tensors["proj_out.bias"].new_zeros(3, 5) + 0.1
    save_file(tensors, f)
    pipe = open_pipeline(gpu_dir, backend="onnxruntime", weights=broken)
    with pytest.raises(FluxtrtError, match="the checkpoint's architecture differs"):
        generate(pipe)


def test_weightless_engine_needs_weights():
    from fluxtrt.runtime.executors import WeightSource
    from tests.helpers import entry

    with pytest.raises(FluxtrtError, match="pass --weights"):
        WeightSource.for_component(None, None, entry(weightless=True), "transformer")


@pytest.mark.slow
def test_weightless_build_on_cpu_is_refused_clearly(tmp_path):
    """The known obstacle, pinned: TensorRT-RTX 1.7 refuses STRIP_PLAN/REFIT builds without a GPU."""
    from fluxtrt.engine.build import BuildError

    with pytest.raises(BuildError, match="builds weightless engines only where the build machine has a supported GPU"):
        build_gpu(resolve_model("tiny"), load_gpu("4090"), tmp_path, components=["vae_decoder"], weightless=True)


def test_refit_sets_every_engine_weight_from_the_map(built):
    """refit_engine against the strict stand-in of TensorRT's Refitter (tests/fake_trt.py): every weight the
    stripped engine lists comes from the map in the prototype's dtype (bf16 as bf16); one the map lacks is named."""
    pytest.importorskip("tensorrt_rtx")
    from tests import fake_trt

    src, gpu_dir, manifest = built
    e = manifest.components["transformer"]
    wmap = json.loads((gpu_dir / e.weight_map).read_text())
    arrays = weightmap.materialize(wmap, CheckpointReader(src.path / "transformer"))
    kinds = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16"}
    refittable = {n: [kinds[str(a.dtype)], int(a.size)] for n, a in arrays.items()}
    assert "BF16" in {k for k, _ in refittable.values()}
    trt = fake_trt.module()
    engine = fake_trt.RTXCudaEngine({"refit": "refit", "refittable": refittable, "stripped": True,
                                     "device_memory": 0, "inputs": [], "outputs": []}, None)
    refit_engine(engine, trt, fake_trt.Logger(), arrays)
    assert engine.refitted and set(engine.current) == set(arrays)
    engine = fake_trt.RTXCudaEngine({"refit": "refit", "refittable": dict(refittable, not_in_the_map=["FLOAT", 3]),
                                     "stripped": True, "device_memory": 0, "inputs": [], "outputs": []}, None)
    with pytest.raises(FluxtrtError, match="still needs weights the weight map does not provide: not_in_the_map"):
        refit_engine(engine, trt, fake_trt.Logger(), arrays)


LORA_MODULES = ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v",
                "single_transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.proj_mlp")


def write_lora(src, path, rank=2, alpha=4.0):
    """A random transformer LoRA in diffusers/peft format for the tiny model."""
    import torch
    from safetensors.torch import load_file, save_file

    stored = {}
    for f in (src.path / "transformer").glob("*.safetensors"):
        stored.update(load_file(f))
    g = torch.Generator().manual_seed(int(np.random.randint(1 << 30)))
    lora = {}
    for m in LORA_MODULES:
        out_f, in_f = stored[f"{m}.weight"].shape
        lora[f"transformer.{m}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.5
        lora[f"transformer.{m}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.5
        lora[f"transformer.{m}.alpha"] = torch.tensor(alpha)
    save_file(lora, path)
    return stored, lora


def test_lora_is_applied_like_a_merged_checkpoint(built, tmp_path):
    """--lora adds scale * alpha/r * B @ A to the checkpoint's weights as they load (fused q/k/v included):
    the image equals the one from a checkpoint with the LoRA merged in beforehand (diffusers' fuse_lora)."""
    from safetensors.torch import save_file

    src, gpu_dir, _ = built
    stored, lora = write_lora(src, tmp_path / "lora.safetensors")
    scale = 0.8
    merged = tmp_path / "merged"
    shutil.copytree(src.path, merged)
    for f in (merged / "transformer").glob("*.safetensors"):
        f.unlink()
    for m in LORA_MODULES:
        a, b = lora[f"transformer.{m}.lora_A.weight"], lora[f"transformer.{m}.lora_B.weight"]
        stored[f"{m}.weight"] = stored[f"{m}.weight"] + scale * (4.0 / 2) * (b @ a)
    save_file({k: v.contiguous() for k, v in stored.items()}, merged / "transformer" / "diffusion_pytorch_model.safetensors")
    with_lora = generate(open_pipeline(gpu_dir, backend="onnxruntime", weights=src.path,
                                       lora=[f"{tmp_path / 'lora.safetensors'}:{scale}"]))
    premerged = generate(open_pipeline(gpu_dir, backend="onnxruntime", weights=merged))
    plain = generate(open_pipeline(gpu_dir, backend="onnxruntime", weights=src.path))
    assert np.abs(with_lora.astype(int) - premerged.astype(int)).max() <= 1
    assert np.abs(with_lora.astype(int) - plain.astype(int)).max() > 10


def test_lora_for_another_model_is_refused(built, tmp_path):
    import torch
    from safetensors.torch import save_file

    src, gpu_dir, _ = built
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(2, 7),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(5, 2)}, tmp_path / "bad.safetensors")
    pipe = open_pipeline(gpu_dir, backend="onnxruntime", weights=src.path, lora=tmp_path / "bad.safetensors")
    with pytest.raises(FluxtrtError, match="the LoRA is for another model"):
        generate(pipe)
    save_file({"transformer.no_such_block.lora_A.weight": torch.randn(2, 7),
               "transformer.no_such_block.lora_B.weight": torch.randn(5, 2)}, tmp_path / "other.safetensors")
    pipe = open_pipeline(gpu_dir, backend="onnxruntime", weights=src.path, lora=tmp_path / "other.safetensors")
    with pytest.raises(FluxtrtError, match="targets weights the transformer does not have: no_such_block.weight"):
        generate(pipe)
    with pytest.raises(FluxtrtError, match="--lora on engines or ONNX needs --weights"):
        open_pipeline(gpu_dir, backend="onnxruntime", lora=tmp_path / "other.safetensors")
