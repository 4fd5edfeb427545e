"""Probe for issue 21: does TensorRT-RTX build an NVFP4 one-matmul graph on a CPU? The graph is ModelOpt's
form: weights FP4 E2M1 with E4M3 scales per block of 16 along the input dimension and an fp32 global scale
(two DequantizeLinear), activations quantized dynamically (TRT_FP4DynamicQuantize, then two DequantizeLinear).

  python scripts/probe_nvfp4.py [SM120 SM89 ...]     (writes /tmp/probe/nvfp4.onnx)

Seen 2026-11-30 with tensorrt-rtx 1.7.1.116 on a 2-core CPU machine: parsed into DEQUANTIZE / DYNAMIC_QUANTIZE /
MATRIX_MULTIPLY layers; SM120 builds (290,180-byte engine); SM89 refuses: "Cannot compile for target(s) sm89,
because the model contains HW-specific datatypes: fp4_e2m1"."""
import os
import sys

import ml_dtypes
import numpy as np
import onnx
import tensorrt_rtx as trt
from onnx import TensorProto as T
from onnx import helper as h

M, K, N, B = 64, 128, 256, 16
rng = np.random.default_rng(0)
w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)

def to_e2m1_codes(x):
    mag = np.abs(x)
    idx = np.abs(mag[..., None] - E2M1).argmin(-1).astype(np.uint8)
    return idx | ((x < 0).astype(np.uint8) << 3)

gscale = np.float32(np.abs(w).max() / (6 * 448))
blocks = w.reshape(N, K // B, B)
bscale = np.abs(blocks).max(-1) / 6 / gscale  # e4m3 block scales (as fp32 before the cast)
bscale_f8 = bscale.astype(ml_dtypes.float8_e4m3fn)
q = blocks / (bscale_f8.astype(np.float32)[..., None] * gscale)
codes = to_e2m1_codes(q.reshape(N, K))
packed = (codes.reshape(-1)[0::2] | (codes.reshape(-1)[1::2] << 4)).astype(np.uint8)
w_f4 = h.make_tensor("w_f4", T.FLOAT4E2M1, [N, K], packed.tobytes(), raw=True)
s_f8 = h.make_tensor("w_s_f8", T.FLOAT8E4M3FN, [N, K // B], bscale_f8.view(np.uint8).tobytes(), raw=True)
g = h.make_tensor("w_g", T.FLOAT, [], [float(gscale)])
xg = h.make_tensor("x_g", T.FLOAT, [], [float(4.0 / (6 * 448))])
nodes = [
    h.make_node("DequantizeLinear", ["w_s_f8", "w_g"], ["w_s"]),
    h.make_node("DequantizeLinear", ["w_f4", "w_s"], ["w_dq"], axis=-1, block_size=B),
    h.make_node("Transpose", ["w_dq"], ["w_t"], perm=[1, 0]),
    h.make_node("TRT_FP4DynamicQuantize", ["x", "x_g"], ["x_f4", "x_s_f8"], domain="trt", axis=-1, block_size=B,
                scale_type=T.FLOAT8E4M3FN),
    h.make_node("DequantizeLinear", ["x_s_f8", "x_g"], ["x_s"]),
    h.make_node("DequantizeLinear", ["x_f4", "x_s"], ["x_dq"], axis=-1, block_size=B),
    h.make_node("MatMul", ["x_dq", "w_t"], ["y"]),
]
graph = h.make_graph(nodes, "nvfp4", [h.make_tensor_value_info("x", T.FLOAT, [M, K])],
                     [h.make_tensor_value_info("y", T.FLOAT, [M, N])], [w_f4, s_f8, g, xg])
model = h.make_model(graph, opset_imports=[h.make_opsetid("", 23), h.make_opsetid("trt", 1)])
os.makedirs("/tmp/probe", exist_ok=True)
onnx.save(model, "/tmp/probe/nvfp4.onnx")

logger = trt.Logger(trt.Logger.WARNING)
builder = trt.Builder(logger)
net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
parser = trt.OnnxParser(net, logger)
ok = parser.parse_from_file("/tmp/probe/nvfp4.onnx")
print("parsed:", ok, [str(parser.get_error(i)) for i in range(parser.num_errors)])
if not ok:
    sys.exit(1)
print("layers:", [(net.get_layer(i).type, net.get_layer(i).name) for i in range(net.num_layers)])
for cc in sys.argv[1:] or ["SM120"]:
    config = builder.create_builder_config()
    config.num_compute_capabilities = 1
    config.set_compute_capability(getattr(trt.ComputeCapability, cc), 0)
    plan = builder.build_serialized_network(net, config)
    print(cc, "engine bytes:", None if plan is None else plan.nbytes)
