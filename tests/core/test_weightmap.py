"""The weight map (#7): every weight of the optimized graph is derived from a checkpoint tensor by a
recorded recipe (names, shapes, transposes, casts, fused q/k/v concatenations), reproduced exactly."""

import numpy as np
import pytest

from fluxtrt.checkpoint import CheckpointReader
from fluxtrt.components import specs_for
from fluxtrt.core import weightmap
from fluxtrt.models.source import resolve_model

COMPONENTS = ("clip", "t5", "transformer", "vae_decoder")


_EXPORTS = {}


def optimized(source, component, out, dtype):
    """Export (once per checkpoint and component) then optimize at `dtype`."""
    from fluxtrt.export import export_component
    from fluxtrt.onnxio import load_onnx
    from fluxtrt.optimize.graph import optimize_model

    key = (str(source.path), component)
    if key not in _EXPORTS:
        spec = specs_for(source.geometry, [component])[component]
        _EXPORTS[key] = export_component(source, spec, out).path
    model, _ = optimize_model(load_onnx(_EXPORTS[key]), None, dtype, component)
    return model


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, reweighted_copy):
    base = resolve_model("tiny")
    other = reweighted_copy(base, tmp_path_factory.mktemp("ckpt") / "tiny-b", seed=int(np.random.randint(1 << 30)))
    return base, other


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("component", COMPONENTS)
def test_weight_map_reproduces_every_weight(two_checkpoints, component, dtype, tmp_path):
    from onnx import numpy_helper

    maps, inits = [], []
    for k, src in enumerate(two_checkpoints):
        spec = specs_for(src.geometry, [component])[component]
        model = optimized(src, component, tmp_path / str(k), dtype)
        wmap = weightmap.build_map(model, component, spec.subfolder)
        reader = CheckpointReader(src.path / spec.subfolder)
        got = weightmap.materialize(wmap, reader)
        graph = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        for name, arr in got.items():  # names, shapes, dtypes and values, bit for bit
            assert graph[name].dtype == arr.dtype and graph[name].shape == arr.shape, name
            assert np.array_equal(graph[name].view(np.uint8), np.ascontiguousarray(arr).view(np.uint8)), name
        # none ambiguous: one entry per name, and every source tensor is stored exactly once
        names = [e["name"] for e in wmap["weights"]]
        assert len(names) == len(set(names))
        assert set(wmap["checkpoint_tensors"]) <= set(reader.index)
        # the component's part of the checkpoint is used completely (every stored tensor feeds some weight)
        other_half = ("encoder.", "quant_conv.") if component == "vae_decoder" else ()
        assert set(wmap["checkpoint_tensors"]) == {k for k in reader.index if not k.startswith(other_half or "\0")}
        maps.append(wmap)
        inits.append(graph)
    # none missing: an initializer that changes with the checkpoint must be in the map
    assert [e["name"] for e in maps[0]["weights"]] == [e["name"] for e in maps[1]["weights"]]
    mapped = {e["name"] for e in maps[0]["weights"]}
    assert inits[0].keys() == inits[1].keys()
    changed = {n for n in inits[0] if not np.array_equal(inits[0][n], inits[1][n])}
    assert changed, "the two checkpoints should differ"
    assert changed <= mapped, f"weights outside the map: {sorted(changed - mapped)[:5]}"
    assert mapped <= changed | {n for n in mapped if inits[0][n].size <= 1}


@pytest.mark.slow
def test_fused_projection_is_a_recorded_concat(two_checkpoints, tmp_path):
    """The transformer's q/k/v fusion appears in the map as a concat of three transposed checkpoint tensors."""
    src = two_checkpoints[0]
    model = optimized(src, "transformer", tmp_path, "fp32")
    wmap = weightmap.build_map(model, "transformer", "transformer")
    fused = [e for e in wmap["weights"] if e["recipe"].get("op") == "concat" and e["recipe"]["axis"] == 1]
    assert fused, "no fused projection weights in the map"
    parts = fused[0]["recipe"]["of"]
    assert len(parts) >= 3 and all(p["op"] == "transpose" and "tensor" in p["of"] for p in parts)
    assert any(p["of"]["tensor"].endswith("attn.to_q.weight") for p in parts)


@pytest.mark.slow
def test_unknown_checkpoint_tensor_is_refused(two_checkpoints, tmp_path):
    from fluxtrt.errors import FluxtrtError

    src = two_checkpoints[0]
    model = optimized(src, "vae_decoder", tmp_path, "fp32")
    wmap = weightmap.build_map(model, "vae_decoder", "vae")
    wmap["weights"][0]["recipe"] = {"tensor": "decoder.not_there.weight"}
    with pytest.raises(FluxtrtError, match="has no tensor 'decoder.not_there.weight'"):
        weightmap.materialize(wmap, CheckpointReader(src.path / "vae"))
