"""Engines and ONNX that take the user's own weights (#7): the build writes a weight map and a weight-free
ONNX per component; `fluxtrt run --weights` fills them from a checkpoint. ONNX Runtime runs the whole flow
here; TensorRT's refit path (weightmap.refit_engine) needs a GPU and is checked with a stand-in refitter."""

import json
import shutil

import numpy as np
import onnx
import pytest

from fluxtrt import weightmap
from fluxtrt.build.pipeline import build_gpu
from fluxtrt.errors import FluxtrtError
from fluxtrt.gpus import load_gpu
from fluxtrt.models.source import resolve_model
from fluxtrt.onnxio import external_info
from fluxtrt.runtime.pipeline import FluxEngines

RUN = ("clip", "t5", "transformer", "vae_decoder")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    src = resolve_model("tiny")
    root = tmp_path_factory.mktemp("weights-build")
    manifest, _ = build_gpu(src, load_gpu("4090"), root, list(RUN))
    return src, root / "4090", manifest


def test_build_writes_weight_map_and_weight_free_onnx(built):
    src, gpu_dir, manifest = built
    for name in RUN:
        e = manifest["components"][name]
        assert e["refittable"] and not e["weightless"]
        wmap = json.loads((gpu_dir / e["weight_map"]).read_text())
        assert wmap["weights"] and wmap["subfolder"]
        free = onnx.load(str(gpu_dir / e["weightfree_onnx"]), load_external_data=False)
        mapped = {w["name"] for w in wmap["weights"]}
        for t in free.graph.initializer:
            if t.name in mapped:  # stripped: no bytes, only where they come from
                assert not t.raw_data and external_info(t)["location"] == weightmap.CHECKPOINT_LOCATION
        # the file shrank by the mapped weights' bytes (what stays: graph structure and the graph's constants)
        mapped_bytes = sum(int(np.prod(w["shape"])) * weightmap.np_dtype(w["dtype"]).itemsize for w in wmap["weights"])
        full = (gpu_dir.parent / e["onnx"]).stat().st_size
        slack = 4096 + 64 * len(mapped)  # each stripped tensor keeps a few bytes saying where it comes from
        assert (gpu_dir / e["weightfree_onnx"]).stat().st_size <= full - mapped_bytes + slack, name


def generate(pipe):
    return pipe.generate(["a red fox in the snow"], 256, 384, 3, 3.5, seed=11).images


def test_weights_from_checkpoint_give_the_same_image(built, tmp_path, reweighted_copy):
    src, gpu_dir, _ = built
    normal = generate(FluxEngines(gpu_dir, "onnxruntime"))
    from_ckpt = generate(FluxEngines(gpu_dir, "onnxruntime", weights=src.path))
    assert normal.std() > 1
    assert np.array_equal(normal, from_ckpt)  # the same bits: every weight re-attached exactly
    # and the weights really come from the checkpoint: other weights, other image
    other = reweighted_copy(src, tmp_path / "other", seed=5)
    changed = generate(FluxEngines(gpu_dir, "onnxruntime", weights=other.path))
    assert np.abs(changed.astype(int) - normal.astype(int)).max() > 10


def test_checkpoint_mismatch_is_refused(built, tmp_path):
    from safetensors.torch import load_file, save_file

    src, gpu_dir, _ = built
    with pytest.raises(FluxtrtError, match="FLUX.1-schnell, the engines were built for FLUX.1-dev"):
        FluxEngines(gpu_dir, "onnxruntime", weights=resolve_model("tiny-schnell").path)
    broken = tmp_path / "broken"
    shutil.copytree(src.path, broken)
    f = next((broken / "transformer").glob("*.safetensors"))
    tensors = load_file(f)
    tensors.pop("proj_out.weight")
    save_file(tensors, f)
    pipe = FluxEngines(gpu_dir, "onnxruntime", weights=broken)
    with pytest.raises(FluxtrtError, match="has no tensor 'proj_out.weight'"):
        generate(pipe)


def test_weightless_engine_needs_weights():
    from fluxtrt.runtime.executors import WeightSource

    with pytest.raises(FluxtrtError, match="pass --weights"):
        WeightSource.for_component(None, None, {"weightless": True}, "transformer")


def test_weightless_build_on_cpu_is_refused_clearly(tmp_path):
    """The known obstacle, pinned: TensorRT-RTX 1.7 refuses STRIP_PLAN/REFIT builds without a GPU."""
    from fluxtrt.build.engine import BuildError

    with pytest.raises(BuildError, match="builds weightless engines only where the build machine has a supported GPU"):
        build_gpu(resolve_model("tiny"), load_gpu("4090"), tmp_path, ["vae_decoder"], weightless=True)


class _StandInTrt:
    """Records what refit_engine asks of TensorRT's Refitter (no GPU can run the real one here)."""

    class DataType:
        BF16 = "bf16"

    class Weights:
        def __init__(self, *args):
            self.args = args

    def __init__(self, wanted):
        self.wanted, self.set = wanted, {}
        trt = self

        class Refitter:
            def __init__(self, engine, logger):
                pass

            def get_all_weights(self):
                return list(trt.wanted)

            def set_named_weights(self, name, w):
                trt.set[name] = w.args
                return True

            def refit_cuda_engine(self):
                return True

        self.Refitter = Refitter


def test_refit_sets_every_engine_weight_from_the_map(built):
    src, gpu_dir, manifest = built
    e = manifest["components"]["transformer"]
    wmap = json.loads((gpu_dir / e["weight_map"]).read_text())
    arrays = weightmap.materialize(wmap, weightmap.CheckpointReader(src.path / "transformer"))
    trt = _StandInTrt(list(arrays))
    weightmap.refit_engine(object(), trt, None, arrays)
    assert set(trt.set) == set(arrays)
    bf16 = [n for n, a in arrays.items() if a.dtype == weightmap.np_dtype("bfloat16")]
    assert bf16 and all(trt.set[n][0] == "bf16" and trt.set[n][2] == arrays[n].size for n in bf16)
    trt_missing = _StandInTrt(list(arrays) + ["not_in_the_map"])
    with pytest.raises(FluxtrtError, match="does not provide: not_in_the_map"):
        weightmap.refit_engine(object(), trt_missing, None, arrays)
