"""optimize/placement.py: precision placement (fp16 / bf16 with norms, softmax, sinusoids and outputs kept fp32)."""

import onnx
import torch


def test_precision_placement_keeps_every_output_of_a_multi_output_node():
    """An fp32 island with several outputs (LayerNormalization's Y, Mean, InvStdDev) gets one Cast back per output,
    each to the graph's precision, and the placed graph checks with strict shape inference (before the fix the
    second output raised IndexError). In fp32 the graph runs in ONNX Runtime and reads every output."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from fluxtrt.optimize.placement import place_precision

    rng = np.random.default_rng()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("y", [2, 8]), ("m", [2, 1]))]
    scale = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "scale")
    ln = helper.make_node("LayerNormalization", ["x", "scale"], ["ln_y", "ln_mean", "ln_inv"], name="ln", axis=-1)
    nodes = [ln, helper.make_node("Mul", ["ln_y", "ln_inv"], ["y"], name="mul"),
             helper.make_node("Identity", ["ln_mean"], ["m"], name="id")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outs, [scale]),
                              opset_imports=[helper.make_opsetid("", 18)])
    y, m = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": rng.standard_normal((2, 8)).astype(np.float32)})
    assert y.shape == (2, 8) and m.shape == (2, 1)
    placed = place_precision(onnx.load_from_string(model.SerializeToString()), "bf16")
    onnx.checker.check_model(placed)
    onnx.shape_inference.infer_shapes(placed, strict_mode=True)
    backs = {n.output[0]: n for n in placed.graph.node if n.op_type == "Cast" and n.input[0].startswith("ln_")}
    assert sorted(backs) == ["ln_inv", "ln_mean", "ln_y"]
    assert all(helper.get_attribute_value(n.attribute[0]) == TensorProto.BFLOAT16 for n in backs.values())
    ln_placed = next(n for n in placed.graph.node if n.op_type == "LayerNormalization")
    assert list(ln_placed.output) == ["ln_y__fp32", "ln_mean__fp32", "ln_inv__fp32"]


def test_bf16_placement_keeps_the_sinusoids_fp32(exported):
    """The copying path's bf16 placement computes the timestep / guidance embeddings' and the rotary embedding's
    sinusoids, and the frequency tables feeding them, in fp32 as diffusers does (a bf16 frequency table times
    t * 1000 is off by radians: before, the tiny transformer's output was 7.5e-2 off fp32 PyTorch and the
    head's temb 0.52); the timestep's `* 1000` stays bf16, as diffusers computes it. Checked on the exported
    fp32 tiny transformer placed at bf16, in ONNX Runtime (weights bf16-rounded, arithmetic widened)."""
    import copy
    import tempfile
    from pathlib import Path

    import numpy as np

    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.core.sessions import runnable_session
    from fluxtrt.optimize.placement import place_precision

    src, folder, _ = exported("tiny")
    fp32 = onnx.load(str(folder / "transformer.onnx"))
    placed = place_precision(copy.deepcopy(fp32), "bf16", "transformer")
    g = placed.graph
    producers = {o: n for n in g.node for o in n.output}
    sinusoids = [n for n in g.node if n.op_type in ("Sin", "Cos")]
    assert len(sinusoids) >= 4  # timestep, guidance, rotary
    for n in sinusoids:  # fed by fp32 nodes of the island, never by a cast from bf16
        src_node = producers[n.input[0]]
        assert src_node.op_type != "Cast" or src_node.attribute[0].i == onnx.TensorProto.FLOAT
        assert n.input[0].endswith("__fp32")
    scaled = [n for n in g.node if n.op_type == "Mul" and "timestep" in n.input]  # the timestep's * 1000
    assert scaled and not any(o.endswith("__fp32") for n in scaled for o in n.output)
    path = Path(tempfile.mkdtemp()) / "transformer_bf16.onnx"
    onnx.save(placed, str(path))
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    feeds = spec.sample_inputs(ShapePoint(1, 256, 256), src.geometry, int(np.random.default_rng().integers(1 << 30)))
    session = runnable_session(path)
    names = {i.name for i in session.get_inputs()}
    got = session.run(None, {k: v.float().numpy() if v.is_floating_point() else v.numpy()
                             for k, v in feeds.items() if k in names})[0]
    module = spec.wrap(src.load_component(spec.subfolder)).eval()
    with torch.no_grad():
        want = module(*[feeds[t.name] for t in spec.inputs if t.name in feeds]).float().numpy()
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err < 1e-2, err


def test_precision_placement_of_an_output_the_graph_reads_on():
    """A graph output that later nodes also read (a First-Block Cache head's temb) is cast to fp32 for the output
    only: the nodes reading it get the low-precision value, so a Gemm sees one dtype (TensorRT's strongly typed
    parser refused the head of the copying path before: `A` Float, `B` BFloat16)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from fluxtrt.optimize.placement import place_precision

    rng = np.random.default_rng()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8]) for n in ("t", "z")]
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    nodes = [helper.make_node("Relu", ["x"], ["t"], name="relu"), helper.make_node("Gemm", ["t", "w"], ["z"], name="gemm")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outs, [w]), opset_imports=[helper.make_opsetid("", 18)])
    placed = place_precision(model, "bf16")
    onnx.checker.check_model(placed)
    onnx.shape_inference.infer_shapes(placed, strict_mode=True)  # a Gemm of fp32 x bf16 fails here
    gemm = next(n for n in placed.graph.node if n.op_type == "Gemm")
    assert gemm.input[0] == "t__low"
    assert {o.name for o in placed.graph.output} == {"t", "z"}
