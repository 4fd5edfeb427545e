"""fp8 (and fp4 the same way, nvfp4.py) straight from a bf16 checkpoint: Q/DQ inserted into the zero-copy bf16
graph, one weight at a time.

The fp32 path (qdq.quantize_model) holds the whole fp32 graph in memory; at FLUX.1-dev size that is 47.6 GB.
Here the input is the zero-copy export (its weights are links into the checkpoint's safetensors): each linear
weight the plan quantizes is read from its shard (memory-mapped), scaled by its max |w| and written as E4M3 to
`<name>.onnx.data`, transposed to [in, out]; every other weight stays a link into the checkpoint. Peak memory is
one weight in fp32 (a few hundred MB at full size), whatever the model's size.

Activation scales come from calibration by module (calibration.calibrate_modules: the max |input| of every
nn.Linear, measured in PyTorch). A quantized MatMul's weight names its module through the weight map's
provenance (`transformer_blocks.3.attn.to_q.weight` -> `transformer_blocks.3.attn.to_q`).

Scales and Q/DQ run in the graph's dtype (bf16; opset 19 ties QuantizeLinear's scale type to its input), and
the weights are quantized with the bf16-rounded scale, so dequantization reproduces them exactly as scaled."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import FluxtrtError
from ..fp8 import QDQ_KEY, activation_scale, to_e4m3, weight_scale
from ..onnxio import load_header
from .qdq import _Writer, linear_weight, plan

ZERO_COPY_RECIPES = ("fp8", "fp4")
ALIGN = 64
@dataclass
class NativeQuantResult:
    path: Path
    quantized: int
    kept: dict
    weight_bytes: int  # quantized weights written (E4M3; NVFP4 codes and block scales)
    linked_bytes: int  # weights left in the checkpoint


def module_of(weight_key: str) -> str:
    return weight_key.rsplit(".", 1)[0]


def activation_amax(weights: list[str], prov: dict, module_amax: dict) -> float:
    """The calibrated max |input| of the linear layer(s) whose weights are the graph initializers `weights`
    (a fused projection's parts read one tensor: their ranges are that tensor's)."""
    from ..core import weightmap

    modules = []
    for weight in weights:
        if weight not in prov:
            raise FluxtrtError(f"{weight}: the graph records no checkpoint source for it; export again")
        modules += [module_of(k) for k in weightmap.source_keys(prov[weight])]
    missing = [m for m in modules if m not in module_amax]
    if missing:
        raise FluxtrtError(f"no calibrated range for {missing[0]}; the calibration cache is for another model "
                           "(run `fluxtrt calibrate` again)")
    return max(max(float(module_amax[m]) for m in modules), 1e-8)


def quantize_weight_fp8(parts, transposed: bool):
    """[(bf16 bytes, dims)] of a linear weight stored [out, in] (or [in, out]), several for a fused projection
    -> (E4M3 bytes as [in, sum of outs], bf16-exact scale). One scale per fused weight: the max |w| over its
    parts, as TensorRT's FP8 GEMM takes one weight scale (the cost against a scale per part is measured in
    tests/stages/test_zerocopy_plan.py)."""
    import torch

    ws = _bf16_tensors(parts)
    scale = weight_scale(ws)
    q = torch.cat([to_e4m3(w, scale) for w in ws], 0 if transposed else 1)
    if transposed:
        q = q.t()
    return q.contiguous().view(torch.uint8).numpy(), scale


def _external(data, data_name: str, tensor) -> int:
    """Move `tensor`'s bytes to the open data file (aligned) and point it there; returns the bytes written."""
    from ..onnxio import set_external

    raw = tensor.raw_data
    offset = data.tell()
    data.write(raw)
    data.write(b"\0" * (-data.tell() % ALIGN))
    set_external(tensor, data_name, offset, len(raw))
    return len(raw)


def _bf16_tensors(parts):
    """[(bf16 bytes, dims)] -> fp32 torch tensors (the bytes are read-only memory maps: only read here)."""
    import numpy as np
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [torch.from_numpy(np.frombuffer(raw, dtype=np.int16).reshape(dims)).view(torch.bfloat16).float()
                for raw, dims in parts]


def _joined(parts, transposed: bool):
    """bf16 bytes of a linear weight's parts -> the fp32 weight [out, in] (parts joined along out)."""
    import torch

    ws = _bf16_tensors(parts)
    w = torch.cat(ws, 0) if transposed else torch.cat(ws, 1).t()
    return w.contiguous().numpy()


def _fp8_layer(n, wname, parts, transposed, amax, *, data, data_name):
    """E4M3 weight (one scale) and activation Q/DQ for MatMul `n`: (nodes, initializers, bytes written)."""
    import ml_dtypes
    import numpy as np
    from onnx import TensorProto, helper

    q, scale = quantize_weight_fp8(parts, transposed)
    qt = TensorProto(name=f"{wname}__fp8", data_type=TensorProto.FLOAT8E4M3FN, dims=q.shape, raw_data=q.tobytes())
    written = _external(data, data_name, qt)
    out = _Writer()
    n.input[0] = out.qdq(n.input[0], f"{n.name}__act", activation_scale(amax), "fp8", ml_dtypes.bfloat16)
    sname = out.const(f"{wname}__wscale", np.array(scale, dtype=ml_dtypes.bfloat16))
    out.inits.append(qt)
    out.nodes.append(helper.make_node("DequantizeLinear", [qt.name, sname], [f"{wname}__dq"], name=f"{n.name}__w_dq"))
    n.input[1] = f"{wname}__dq"
    return out.nodes, out.inits, written


def _fp4_layer(n, wname, parts, transposed, amax, *, data, data_name):
    """NVFP4 weight (codes and block scales to the data file) and activation quantizer for MatMul `n`."""
    import ml_dtypes

    from .. import nvfp4

    gemm = n.op_type == "Gemm"  # transB=1 (the AdaLN modulation): the weight is [out, in] as stored
    _, tensors, nodes, n.input[0], n.input[1] = nvfp4.linear(_joined(parts, transposed or gemm), f"{wname}__fp4",
                                                              n.input[0], amax, ml_dtypes.bfloat16, transpose=not gemm)
    written = sum(_external(data, data_name, t) for t in tensors[:2])
    return nodes, tensors, written


def quantize_zero_copy(onnx_in: Path, dest_dir: Path, recipe: str, module_amax: dict,
                    progress: Callable[[int, int], None] = lambda done, total: None) -> NativeQuantResult:
    """Write `dest_dir/<name>.onnx` (+ `.onnx.data` with the E4M3 or NVFP4 weights, + links for the rest) from
    the zero-copy bf16 graph `onnx_in`. Atomic: nothing appears in dest_dir unless all of it is written."""
    import json

    import onnx
    from onnx import TensorProto

    from ..core import weightmap
    from ..fileio import publish, staging_dir
    from ..nvfp4 import ensure_opsets
    from ..onnxio import copy_links, external_info, read_external

    if recipe not in ZERO_COPY_RECIPES:
        raise FluxtrtError(f"recipe {recipe} cannot be built from the zero-copy graph; build it with --copy-weights")
    onnx_in = Path(onnx_in)
    model = load_header(onnx_in)
    g = model.graph
    prov = weightmap.read(model)
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    p = plan(model, recipe)
    nodes = {n.name: n for n in g.node}
    chosen = {q: linear_weight(nodes[q], inits, producers) for q in p.quantized}  # MatMul -> ([parts], transposed)
    bad = [w for ws, _ in chosen.values() for w in ws if inits[w].data_type != TensorProto.BFLOAT16]
    if bad:
        raise FluxtrtError(f"{onnx_in}: weight {bad[0]} is not bf16; the zero-copy fp8 path reads bf16 checkpoints")
    name = onnx_in.stem
    data_name = f"{name}.onnx.data"
    new_nodes, added_inits, done, weight_bytes, record = [], [], 0, 0, {}
    with staging_dir(Path(dest_dir), name) as tmp:
        with open(tmp / data_name, "wb") as data:
            for n in g.node:
                if n.name in chosen:
                    wnames, transposed = chosen[n.name]
                    parts = [(read_external(onnx_in, inits[w]), tuple(inits[w].dims)) for w in wnames]
                    amax = activation_amax(wnames, prov, module_amax)
                    record[n.name] = {"modules": [module_of(k) for w in wnames for k in weightmap.source_keys(prov[w])]}
                    if recipe == "fp8":
                        record[n.name].update(act_scale=f"{n.name}__act__scale", weight_scale=f"{wnames[0]}__wscale")
                    layer = _fp4_layer if recipe == "fp4" else _fp8_layer
                    nodes_, inits_, written = layer(n, wnames[0], parts, transposed, amax, data=data, data_name=data_name)
                    new_nodes += nodes_
                    added_inits += inits_
                    weight_bytes += written
                    done += 1
                    progress(done, len(chosen))
                new_nodes.append(n)
            data.flush()
            os.fsync(data.fileno())
        for _ in range(2):  # the weights' Transpose, then a fused weight's Concat, now read by nothing
            used = {i for n in new_nodes for i in n.input}
            new_nodes = [n for n in new_nodes if n.op_type not in ("Transpose", "Concat") or any(o in used for o in n.output)]
        used = {i for n in new_nodes for i in n.input}
        del g.node[:]
        g.node.extend(new_nodes)
        kept = [t for t in g.initializer if t.name in used]
        linked_bytes = sum(int(external_info(t).get("length", 0)) for t in kept if external_info(t) is not None)
        del g.initializer[:]
        g.initializer.extend(kept + added_inits)
        if recipe == "fp4":
            ensure_opsets(model)
        weightmap.write(model, prov)
        entry = model.metadata_props.add()
        entry.key, entry.value = QDQ_KEY, json.dumps(record, sort_keys=True, separators=(",", ":"))
        copy_links(onnx_in, tmp / f"{name}.onnx")
        onnx.save(model, str(tmp / f"{name}.onnx"))
        staged = sorted(tmp.iterdir(), key=lambda f: f.suffix == ".onnx")  # the .onnx last
        publish(staged, Path(dest_dir))
    return NativeQuantResult(Path(dest_dir) / f"{name}.onnx", len(chosen), p.kept, weight_bytes, linked_bytes)
