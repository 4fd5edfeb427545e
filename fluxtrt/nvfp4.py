"""NVFP4 (the `fp4` recipe, sm120): E2M1 values with one E4M3 scale per block of 16 along the input dimension
and one global scale per tensor, as NVIDIA's ModelOpt writes them and TensorRT reads them. Weights: two
DequantizeLinear (E4M3 scales x global -> block scales; E2M1 x block scales -> weight [out, in]), then a
Transpose to the MatMul's [in, out]. Activations: TensorRT's `trt::TRT_FP4DynamicQuantize` (block scales
computed at run time from a calibrated global scale = amax / (6 * 448)) and the same two DequantizeLinear.
The global scales are stored in the graph's dtype (bf16 graphs: bf16, and the weight's block scales are
computed from the rounded global, so the bytes dequantize exactly as written). TensorRT-RTX builds this form for
sm120 on a CPU and refuses sm89 (tests/test_nvfp4.py).

ONNX Runtime runs neither TRT_FP4DynamicQuantize nor a blocked FP4 DequantizeLinear (1.32, CPU), so the graph
is checked through `emulate`: the same graph with each weight replaced by its dequantized value (checked bit
for bit against the bytes written) and each activation quantizer by standard ops that compute the recipe
(E4M3 block scales by Cast, E2M1 rounding by Round on its three grids).

Recipe (ModelOpt's): global = amax|w| / (6 * 448); block scale = amax|block| / 6 / global, rounded to E4M3;
values = w / (block scale * global), clipped to +-6 and rounded to E2M1 (nearest, ties to even, as ONNX Cast).
`fake_quant` computes the dequantized weight with the very arithmetic of the two DequantizeLinear nodes (fp32),
so the bytes written can be checked bit for bit (`check_written`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FluxtrtError

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0


@dataclass
class NVFP4Weight:
    """One weight [out, in] in NVFP4: E2M1 codes packed two per byte (first element in the low nibble, as ONNX
    FLOAT4E2M1), E4M3 block scales [out, in / 16] (as uint8 bytes) and the fp32 global scale."""

    packed: np.ndarray  # uint8 [out * in / 2]
    scales: np.ndarray  # uint8 (E4M3 bits) [out, in / 16]
    global_scale: np.float32
    shape: tuple[int, int]


def _types():
    import ml_dtypes

    return ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn


def global_scale_of(amax: float, scale_dtype=np.float32) -> np.float32:
    """amax / (6 * 448), rounded to the dtype the graph stores it in (1 for an all-zero tensor)."""
    if not amax > 0:
        return np.float32(1.0)
    return np.float32(np.asarray(amax / (E2M1_MAX * E4M3_MAX), dtype=np.float32).astype(scale_dtype))


def quantize(w: np.ndarray, block: int = BLOCK, scale_dtype=np.float32) -> NVFP4Weight:
    """NVFP4 of a 2-D weight [out, in] whose `in` is a multiple of `block` (global scale in `scale_dtype`)."""
    f4, f8 = _types()
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % block:
        raise FluxtrtError(f"NVFP4 takes a [out, in] weight with in a multiple of {block}; got {list(w.shape)}")
    out, inp = w.shape
    global_scale = global_scale_of(float(np.abs(w).max()), scale_dtype)
    blocks = w.reshape(out, inp // block, block)
    scale = (np.abs(blocks).max(-1) / np.float32(E2M1_MAX) / global_scale).astype(np.float32)
    scale_f8 = np.clip(scale, 0, E4M3_MAX).astype(f8)
    step = scale_f8.astype(np.float32) * global_scale  # what the first DequantizeLinear computes
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, blocks / step[..., None], 0.0).astype(np.float32)
    codes = np.clip(q, -E2M1_MAX, E2M1_MAX).astype(f4).view(np.uint8).reshape(-1) & 0x0F
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    return NVFP4Weight(packed, scale_f8.view(np.uint8), global_scale, (out, inp))


def dequantize(q: NVFP4Weight, block: int = BLOCK) -> np.ndarray:
    """The weight the two DequantizeLinear nodes produce (fp32): E2M1 value x (E4M3 scale x global)."""
    f4, f8 = _types()
    out, inp = q.shape
    codes = np.empty(out * inp, dtype=np.uint8)
    codes[0::2], codes[1::2] = q.packed & 0x0F, q.packed >> 4
    values = codes.view(f4).astype(np.float32).reshape(out, inp // block, block)
    step = q.scales.view(f8).astype(np.float32) * q.global_scale
    return (values * step[..., None]).reshape(out, inp)


def fake_quant(w: np.ndarray, block: int = BLOCK, scale_dtype=np.float32) -> np.ndarray:
    """quantize then dequantize: the reference of the recipe (same scales, same rounding)."""
    return dequantize(quantize(w, block, scale_dtype), block)


def fake_quant_activation(x: np.ndarray, global_scale: float, block: int = BLOCK) -> np.ndarray:
    """What TRT_FP4DynamicQuantize + two DequantizeLinear compute on x (last axis in blocks): block scale =
    amax|block| / 6 / global rounded to E4M3, values rounded to E2M1 (nearest, ties to even)."""
    f4, f8 = _types()
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    g = np.float32(global_scale)
    step = (np.clip(np.abs(blocks).max(-1) / np.float32(E2M1_MAX) / g, 0, E4M3_MAX).astype(f8).astype(np.float32) * g)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, blocks / step[..., None], 0.0).astype(np.float32)
    values = np.clip(q, -E2M1_MAX, E2M1_MAX).astype(f4).astype(np.float32)
    return (values * step[..., None]).reshape(x.shape)


def check_written(q: NVFP4Weight, expected: np.ndarray, name: str = "weight") -> None:
    """The stored codes and scales dequantize to `expected` bit for bit (a corrupted block scale or value is
    one line naming the first block that differs)."""
    got = dequantize(q)
    if got.shape != expected.shape or not np.array_equal(got.view(np.uint32), expected.view(np.uint32)):
        bad = np.argwhere(got.view(np.uint32) != expected.view(np.uint32)) if got.shape == expected.shape else [[0, 0]]
        row, col = (int(v) for v in bad[0])
        raise FluxtrtError(f"{name}: NVFP4 bytes do not reproduce the recipe at [{row}, {col}] (block {col // BLOCK});"
                           " the file is corrupt: rebuild with `fluxtrt build --force`")


def onnx_tensors(q: NVFP4Weight, name: str, scale_dtype=np.float32):
    """The three initializers of the ModelOpt form: `<name>_f4` (FLOAT4E2M1 [out, in]), `<name>_f8_scale`
    (FLOAT8E4M3FN [out, in / 16]) and `<name>_f8_scale_f32_scale` (the global scale, a scalar of the graph's
    dtype)."""
    from onnx import TensorProto, helper, numpy_helper

    out, inp = q.shape
    return (helper.make_tensor(f"{name}_f4", TensorProto.FLOAT4E2M1, [out, inp], q.packed.tobytes(), raw=True),
            helper.make_tensor(f"{name}_f8_scale", TensorProto.FLOAT8E4M3FN, list(q.scales.shape),
                               q.scales.tobytes(), raw=True),
            numpy_helper.from_array(np.asarray(q.global_scale, dtype=np.float32).astype(scale_dtype),
                                    f"{name}_f8_scale_f32_scale"))


def dequantize_nodes(name: str, output: str, block: int = BLOCK):
    """The two DequantizeLinear nodes that turn `onnx_tensors(q, name)` into the weight `output`."""
    from onnx import helper

    return [helper.make_node("DequantizeLinear", [f"{name}_f8_scale", f"{name}_f8_scale_f32_scale"],
                             [f"{name}_scale"], name=f"{name}_DequantizeLinear"),
            helper.make_node("DequantizeLinear", [f"{name}_f4", f"{name}_scale"], [output], axis=-1,
                             block_size=block, name=f"{name}_DequantizeLinear_1")]


def activation_nodes(x: str, tag: str, global_scale: str, block: int = BLOCK):
    """TRT_FP4DynamicQuantize of activation `x` with the global scale initializer `global_scale`, and its two
    DequantizeLinear: returns (nodes, the dequantized activation's name)."""
    from onnx import TensorProto, helper

    return [helper.make_node("TRT_FP4DynamicQuantize", [x, global_scale], [f"{tag}_f4", f"{tag}_f8_scale"],
                             domain="trt", axis=-1, block_size=block, scale_type=TensorProto.FLOAT8E4M3FN,
                             name=f"{tag}_TRT_FP4DynamicQuantize"),
            helper.make_node("DequantizeLinear", [f"{tag}_f8_scale", global_scale], [f"{tag}_scale"],
                             name=f"{tag}_DequantizeLinear"),
            helper.make_node("DequantizeLinear", [f"{tag}_f4", f"{tag}_scale"], [f"{tag}_dq"], axis=-1,
                             block_size=block, name=f"{tag}_DequantizeLinear_1")], f"{tag}_dq"


def ensure_opsets(model) -> None:
    """Blocked FP4 DequantizeLinear needs opset 23; TRT_FP4DynamicQuantize lives in the `trt` domain."""
    from onnx import helper

    domains = {o.domain: o for o in model.opset_import}
    for domain, version in (("", 23), ("trt", 1)):
        if domain not in domains:
            model.opset_import.append(helper.make_opsetid(domain, version))
        elif domains[domain].version < version:
            domains[domain].version = version


def _e2m1_round(x: str, tag: str):
    """Standard ops rounding x (already clipped to +-6) to the E2M1 grid, nearest with ties to even: steps of
    0.5 below 2, 1 below 4, 2 up to 6 (Round is half-to-even, which is E2M1's even code on each grid)."""
    from onnx import helper

    n = []
    for k, (mul, div) in enumerate(((2.0, 0.5), (1.0, 1.0), (0.5, 2.0))):
        n += [helper.make_node("Mul", [x, f"{tag}_c{mul}"], [f"{tag}_m{k}"]),
              helper.make_node("Round", [f"{tag}_m{k}"], [f"{tag}_r{k}"]),
              helper.make_node("Mul", [f"{tag}_r{k}", f"{tag}_c{div}"], [f"{tag}_g{k}"])]
    n += [helper.make_node("Abs", [x], [f"{tag}_abs"]),
          helper.make_node("Less", [f"{tag}_abs", f"{tag}_c2.0"], [f"{tag}_lt2"]),
          helper.make_node("Less", [f"{tag}_abs", f"{tag}_c4.0"], [f"{tag}_lt4"]),
          helper.make_node("Where", [f"{tag}_lt4", f"{tag}_g1", f"{tag}_g2"], [f"{tag}_hi"]),
          helper.make_node("Where", [f"{tag}_lt2", f"{tag}_g0", f"{tag}_hi"], [f"{tag}_e2m1"])]
    return n, f"{tag}_e2m1", {f"{tag}_c{v}": v for v in (0.5, 1.0, 2.0, 4.0)}


def _activation_emulation(x: str, global_scale: str, output: str, tag: str):
    """Standard ops computing fake_quant_activation(x) into `output` (fp32): (nodes, initializers)."""
    from onnx import TensorProto, helper, numpy_helper

    e = f"{tag}_emu"
    c = {f"{e}_blk": np.array([-1, BLOCK], np.int64), f"{e}_axes": np.array([-1], np.int64),
         f"{e}_six": np.float32(E2M1_MAX), f"{e}_neg6": np.float32(-E2M1_MAX), f"{e}_zero": np.float32(0.0),
         f"{e}_one": np.float32(1.0)}
    mk = helper.make_node
    nodes = [mk("Cast", [global_scale], [f"{e}_g"], to=TensorProto.FLOAT),
             mk("Cast", [x], [f"{e}_x"], to=TensorProto.FLOAT),
             mk("Shape", [f"{e}_x"], [f"{e}_shape"]),
             mk("Reshape", [f"{e}_x", f"{e}_blk"], [f"{e}_blocks"]),  # blocks of 16 along the last axis
             mk("Abs", [f"{e}_blocks"], [f"{e}_absb"]),
             mk("ReduceMax", [f"{e}_absb", f"{e}_axes"], [f"{e}_amax"], keepdims=1),
             mk("Div", [f"{e}_amax", f"{e}_six"], [f"{e}_s0"]),
             mk("Div", [f"{e}_s0", f"{e}_g"], [f"{e}_s1"]),
             mk("Cast", [f"{e}_s1"], [f"{e}_s8"], to=TensorProto.FLOAT8E4M3FN, saturate=1),
             mk("Cast", [f"{e}_s8"], [f"{e}_s32"], to=TensorProto.FLOAT),
             mk("Mul", [f"{e}_s32", f"{e}_g"], [f"{e}_step"]),
             mk("Greater", [f"{e}_step", f"{e}_zero"], [f"{e}_nz"]),
             mk("Where", [f"{e}_nz", f"{e}_step", f"{e}_one"], [f"{e}_safe"]),
             mk("Div", [f"{e}_blocks", f"{e}_safe"], [f"{e}_q"]),
             mk("Clip", [f"{e}_q", f"{e}_neg6", f"{e}_six"], [f"{e}_qc"])]
    rnodes, rounded, consts = _e2m1_round(f"{e}_qc", e)
    nodes += rnodes + [mk("Mul", [rounded, f"{e}_step"], [f"{e}_deq"]),
                       mk("Reshape", [f"{e}_deq", f"{e}_shape"], [output])]
    c.update({k: np.float32(v) for k, v in consts.items()})
    return nodes, [numpy_helper.from_array(np.asarray(v), k) for k, v in c.items()]


def emulate(model):
    """A copy of an NVFP4 graph that ONNX Runtime runs (fp32: after validate.upcast_bf16): every weight's
    DequantizeLinear pair replaced by its dequantized value (from the bytes in the file, `dequantize`), every
    TRT_FP4DynamicQuantize and its two DequantizeLinear by standard ops computing fake_quant_activation."""
    import copy

    from onnx import TensorProto, numpy_helper

    m = copy.deepcopy(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    consumers = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    replace, new_inits = {}, []
    for n in g.node:
        if n.op_type == "DequantizeLinear" and n.input[0] in inits \
                and inits[n.input[0]].data_type == TensorProto.FLOAT4E2M1:
            first = producers[n.input[1]]  # DequantizeLinear(E4M3 block scales, global scale)
            t4, t8, tg = inits[n.input[0]], inits[first.input[0]], inits[first.input[1]]
            q = NVFP4Weight(np.frombuffer(t4.raw_data, np.uint8),
                            np.frombuffer(t8.raw_data, np.uint8).reshape(tuple(t8.dims)),
                            np.float32(numpy_helper.to_array(tg).astype(np.float32)), tuple(t4.dims))
            new_inits.append(numpy_helper.from_array(dequantize(q), n.output[0]))
            replace[n.name] = replace[first.name] = []
        elif n.op_type == "TRT_FP4DynamicQuantize":
            dq_scale = consumers[n.output[1]][0]
            dq_value = consumers[n.output[0]][0]
            nodes, consts = _activation_emulation(n.input[0], n.input[1], dq_value.output[0], n.name)
            replace[n.name], replace[dq_scale.name], replace[dq_value.name] = nodes, [], []
            new_inits += consts
    out = []
    for n in g.node:
        out.extend(replace.get(n.name, [n]))
    del g.node[:]
    g.node.extend(out)
    used = {i for n in g.node for i in n.input}
    kept = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(kept + [t for t in new_inits if t.name in used])
    return m


def linear(w: np.ndarray, name: str, x: str, act_amax: float, scale_dtype=np.float32, *, transpose: bool = True):
    """One linear layer in NVFP4: its weight [out, in] quantized, and the nodes that give the MatMul (or a
    Gemm with transB, `transpose=False`) its inputs. -> (NVFP4Weight, initializers [codes, block scales, weight
    global, activation global], nodes, the activation input, the weight input: [in, out], or [out, in])."""
    from onnx import helper, numpy_helper

    q = quantize(w, scale_dtype=scale_dtype)
    act_global = numpy_helper.from_array(np.asarray(global_scale_of(act_amax, scale_dtype)).astype(scale_dtype),
                                         f"{name}_act_global")
    act, x_dq = activation_nodes(x, f"{name}_act", act_global.name)
    nodes = dequantize_nodes(name, f"{name}_dq")
    if not transpose:
        return q, [*onnx_tensors(q, name, scale_dtype), act_global], nodes + act, x_dq, f"{name}_dq"
    nodes.append(helper.make_node("Transpose", [f"{name}_dq"], [f"{name}_dq_t"], perm=[1, 0], name=f"{name}_Transpose"))
    return q, [*onnx_tensors(q, name, scale_dtype), act_global], nodes + act, x_dq, f"{name}_dq_t"
