"""Block replication (#11): a zero-copy export that traces three blocks of each kind and replicates the
middle one equals a full trace of every block, node for node and output for output, and PyTorch."""

import json
import os
import shutil
from collections import Counter

import numpy as np
import onnx
import pytest

from fluxtrt.components import specs_for
from fluxtrt.export import export_component
from fluxtrt.models.source import resolve_model
from tests.helpers import export_checked

DEPTHS = {"transformer_blocks": 5, "single_transformer_blocks": 6}


@pytest.fixture(scope="module")
def deep_tiny(tmp_path_factory):
    """The tiny dev model with 5 double- and 6 single-stream blocks (random weights, sharded safetensors)."""
    import torch

    from fluxtrt.models.random_arch import random_component

    tiny = resolve_model("tiny")
    folder = tmp_path_factory.mktemp("deep") / "model"
    shutil.copytree(tiny.path, folder)
    cfg_path = folder / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(num_layers=DEPTHS["transformer_blocks"], num_single_layers=DEPTHS["single_transformer_blocks"])
    cfg_path.write_text(json.dumps(cfg))
    for f in (folder / "transformer").glob("*.safetensors*"):
        f.unlink()
    model = random_component("transformer", folder, torch.float32, seed=int.from_bytes(os.urandom(2), "little"))
    model.save_pretrained(folder / "transformer", max_shard_size="300KB")
    return resolve_model(str(folder))


def export(src, out, cache, monkeypatch, **kw):
    monkeypatch.setenv("FLUXTRT_CACHE", str(cache))  # no graph cache shared between the two exports
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    return export_checked(src, spec, out, zero_copy=True, **kw)


@pytest.mark.slow
def test_replicated_graph_equals_full_trace(deep_tiny, tmp_path, monkeypatch):
    """Replicated and full traces of the deep model: the same nodes, weights and outputs, both validated against
    PyTorch by the export itself; the exported (scope-less) graph cannot be replicated again."""
    from fluxtrt.onnxio import ort_session

    rep = export(deep_tiny, tmp_path / "rep", tmp_path / "c1", monkeypatch)
    full = export(deep_tiny, tmp_path / "full", tmp_path / "c2", monkeypatch, replicate_blocks=False)
    assert rep.zero_copy["replicated_blocks"] == DEPTHS and full.zero_copy["replicated_blocks"] == {}
    assert len(list((deep_tiny.path / "transformer").glob("*.safetensors"))) > 1  # links span shards
    # both validated against PyTorch by the export itself (fresh random inputs), same bound as every export
    assert rep.max_rel_err is not None and rep.max_rel_err <= 1e-4, rep.max_rel_err
    a = onnx.load(str(rep.path), load_external_data=False)
    b = onnx.load(str(full.path), load_external_data=False)
    assert len(a.graph.node) == len(b.graph.node)
    assert Counter(n.op_type for n in a.graph.node) == Counter(n.op_type for n in b.graph.node)

    def weights(m):
        return sorted((t.name, tuple(t.dims), t.data_type) for t in m.graph.initializer if t.data_location == 1)

    assert weights(a) == weights(b) and len(weights(a)) == rep.zero_copy["linked_tensors"]
    for blocks, depth in DEPTHS.items():  # every block's weights are present, the last one included
        assert any(n.startswith(f"{blocks}.{depth - 1}.") for n, _, _ in weights(a))
    spec = specs_for(deep_tiny.geometry, ["transformer"])["transformer"]
    from fluxtrt.export.trace import example_point

    seed = int.from_bytes(os.urandom(2), "little")
    feed = {k: v.numpy() for k, v in spec.sample_inputs(example_point(deep_tiny.geometry), deep_tiny.geometry,
                                                        seed).items()}
    out_a = ort_session(rep.path).run(None, feed)[0]
    out_b = ort_session(full.path).run(None, feed)[0]
    assert np.abs(out_a).max() > 0
    # the same operators on the same weights in another node order: equal to float32 rounding
    assert np.abs(out_a - out_b).max() <= 1e-6 * np.abs(out_b).max()
    # the exported file carries no per-node scopes: replicating it again is refused (export then traces every block)
    import onnx_ir as ir

    from fluxtrt.export.replicate import ReplicationError, replicate

    assert rep.zero_copy["graph"] == "traced"
    with pytest.raises(ReplicationError, match="expected blocks 0..2"):
        replicate(ir.load(str(rep.path)), DEPTHS)


@pytest.mark.slow
def test_t5_blocks_are_replicated_too(tmp_path, monkeypatch):
    """T5's encoder blocks (24 in T5-XXL) follow the same pattern: block 0 computes the relative position bias
    the others share. A 5-block tiny T5 replicated from 3 equals its full trace and validates against PyTorch."""
    import torch

    from fluxtrt.export.trace import example_point
    from fluxtrt.models.random_arch import random_component
    from fluxtrt.onnxio import ort_session

    folder = tmp_path / "model"
    shutil.copytree(resolve_model("tiny").path, folder)
    cfg_path = folder / "text_encoder_2" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "num_layers": 5}))
    for f in (folder / "text_encoder_2").glob("*.safetensors*"):
        f.unlink()
    random_component("text_encoder_2", folder, torch.float32, seed=int.from_bytes(os.urandom(2), "little")) \
        .save_pretrained(folder / "text_encoder_2")
    src = resolve_model(str(folder))
    spec = specs_for(src.geometry, ["t5"])["t5"]
    monkeypatch.setenv("FLUXTRT_CACHE", str(tmp_path / "c1"))
    rep = export_checked(src, spec, tmp_path / "rep", zero_copy=True)
    monkeypatch.setenv("FLUXTRT_CACHE", str(tmp_path / "c2"))
    full = export_component(src, spec, tmp_path / "full", zero_copy=True, replicate_blocks=False)
    assert rep.zero_copy["replicated_blocks"] == {"encoder.block": 5} and rep.max_rel_err <= 1e-4
    a = onnx.load(str(rep.path), load_external_data=False)
    b = onnx.load(str(full.path), load_external_data=False)
    assert Counter(n.op_type for n in a.graph.node) == Counter(n.op_type for n in b.graph.node)
    feed = {k: v.numpy() for k, v in spec.sample_inputs(example_point(src.geometry), src.geometry,
                                                        int.from_bytes(os.urandom(2), "little")).items()}
    out_a, out_b = ort_session(rep.path).run(None, feed)[0], ort_session(full.path).run(None, feed)[0]
    assert np.abs(out_b).max() > 0 and np.abs(out_a - out_b).max() <= 1e-6 * np.abs(out_b).max()


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_copying_export_traces_replicated_blocks_and_fills_the_weights(deep_tiny, tmp_path, monkeypatch, dtype):
    """A copying (non-zero-copy) export of a deep model also traces 3 blocks on meta and replicates them, then
    fills every weight from the checkpoint in the export dtype: same weights, bit for bit, and the same outputs
    as loading the module and tracing every block."""
    from fluxtrt.onnxio import load_onnx

    monkeypatch.setenv("FLUXTRT_CACHE", str(tmp_path / "c"))
    spec = specs_for(deep_tiny.geometry, ["transformer"])["transformer"]
    rep = export_checked(deep_tiny, spec, tmp_path / "rep", dtype)
    full = export_component(deep_tiny, spec, tmp_path / "full", dtype=dtype, replicate_blocks=False)
    assert rep.zero_copy is None and not (tmp_path / "rep" / "transformer.weights").exists()
    assert rep.max_rel_err is not None  # validated against PyTorch by the export, at the dtype's bound
    a, b = load_onnx(rep.path), load_onnx(full.path)
    assert len(a.graph.node) == len(b.graph.node)
    weights = {t.name: t for t in b.graph.initializer if t.name.endswith((".weight", ".bias"))}
    got = {t.name: t for t in a.graph.initializer if t.name in weights}
    assert len(weights) > 100 and got.keys() == weights.keys()
    assert all(got[n].raw_data == weights[n].raw_data and got[n].data_type == weights[n].data_type for n in weights)
