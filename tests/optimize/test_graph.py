"""optimize/graph.py: running the passes over a graph file: names checked, output written atomically."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fluxtrt.errors import FluxtrtError
from fluxtrt.optimize.graph import check_passes, optimize_model, save_model
from fluxtrt.optimize.passes import DEFAULT_PASSES


def test_pass_names_are_checked_with_the_list():
    assert check_passes(None) == list(DEFAULT_PASSES)
    with pytest.raises(FluxtrtError, match="unknown pass\\(es\\) fuse_everything; available: cleanup"):
        check_passes(["cleanup", "fuse_everything"])


def test_a_saved_graph_reads_back_and_large_weights_go_beside_it(tmp_path):
    rng = np.random.default_rng()
    w = rng.standard_normal((64, 64)).astype(np.float32)
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    optimized, report = optimize_model(model, ["cleanup"], "fp32")
    save_model(optimized, tmp_path / "a.onnx")
    save_model(optimized, tmp_path / "b.onnx", external_threshold=1024)
    assert not (tmp_path / "a.onnx.data").exists() and (tmp_path / "b.onnx.data").exists()
    for name in ("a.onnx", "b.onnx"):
        back = onnx.load(str(tmp_path / name))
        assert np.array_equal(numpy_helper.to_array(back.graph.initializer[0]), w)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
