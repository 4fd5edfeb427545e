"""Zero-copy export (#11): the ONNX's initializers point into the checkpoint's safetensors files; nothing of
the weights is written or loaded, offsets are right, and ONNX Runtime on it equals PyTorch."""

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from fluxtrt.checkpoint import checkpoint_index
from fluxtrt.components import specs_for
from fluxtrt.errors import FluxtrtError
from fluxtrt.export import export_component
from fluxtrt.models.source import resolve_model
from fluxtrt.onnxio import external_info, load_onnx, read_external
from tests.helpers import export_checked


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def zero_copy_exports(tmp_path_factory):
    src = resolve_model("tiny")
    out = tmp_path_factory.mktemp("zc")
    results = {n: export_checked(src, s, out, zero_copy=True) for n, s in specs_for(src.geometry).items()}
    return src, out, results


def test_matches_pytorch_and_writes_no_weights(zero_copy_exports):
    src, out, results = zero_copy_exports
    for name, r in results.items():
        assert r.max_rel_err is not None and r.max_rel_err <= 1e-4, (name, r.max_rel_err)  # same bound as export
        spec = specs_for(src.geometry, [name])[name]
        stored = sum(os.path.getsize(f) for f in (src.path / spec.subfolder).glob("*.safetensors"))
        links = out / f"{name}.weights"
        assert all(p.is_symlink() for p in links.iterdir()) and any(links.iterdir())
        assert not (out / f"{name}.onnx.data").exists()
        model = onnx.load(str(r.path), load_external_data=False)
        inline = sum(len(t.raw_data) for t in model.graph.initializer)
        external = [t for t in model.graph.initializer if external_info(t) is not None]
        assert r.zero_copy["linked_tensors"] == len(external) > 0
        # what was written inline is the graph's own constants and buffers: a small fraction of the weights
        assert inline < 0.1 * stored, (name, inline, stored)
        assert r.bytes < os.path.getsize(r.path) + 4096 * len(list(links.iterdir())) + 1


def test_offsets_point_at_the_right_tensors(zero_copy_exports):
    from safetensors.numpy import load_file

    src, out, results = zero_copy_exports
    for name, r in results.items():
        spec = specs_for(src.geometry, [name])[name]
        tensors = {}
        for f in (src.path / spec.subfolder).glob("*.safetensors"):
            tensors.update(load_file(f))
        # which stored tensor sits at each (file, offset): tied weights (T5's shared/embed_tokens) keep the
        # graph's name but point at the one copy the checkpoint holds
        at = {(e.file.name, e.offset): k for k, e in checkpoint_index(src.path / spec.subfolder).items()}
        model = onnx.load(str(r.path), load_external_data=False)
        checked = 0
        for t in model.graph.initializer:
            info = external_info(t)
            if info is None:
                continue
            key = at[(Path(info["location"]).name, int(info["offset"]))]
            assert key == t.name or name == "t5", (key, t.name)
            want = tensors[key]
            got = np.frombuffer(read_external(r.path, t), dtype=want.dtype).reshape(tuple(t.dims))
            assert np.array_equal(got, want), t.name
            assert onnx.helper.tensor_dtype_to_np_dtype(t.data_type) == want.dtype
            checked += 1
        assert checked == r.zero_copy["linked_tensors"]


def test_optimize_on_zero_copy_graph_never_touches_the_checkpoint(zero_copy_exports, exported, tmp_path):
    """The optimize stage reads a zero-copy graph (through the links), writes its own file, and gives the
    same optimized weights as the normal export; the checkpoint's bytes and mtime are unchanged."""
    from onnx import numpy_helper

    from fluxtrt.optimize.graph import optimize_file

    src, out, results = zero_copy_exports
    ckpt = next((src.path / "transformer").glob("*.safetensors"))
    before = (sha(ckpt), os.stat(ckpt).st_mtime_ns)
    optimize_file(results["transformer"].path, tmp_path / "zc-opt.onnx", "transformer", dtype="bf16",
                  count_layers=False)
    _, normal_dir, _ = exported("tiny")
    optimize_file(normal_dir / "transformer.onnx", tmp_path / "normal-opt.onnx", "transformer", dtype="bf16",
                  count_layers=False)
    assert (sha(ckpt), os.stat(ckpt).st_mtime_ns) == before
    a, b = (load_onnx(tmp_path / f) for f in ("zc-opt.onnx", "normal-opt.onnx"))
    wa = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    wb = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    assert wa.keys() == wb.keys()
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)


def test_bf16_checkpoint_stays_bf16(tmp_path):
    """A bf16 checkpoint gives a bf16 graph whose initializers are the stored bytes, validated against
    PyTorch on the same bf16 weights (bf16 bound)."""
    import torch
    from safetensors.torch import load_file, save_file

    src = resolve_model("tiny")
    folder = tmp_path / "tiny-bf16"
    shutil.copytree(src.path, folder)
    for f in (folder / "transformer").glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f)
    bf = resolve_model(str(folder))
    spec = specs_for(bf.geometry, ["transformer"])["transformer"]
    r = export_checked(bf, spec, tmp_path / "out", "bf16", zero_copy=True)
    assert r.dtype == "bf16" and r.max_rel_err <= 1e-1
    model = onnx.load(str(r.path), load_external_data=False)
    types = {t.data_type for t in model.graph.initializer if external_info(t) is not None}
    assert types == {onnx.TensorProto.BFLOAT16}


def test_refusals(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = resolve_model("tiny")
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    with pytest.raises(FluxtrtError, match="no weights on disk"):
        export_component(resolve_model("random:flux.1-schnell"), spec, tmp_path / "a", zero_copy=True)
    folder = tmp_path / "mixed"
    shutil.copytree(src.path, folder)
    f = next((folder / "transformer").glob("*.safetensors"))
    tensors = load_file(f)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].to(torch.float16)
    save_file(tensors, f)
    with pytest.raises(FluxtrtError, match="mixes float dtypes"):
        export_component(resolve_model(str(folder)), spec, tmp_path / "b", zero_copy=True)
    for p in (folder / "transformer").glob("*.safetensors"):
        p.unlink()
    with pytest.raises(FluxtrtError, match="no .safetensors files"):
        export_component(resolve_model(str(folder)), spec, tmp_path / "c", zero_copy=True)


def test_moved_checkpoint_is_a_clear_error(tmp_path):
    src = resolve_model("tiny")
    folder = tmp_path / "tiny-copy"
    shutil.copytree(src.path, folder)
    spec = specs_for(src.geometry, ["vae_decoder"])["vae_decoder"]
    r = export_component(resolve_model(str(folder)), spec, tmp_path / "out", zero_copy=True)
    shutil.rmtree(folder / "vae")
    with pytest.raises(FluxtrtError, match="was moved or deleted"):
        load_onnx(r.path)


def test_second_export_of_an_architecture_relinks_the_cached_graph(tmp_path, reweighted_copy):
    """A traced graph depends on the architecture, not the weights: a later zero-copy export of the same
    architecture (the same model again, or a fine-tune with other weights) re-points the cached graph at its own
    shards instead of tracing, and is validated against its own PyTorch module like any export."""
    src = resolve_model("tiny")
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    first = export_component(src, spec, tmp_path / "a", zero_copy=True)
    again = export_component(src, spec, tmp_path / "b", zero_copy=True)
    assert first.zero_copy["graph"] in ("traced", "from cache") and again.zero_copy["graph"] == "from cache"
    assert again.path.read_bytes() == first.path.read_bytes()  # same links, same offsets: the same file
    other = reweighted_copy(src, tmp_path / "finetune", seed=9)
    r = export_checked(other, spec, tmp_path / "c", zero_copy=True)
    assert r.zero_copy["graph"] == "from cache" and r.max_rel_err <= 1e-4  # ORT on the relinked graph == PyTorch
    assert all(os.path.realpath(p).startswith(str(other.path)) for p in (tmp_path / "c" / "transformer.weights").iterdir())
    # another architecture (schnell: no guidance embedder, shorter T5) never gets this graph
    from fluxtrt.export.zerocopy import template_key

    schnell = resolve_model("tiny-schnell")
    s_spec = specs_for(schnell.geometry, ["transformer"])["transformer"]
    keys = {template_key(m.path / "transformer", sp, m.geometry, 19, "fp32") for m, sp in ((src, spec), (schnell, s_spec))}
    assert len(keys) == 2
    assert template_key(other.path / "transformer", spec, other.geometry, 19, "fp32") in keys  # weights don't matter


def test_zero_copy_export_identifies_the_model_by_layout(tmp_path):
    """export.json of a zero-copy export names the model by its layout hash (headers, sizes, mtimes, small
    files) rather than hashing every weight byte; rewriting a shard changes it."""
    import json
    import time

    from fluxtrt import api

    src = resolve_model("tiny")
    folder = tmp_path / "tiny-copy"
    shutil.copytree(src.path, folder)
    model = resolve_model(str(folder))
    before = model.layout_hash
    api.export(str(folder), tmp_path / "out", ["vae_decoder"], validate=False, zero_copy=True)
    info = json.loads((tmp_path / "out" / "export.json").read_text())
    assert info["model_hash"] == before and info["model_hash_kind"] == "layout"
    shard = next((folder / "vae").glob("*.safetensors"))
    time.sleep(0.01)
    shard.write_bytes(shard.read_bytes())  # same bytes, rewritten: a new mtime
    assert resolve_model(str(folder)).layout_hash != before


def test_scalars_made_on_meta_while_tracing_keep_their_values():
    """A zero-copy trace runs on `meta`; transformers 5.17's eager attention mask makes `torch.tensor(0.0,
    device=mask.device)` there, which had no value, so the exported T5 wanted a checkpoint tensor
    'encoder.lifted_tensor_0'. While tracing, such scalars are made on the CPU and keep their values."""
    import torch

    from fluxtrt.export.trace import constants_keep_values

    v = float(np.random.default_rng().uniform(1.0, 2.0))

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, device="meta")

        def forward(self, x):
            h = self.lin(x)
            return torch.where(h > 0, torch.tensor(v, device=h.device, dtype=h.dtype), h)

    with constants_keep_values():
        ep = torch.export.export(Masked(), (torch.empty(2, 4, device="meta"),))
        vector = torch.tensor([v, v], device="meta")
    consts = list(ep.constants.values())
    assert len(consts) == 1 and consts[0].device.type == "cpu" and consts[0].item() == pytest.approx(v)
    assert vector.device.type == "meta"  # only scalars move: a CPU vector would not mix with meta tensors
    assert torch.tensor(v, device="meta").device.type == "meta"  # torch.tensor is itself again afterwards
    ep_plain = torch.export.export(Masked(), (torch.empty(2, 4, device="meta"),))
    assert [c.device.type for c in ep_plain.constants.values()] == ["meta"]  # what failed before
