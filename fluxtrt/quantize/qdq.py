"""Explicit quantization of the transformer's linear layers as Q/DQ nodes in the ONNX handed to TensorRT.

Recipes:
  fp8      E4M3 weights (per-tensor scale) and activations (per-tensor scale from calibration), sm89+
  int8-wo  INT8 weights, per-output-channel scales; activations stay in the graph's precision
  int4-wo  INT4 weights in blocks of 128 along K; activations stay in the graph's precision
Which MatMuls: those with a constant 2-D weight whose activation is 3-D (the per-token linear layers of the
blocks). Kept in high precision (the sensitive set): the 2-D Gemms of the time/guidance/text embedders and
the AdaLN modulation (they act once per sample), `x_embedder` (reads the latents input), `context_embedder`
(reads the T5 input) and `proj_out` (writes the output), and attention's activation x activation MatMuls."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FP8_MAX = 448.0
RECIPES = ("fp8", "int8-wo", "int4-wo")
INT4_BLOCK = 128


@dataclass
class QuantPlan:
    recipe: str
    quantized: list = field(default_factory=list)  # MatMul node names
    kept: dict = field(default_factory=dict)  # MatMul node name -> why it stays in high precision


def _producers(g):
    return {o: n for n in g.node for o in n.output}


def _consumers(g):
    out = {}
    for n in g.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def plan(model: onnx.ModelProto, recipe: str) -> QuantPlan:
    """Choose the linear MatMuls to quantize; say why every other weight MatMul stays."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    graph_inputs = {i.name for i in g.input}
    graph_outputs = {o.name for o in g.output}
    cons = _consumers(g)
    p = QuantPlan(recipe)
    for n in g.node:
        if n.op_type != "MatMul" or n.input[1] not in inits or len(inits[n.input[1]].dims) != 2:
            continue
        if n.input[0] in graph_inputs:
            p.kept[n.name] = "reads a model input (x_embedder / context_embedder)"
            continue
        # proj_out: the MatMul whose result reaches a graph output through elementwise/shape ops only
        frontier, reaches_out, seen = [n.output[0]], False, set()
        while frontier and not reaches_out:
            t = frontier.pop()
            if t in graph_outputs:
                reaches_out = True
                break
            for c in cons.get(t, []):
                if c.op_type in ("Add", "Cast", "Reshape", "Mul", "Identity") and c.name not in seen:
                    seen.add(c.name)
                    frontier.extend(c.output)
        if reaches_out:
            p.kept[n.name] = "writes the model output (proj_out)"
            continue
        p.quantized.append(n.name)
    return p


def _q_fp8(x: np.ndarray, scale: float) -> TensorProto:
    import ml_dtypes

    q = np.clip(x / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q


def quantize_model(model: onnx.ModelProto, recipe: str, act_amax: dict | None = None) -> tuple[onnx.ModelProto, QuantPlan]:
    """Insert Q/DQ per the recipe. `act_amax`: MatMul activation input name -> calibrated max |x| (fp8)."""
    if recipe not in RECIPES:
        from ..errors import FluxtrtError

        raise FluxtrtError(f"unknown quantization recipe '{recipe}'; choose {', '.join(RECIPES)}")
    g = model.graph
    p = plan(model, recipe)
    inits = {t.name: t for t in g.initializer}
    todo = set(p.quantized)
    new_nodes, new_inits = [], []
    for n in g.node:
        if n.name in todo:
            w = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)
            wname = n.input[1]
            if recipe == "fp8":
                amax_w = float(np.abs(w).max()) or 1.0
                sw = np.float32(amax_w / FP8_MAX)
                import ml_dtypes

                wq = np.clip(w / sw, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
                new_inits += [numpy_helper.from_array(wq, f"{wname}__fp8"),
                              numpy_helper.from_array(np.array(sw, np.float32), f"{wname}__wscale")]
                new_nodes.append(helper.make_node("DequantizeLinear", [f"{wname}__fp8", f"{wname}__wscale"],
                                                  [f"{wname}__dq"], name=f"{n.name}__w_dq"))
                a = n.input[0]
                amax_a = (act_amax or {}).get(a)
                if amax_a is None:
                    from ..errors import FluxtrtError

                    raise FluxtrtError(f"no calibrated range for {a} (input of {n.name}); run `fluxtrt calibrate`")
                sa = np.float32(max(amax_a, 1e-8) / FP8_MAX)
                zp = numpy_helper.from_array(np.zeros((), ml_dtypes.float8_e4m3fn), f"{n.name}__azp")
                new_inits += [numpy_helper.from_array(np.array(sa, np.float32), f"{n.name}__ascale"), zp]
                new_nodes += [
                    helper.make_node("QuantizeLinear", [a, f"{n.name}__ascale", f"{n.name}__azp"], [f"{n.name}__aq"],
                                     name=f"{n.name}__a_q"),
                    helper.make_node("DequantizeLinear", [f"{n.name}__aq", f"{n.name}__ascale"], [f"{n.name}__adq"],
                                     name=f"{n.name}__a_dq"),
                ]
                n.input[0] = f"{n.name}__adq"
            elif recipe == "int8-wo":
                sw = (np.abs(w).max(axis=0) / 127.0).astype(np.float32)  # per output channel (N)
                sw[sw == 0] = 1.0
                wq = np.clip(np.round(w / sw), -127, 127).astype(np.int8)
                new_inits += [numpy_helper.from_array(wq, f"{wname}__int8"),
                              numpy_helper.from_array(sw, f"{wname}__wscale")]
                new_nodes.append(helper.make_node("DequantizeLinear", [f"{wname}__int8", f"{wname}__wscale"],
                                                  [f"{wname}__dq"], axis=1, name=f"{n.name}__w_dq"))
            else:  # int4-wo: blocks of INT4_BLOCK along K (axis 0)
                k, nn = w.shape
                block = INT4_BLOCK if k % INT4_BLOCK == 0 else k
                blocks = w.reshape(k // block, block, nn)
                sw = (np.abs(blocks).max(axis=1) / 7.0).astype(np.float32)  # [K/block, N]
                sw[sw == 0] = 1.0
                wq = np.clip(np.round(blocks / sw[:, None, :]), -8, 7).astype(np.int8).reshape(k, nn)
                t = helper.make_tensor(f"{wname}__int4", TensorProto.INT4, wq.shape, wq.flatten().tolist())
                new_inits += [t, numpy_helper.from_array(sw, f"{wname}__wscale")]
                new_nodes.append(helper.make_node("DequantizeLinear", [f"{wname}__int4", f"{wname}__wscale"],
                                                  [f"{wname}__dq"], axis=0, block_size=block, name=f"{n.name}__w_dq"))
            n.input[1] = f"{wname}__dq"
        new_nodes.append(n)
    del g.node[:]
    g.node.extend(new_nodes)
    used = {i for n in g.node for i in n.input}
    kept_inits = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(kept_inits + new_inits)
    return model, p
