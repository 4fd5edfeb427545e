"""Explicit quantization of the transformer as Q/DQ nodes in the ONNX handed to TensorRT.

Recipes:
  fp8       E4M3 weights (per-tensor scale) and activations (per-tensor scale from calibration), sm89+
  fp8-attn  fp8, plus E4M3 Q/DQ on both inputs of attention's two MatMuls (q.k^T and p.v)
  int8      W8A8 with SmoothQuant (alpha): activations divided per channel by s = amax_x^a / amax_w^(1-a),
            weights multiplied by s; INT8 per-tensor activations, per-channel weights. Full TensorRT only:
            TensorRT-RTX runs INT8 only as weight-only GEMMs
  int8-wo   INT8 weights, per-output-channel scales; activations stay in the graph's precision
  int4-wo   INT4 weights in blocks of 128 along K; activations stay in the graph's precision
  fp4       NVFP4 weights and activations (E2M1, blocks of 16 along K, E4M3 block scales; nvfp4.py), sm120
Which MatMuls: those with a constant 2-D weight whose activation is 3-D (the per-token linear layers of the
blocks). Kept in high precision (the sensitive set): the 2-D Gemms of the time/guidance/text embedders, of
`norm_out` and of the AdaLN modulation (they act once per sample), `x_embedder` (reads the latents input),
`context_embedder` (reads the T5 input) and `proj_out` (writes the output)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core import weightmap
from ..errors import FluxtrtError
from ..fp8 import QDQ_KEY, activation_scale, quantize_weight
from ..precisions import RECIPES

INT4_BLOCK = 128


@dataclass
class QuantPlan:
    recipe: str
    quantized: list = field(default_factory=list)  # linear MatMul node names
    attention: list = field(default_factory=list)  # attention MatMul node names (fp8-attn)
    kept: dict = field(default_factory=dict)  # MatMul node name -> why it stays in high precision

    def calibration_inputs(self, model) -> list[str]:
        """The activation tensors whose ranges calibration must measure."""
        nodes = {n.name: n for n in model.graph.node}
        names = {nodes[q].input[0] for q in self.quantized}
        for a in self.attention:
            names.update(nodes[a].input[:2])
        return sorted(names)


def _consumers(g):
    out = {}
    for n in g.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def linear_weight(node, inits: dict, producers: dict) -> tuple[list[str], bool] | None:
    """The constant weight a MatMul multiplies by: ([initializer names], transposed). An exported graph keeps a
    linear layer's checkpoint layout [out, in] behind a Transpose (zero-copy graphs), and the zero-copy graph's
    fused q/k/v(/mlp) projection is Transpose(Concat(W_q, W_k, W_v)) of its linked parts; the fp32 path's
    passes fold both away, leaving one initializer."""
    w = node.input[1]
    if w in inits:
        return [w], False
    t = producers.get(w)
    if t is None or t.op_type != "Transpose" or [list(a.ints) for a in t.attribute if a.name == "perm"] not in ([], [[1, 0]]):
        return None
    if t.input[0] in inits and len(inits[t.input[0]].dims) == 2:
        return [t.input[0]], True
    cat = producers.get(t.input[0])
    if cat is not None and cat.op_type == "Concat" and [a.i for a in cat.attribute if a.name == "axis"] == [0] \
            and all(i in inits and len(inits[i].dims) == 2 for i in cat.input):
        return list(cat.input), True
    return None


def plan(model: onnx.ModelProto, recipe: str) -> QuantPlan:
    """Choose the MatMuls to quantize; say why every other weight MatMul stays."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    graph_inputs = {i.name for i in g.input}
    from ..components import PART_BOUNDARY

    graph_outputs = {o.name for o in g.output if o.name not in PART_BOUNDARY}  # a part's boundary is not an output
    cons = _consumers(g)
    producers = {o: n for n in g.node for o in n.output}
    p = QuantPlan(recipe)
    for n in g.node:
        if n.op_type != "MatMul":
            continue
        weight = linear_weight(n, inits, producers)
        if weight is not None and any(len(inits[w].dims) != 2 for w in weight[0]):
            continue
        if weight is None:
            a, b = producers.get(n.input[0]), cons.get(n.output[0], [])
            is_attention = (a is not None and a.op_type == "Softmax") or any(c.op_type == "Softmax" for c in b)
            if recipe == "fp8-attn" and is_attention:
                p.attention.append(n.name)
            continue
        if n.input[0] in graph_inputs:
            p.kept[n.name] = "reads a model input (x_embedder / context_embedder)"
            continue
        frontier, seen = [n.output[0]], set()
        reaches_out = False
        while frontier:  # proj_out: its result reaches a graph output through elementwise/shape ops only
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
    if recipe == "fp4":
        p.quantized += adaln_gemms(model, inits, graph_inputs)
    return p


# fp4 also quantizes the AdaLN modulation (double blocks' norm1 / norm1_context, single blocks' norm): 2-D
# Gemms acting once per sample, 3.2 B of FLUX.1-dev's 11.9 B parameters, which at bf16 would leave the NVFP4
# engine above 11 GB. The embedders and norm_out (small) stay bf16.
ADALN = re.compile(r"(^|\.)norm1(_context)?\.linear\.weight$|^single_transformer_blocks\.\d+\.norm\.linear\.weight$")


def adaln_gemms(model, inits: dict, graph_inputs: set) -> list[str]:
    """The AdaLN modulation Gemms (transB=1, weight [out, in] from the checkpoint), found by their weights'
    checkpoint keys in the weight map."""
    prov = weightmap.read(model)
    out = []
    for n in model.graph.node:
        if n.op_type != "Gemm" or n.input[0] in graph_inputs or n.input[1] not in inits or n.input[1] not in prov:
            continue
        trans_b = [a.i for a in n.attribute if a.name == "transB"]
        keys = weightmap.source_keys(prov[n.input[1]])
        if trans_b == [1] and len(inits[n.input[1]].dims) == 2 and keys and all(ADALN.search(k) for k in keys):
            out.append(n.name)
    return out


class _Writer:
    """Collects the nodes and initializers one quantization adds."""

    def __init__(self):
        self.nodes, self.inits = [], []

    def const(self, name, arr):
        self.inits.append(arr if isinstance(arr, TensorProto) else numpy_helper.from_array(arr, name))
        return name

    def qdq(self, x: str, tag: str, scale: float, kind: str, scale_dtype=np.float32) -> str:
        """x -> QuantizeLinear -> DequantizeLinear with a per-tensor scale; returns the DQ output name. The
        scale's dtype is x's (opset 19); bf16 graphs pass ml_dtypes.bfloat16."""
        import ml_dtypes

        zp_dtype = ml_dtypes.float8_e4m3fn if kind == "fp8" else np.int8
        s = self.const(f"{tag}__scale", np.array(scale, dtype=scale_dtype))
        zp = self.const(f"{tag}__zp", np.zeros((), zp_dtype))
        self.nodes.append(helper.make_node("QuantizeLinear", [x, s, zp], [f"{tag}__q"], name=f"{tag}__q"))
        self.nodes.append(helper.make_node("DequantizeLinear", [f"{tag}__q", s, zp], [f"{tag}__dq"], name=f"{tag}__dq"))
        return f"{tag}__dq"

    def weight(self, w: np.ndarray, wname: str, node: str, kind: str) -> str:
        """A quantized constant weight [K, N] and its DequantizeLinear; returns the DQ output name."""

        if kind == "fp8":  # the recipe's one arithmetic (fp8.py), as the zero-copy path's
            q, sw = quantize_weight(w)
            sw = np.float32(sw)
            attrs = {}
        elif kind == "int8":  # per output channel
            sw = (np.abs(w).max(axis=0) / 127.0).astype(np.float32)
            sw[sw == 0] = 1.0
            q = np.clip(np.round(w / sw), -127, 127).astype(np.int8)
            attrs = {"axis": 1}
        else:  # int4, blocks along K
            k, n = w.shape
            block = INT4_BLOCK if k % INT4_BLOCK == 0 else k
            blocks = w.reshape(k // block, block, n)
            sw = (np.abs(blocks).max(axis=1) / 7.0).astype(np.float32)
            sw[sw == 0] = 1.0
            q = np.clip(np.round(blocks / sw[:, None, :]), -8, 7).astype(np.int8).reshape(k, n)
            q = helper.make_tensor(f"{wname}__{kind}", TensorProto.INT4, q.shape, q.flatten().tolist())
            attrs = {"axis": 0, "block_size": block}
        tensor = q if isinstance(q, TensorProto) else numpy_helper.from_array(q, f"{wname}__{kind}")
        qname = self.const(f"{wname}__{kind}", tensor)
        sname = self.const(f"{wname}__wscale", np.asarray(sw, np.float32))
        self.nodes.append(helper.make_node("DequantizeLinear", [qname, sname], [f"{wname}__dq"], name=f"{node}__w_dq",
                                           **attrs))
        return f"{wname}__dq"


def quantize_model(model: onnx.ModelProto, recipe: str, act_amax: dict | None = None, only=None,
                   alpha: float = 0.5, *, channel_amax: dict | None = None) -> tuple[onnx.ModelProto, QuantPlan]:
    """Insert Q/DQ per the recipe. `act_amax`: activation name -> calibrated max |x|; `channel_amax`:
    activation name -> per-channel max |x| (int8 SmoothQuant). `only`: quantize just these MatMuls
    (sensitivity analysis; kept layers included)."""
    if recipe not in RECIPES:
        raise FluxtrtError(f"unknown quantization recipe '{recipe}'; choose {', '.join(RECIPES)}")
    g = model.graph
    p = plan(model, recipe)
    linear = set(only) if only is not None else set(p.quantized)
    attention = set(p.attention) if only is None else set(only) & set(p.attention)
    inits = {t.name: t for t in g.initializer}
    act_amax, channel_amax = act_amax or {}, channel_amax or {}

    def amax_of(name, node):
        if name not in act_amax:
            raise FluxtrtError(f"no calibrated range for {name} (input of {node}); run `fluxtrt calibrate`")
        return max(float(act_amax[name]), 1e-8)

    out = _Writer()
    new_nodes = []
    prov, record = weightmap.read(model), {}
    softmax_in = {n.input[0] for n in g.node if n.op_type == "Softmax"}
    attention_index = -1  # which attention (forward order: each block's follows the one before it)
    for n in g.node:
        if n.name in attention:
            first = n.output[0] in softmax_in  # q.k^T (its output goes to the Softmax), else p.v
            attention_index += first
            for k in (0, 1):
                out.nodes = []
                n.input[k] = out.qdq(n.input[k], f"{n.name}__in{k}", activation_scale(amax_of(n.input[k], n.name)), "fp8")
                new_nodes += out.nodes
            # for the torch executor (fp8.attention_scales_from_graph): which attention, which MatMul, its scales
            record[n.name] = {"attention": attention_index, "matmul": 0 if first else 1,
                              "input_scales": [f"{n.name}__in0__scale", f"{n.name}__in1__scale"]}
        elif n.name in linear and n.input[1] in inits:
            out.nodes = []
            w = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)
            x = n.input[0]
            if recipe == "fp4":  # global scales bf16-exact: precision placement stores them in bf16 unchanged
                import ml_dtypes

                from .. import nvfp4

                gemm = n.op_type == "Gemm"  # transB=1: its weight is already [out, in]
                _, tensors, nodes, n.input[0], n.input[1] = nvfp4.linear(
                    np.ascontiguousarray(w if gemm else w.T), f"{n.input[1]}__fp4", x, amax_of(x, n.name),
                    ml_dtypes.bfloat16, transpose=not gemm)
                for t in tensors[:-2]:
                    out.const(t.name, t)
                for t in tensors[-2:]:  # the two global scales, stored fp32 until placement
                    out.const(t.name, numpy_helper.to_array(t).astype(np.float32))
                out.nodes += nodes
            elif recipe in ("fp8", "fp8-attn"):
                wname = n.input[1]
                n.input[0] = out.qdq(x, f"{n.name}__act", activation_scale(amax_of(x, n.name)), "fp8")
                n.input[1] = out.weight(w, wname, n.name, "fp8")
                if wname in prov:  # which PyTorch modules it computes, for the torch executor (fp8.py)
                    record[n.name] = {"modules": [k.rsplit(".", 1)[0] for k in weightmap.source_keys(prov[wname])],
                                      "act_scale": f"{n.name}__act__scale", "weight_scale": f"{wname}__wscale"}
            elif recipe == "int8":
                if x not in channel_amax:
                    raise FluxtrtError(f"no per-channel range for {x} (input of {n.name}); recalibrate for int8")
                ax = np.maximum(np.asarray(channel_amax[x], np.float32), 1e-5)
                aw = np.maximum(np.abs(w).max(axis=1), 1e-5)
                s = (ax ** alpha / aw ** (1 - alpha)).astype(np.float32)  # SmoothQuant per input channel
                inv = out.const(f"{n.name}__smooth", (1.0 / s).astype(np.float32))
                out.nodes.append(helper.make_node("Mul", [x, inv], [f"{n.name}__smoothed"], name=f"{n.name}__smooth"))
                n.input[0] = out.qdq(f"{n.name}__smoothed", f"{n.name}__act", float((ax / s).max()) / 127.0, "int8")
                n.input[1] = out.weight(w * s[:, None], n.input[1], n.name, "int8")
            else:
                n.input[1] = out.weight(w, n.input[1], n.name, "int8" if recipe == "int8-wo" else "int4")
            new_nodes += out.nodes
        new_nodes.append(n)
    del g.node[:]
    g.node.extend(new_nodes)
    used = {i for n in g.node for i in n.input}
    kept_inits = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(kept_inits + out.inits)
    if recipe == "fp4":
        from ..nvfp4 import ensure_opsets

        ensure_opsets(model)
    if record:
        import json

        entry = model.metadata_props.add()
        entry.key, entry.value = QDQ_KEY, json.dumps(record, sort_keys=True, separators=(",", ":"))
    return model, p


def sensitivity(model: onnx.ModelProto, act_amax: dict, feeds_list: list[dict], top: int = 8,
                recipe: str = "fp8") -> list[tuple]:
    """Quantize one weight MatMul at a time (`recipe`, the kept ones included) and measure the output error
    against the unquantized graph: [(relative error, MatMul, kept reason or ''), ...], worst first."""
    import copy

    from ..nvfp4 import emulate
    from ..onnxio import onnxruntime

    ort = onnxruntime()

    p = plan(model, recipe)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    refs = [ref.run(names, f)[0] for f in feeds_list]
    rows = []
    for node in p.quantized + list(p.kept):
        q, _ = quantize_model(copy.deepcopy(model), recipe, act_amax, only=[node])
        q = emulate(q) if recipe == "fp4" else q
        s = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"])
        err = max(float(np.abs(s.run(names, f)[0] - r).max() / np.abs(r).max()) for f, r in zip(feeds_list, refs))
        rows.append((err, node, p.kept.get(node, "")))
    return sorted(rows, reverse=True)[:top]
