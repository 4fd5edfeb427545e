"""core/sessions.py: the one place ONNX Runtime sessions are made; bf16 graphs widened to fp32 on the CPU."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fluxtrt.core.sessions import runnable_session, upcast_bf16
from fluxtrt.dtypes import cast


def bf16_matmul(path, weight):
    w = numpy_helper.from_array(cast(weight, "bfloat16").view(np.uint16), "w")
    w.data_type = TensorProto.BFLOAT16
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
             helper.make_node("MatMul", ["xb", "w"], ["yb"]), helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), str(path))


def test_a_bf16_graph_runs_on_the_cpu_widened(tmp_path):
    """ONNX Runtime's CPU provider has no bf16 MatMul: the session widens the graph to fp32, and the result is the
    bf16 weights' product in fp32."""
    rng = np.random.default_rng()
    weight = rng.standard_normal((8, 4)).astype(np.float32)
    bf16_matmul(tmp_path / "m.onnx", weight)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    got = runnable_session(tmp_path / "m.onnx").run(None, {"x": x})[0]
    want = x @ cast(weight, "bfloat16").astype(np.float32)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
    widened = upcast_bf16(onnx.load(str(tmp_path / "m.onnx")))
    assert all(t.data_type != TensorProto.BFLOAT16 for t in widened.graph.initializer)
