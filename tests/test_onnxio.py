"""onnxio.py: every ONNX file fluxtrt opens goes through it: broken files are one line, external data and
fluxtrt's links into a checkpoint are followed."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fluxtrt.errors import FluxtrtError
from fluxtrt.onnxio import load_header, load_onnx, ort_session


def small_model(weight):
    w = numpy_helper.from_array(weight, "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_external_data_is_read_back_and_runs(tmp_path):
    rng = np.random.default_rng()
    weight = rng.standard_normal((8, 4)).astype(np.float32)
    onnx.save(small_model(weight), str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)
    header = load_header(tmp_path / "m.onnx")
    assert header.graph.initializer[0].data_location == TensorProto.EXTERNAL
    full = load_onnx(tmp_path / "m.onnx")
    assert np.array_equal(numpy_helper.to_array(full.graph.initializer[0]), weight)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    assert np.allclose(ort_session(tmp_path / "m.onnx").run(None, {"x": x})[0], x @ weight, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("content,says", [(b"", "(empty)"), (b"\x0a\xff\xff\xff", "truncated or corrupt"),
                                          (b"\x08\x07", "no graph in it")])
def test_every_onnx_reader_refuses_a_broken_file_in_one_line(tmp_path, content, says):
    from fluxtrt.onnxio import load_header, load_onnx

    path = tmp_path / "x.onnx"
    path.write_bytes(content)
    for read in (load_header, load_onnx):
        with pytest.raises(FluxtrtError, match=f"is not an ONNX model .*{says.replace('(', '.').replace(')', '.')}"):
            read(path)
