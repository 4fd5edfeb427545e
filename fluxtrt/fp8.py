"""The fp8 recipe's arithmetic, in one place for the quantizer (quantize/), validation (validate.py) and the
torch executor (runtime/): per-tensor E4M3 weights scaled by max |w| / 448 (one scale per fused projection),
calibrated static activation scales amax / 448, both rounded to bf16 as the graph holds them, and the layers the
graph keeps in bf16 (x_embedder and context_embedder read model inputs, proj_out writes the output; the 2-D
AdaLN and embedding linears are Gemms the recipe leaves alone).

Where it runs:
- `scales_from_graph`: the scales an fp8 ONNX graph (quantize.zerocopy.quantize_zero_copy) recorded, by PyTorch module.
- `scales_from_calibration`: the same scales from a calibration cache (`fluxtrt calibrate`) and the module's own
  weights, without a graph; the groups that share a weight scale are the linears that read one activation (what
  optimize's fuse_projections fuses). tests/test_fp8.py checks both give the same scales.
- `emulate` / `fake_quantize_fp8`: the same arithmetic on a PyTorch module (dequantized E4M3 weights, activations
  quantized and dequantized), which is what validation compares ONNX Runtime against. The recipe as E4M3 GEMMs
  on FP8 tensor cores (`torch._scaled_mm`) is fp8_layers.py."""

from __future__ import annotations

import json

from .errors import FluxtrtError

FP8_MAX = 448.0  # largest finite E4M3 (e4m3fn) value
QDQ_KEY = "fluxtrt.qdq"  # ONNX metadata: quantized MatMul -> the modules it computes and its scale initializers
RECIPE_VERSION = 2  # 2: the copying path quantizes like the zero-copy path (bf16-rounded weights and scales)
KEPT = ("x_embedder", "context_embedder", "proj_out")  # top-level linears the recipe keeps (qdq.plan's reasons)


def read_qdq(model) -> dict:
    """{MatMul name: {"modules": [PyTorch linear modules, a fused projection's parts in order], "act_scale":
    initializer, "weight_scale": initializer (fp8)}} as quantize_zero_copy recorded it; {} for other graphs."""
    return next((json.loads(p.value) for p in model.metadata_props if p.key == QDQ_KEY), {})


def bf16(x: float) -> float:
    """x rounded to bf16 (what the graph's scale initializers hold)."""
    import torch

    return float(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).float())


def to_e4m3(x, scale: float):
    """x / scale as E4M3 (divided in fp32, saturating, round to nearest even): QuantizeLinear's arithmetic."""
    import torch

    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def weight_scale(tensors) -> float:
    """The one E4M3 scale of a linear weight (a fused projection: all its parts): bf16(max |w| / 448), max |w|
    taken of the bf16 weight, as TensorRT's FP8 GEMM takes one weight scale; 1 for an all-zero weight."""
    top = max(float(t.detach().abs().max().float()) for t in tensors)
    return bf16(bf16(top) / FP8_MAX) or 1.0


def activation_scale(amax: float) -> float:
    """The static E4M3 scale of a calibrated input range: bf16(amax / 448) (amax at least 1e-8)."""
    return bf16(max(float(amax), 1e-8) / FP8_MAX)


def fp8_fake_quant(x, scale: float):
    """What an E4M3 QuantizeLinear/DequantizeLinear pair with a per-tensor `scale` computes, in fp32."""
    return to_e4m3(x, scale).float() * scale


def fake_quantize_fp8(module, record: dict, scales: dict) -> int:
    """Make `module` (in place) compute what an fp8 graph of quantize_zero_copy computes, emulated: every linear
    layer the graph quantized gets the graph's weight, dequantized with the graph's weight scale, and an input
    pre-hook quantizing with the graph's activation scale. `record`: read_qdq of the graph; `scales`: initializer
    name -> value. Returns the linear layers changed."""
    by_module = {m: (float(scales[r["act_scale"]]), float(scales[r["weight_scale"]]))
                 for r in record.values() if "weight_scale" in r for m in r["modules"]}
    return emulate(module, by_module)


def emulate(module, by_module: dict) -> int:
    """fake_quantize_fp8 with scales by module name: {module: (activation scale, weight scale)}. The recipe keeps
    the other linear layers in bf16 (`precisions.REGISTRY["fp8"].rest`): an fp32 module gets every linear weight
    and bias rounded to bf16 first (nothing changes for a bf16 checkpoint)."""
    import torch

    with torch.no_grad():
        for lin in module.modules():
            if isinstance(lin, torch.nn.Linear):
                for p in (lin.weight, lin.bias):
                    if p is not None:
                        p.copy_(p.to(torch.bfloat16).to(p.dtype))
    for name, (sx, sw) in by_module.items():
        lin = module.get_submodule(name)
        with torch.no_grad():
            lin.weight.copy_(fp8_fake_quant(lin.weight, sw).to(lin.weight.dtype))
        lin.register_forward_pre_hook(lambda mod, args, s=sx: (fp8_fake_quant(args[0], s).to(args[0].dtype),)
                                      + tuple(args[1:]))
    return len(by_module)


def quantize_weight(w):
    """A linear weight (numpy, any layout; a fused projection's parts joined) -> (E4M3 codes as numpy, scale): the
    weight rounded to bf16 (the recipe's rest dtype, what a bf16 checkpoint stores), one scale bf16(max |w| / 448).
    quantize.zerocopy computes the same from the checkpoint's bf16 bytes."""
    import torch

    wb = torch.from_numpy(w).float().to(torch.bfloat16).float()
    scale = weight_scale([wb])
    return to_e4m3(wb, scale).view(torch.uint8).numpy().view(_e4m3_numpy()), scale


def _e4m3_numpy():
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


def scales_from_graph(header) -> dict:
    """{module name: (activation scale, weight scale)} of an fp8 graph (`header`: the ModelProto without its
    weights: the scales are small initializers stored inline)."""
    from onnx import numpy_helper

    record = read_qdq(header)
    wanted = {r[k] for r in record.values() for k in ("act_scale", "weight_scale") if k in r}
    values = {t.name: float(numpy_helper.to_array(t).astype("float32")) for t in header.graph.initializer
              if t.name in wanted}
    out = {m: (values[r["act_scale"]], values[r["weight_scale"]]) for r in record.values() if "weight_scale" in r
           for m in r["modules"]}
    if not out:
        raise FluxtrtError("the transformer's fp8 ONNX records no quantized layer; rebuild it with `fluxtrt build "
                           "--force`")
    return out


def linear_groups(module, args, root=None) -> list[list[str]]:
    """The recipe's layers, grouped as the graph fuses them: the nn.Linear modules of the transformer `root`
    (names relative to it) that act on a 3-D activation (the graph's MatMuls; 2-D inputs are Gemms the recipe leaves
    alone), grouped by the activation they read, found by one forward of `module` (root, or a wrapper calling it)
    with `args`."""
    import torch

    seen: dict[int, list[str]] = {}
    keep_alive, hooks = [], []

    def hook(name):
        def pre(mod, inputs):
            x = inputs[0]
            if x.dim() == 3 and name.split(".")[0] not in KEPT:
                keep_alive.append(x)  # ids stay unique while the forward runs
                seen.setdefault(id(x), []).append(name)
        return pre

    for name, sub in (root or module).named_modules():
        if isinstance(sub, torch.nn.Linear):
            hooks.append(sub.register_forward_pre_hook(hook(name)))
    try:
        with torch.inference_mode():
            module(*args)
    finally:
        for h in hooks:
            h.remove()
    return list(seen.values())


def scales_from_calibration(module, module_amax: dict, groups: list[list[str]]) -> dict:
    """{module: (activation scale, weight scale)} from calibrated input ranges by module and the module's weights:
    per group, bf16(max amax / 448) and bf16(max |w| / 448) (quantize.zerocopy's arithmetic)."""
    out = {}
    for group in groups:
        missing = [m for m in group if m not in module_amax]
        if missing:
            raise FluxtrtError(f"the calibration has no range for {missing[0]}; it was made for another model: run "
                               "`fluxtrt calibrate --model ...` for this one")
        sx = activation_scale(max(float(module_amax[m]) for m in group))
        sw = weight_scale([module.get_submodule(m).weight for m in group])
        out.update({m: (sx, sw) for m in group})
    return out


def read_calibration(path, model_hash: str) -> dict:
    """The recipe of a `fluxtrt calibrate` cache file (untrusted: checked), for this model: {"amax": {module:
    amax}}; a file calibrated for fp8-attn adds "attention": [(sq, sk, sp, sv)] in forward order (its
    "attention_amax" as activation_scale takes them)."""
    from .fileio import read_json
    from .records import is_number

    data = read_json(path, "a calibration file", "pass --calibration the file `fluxtrt calibrate` wrote")
    amax = data.get("amax") if isinstance(data, dict) else None
    ranges = data.get("attention_amax") if data.get("recipe") == "fp8-attn" else []
    if not isinstance(amax, dict) or data.get("method") != "linear-inputs" or not all(
            isinstance(k, str) and is_number(v) and v >= 0 for k, v in amax.items()) or not isinstance(ranges, list) \
            or not all(isinstance(r, list) and len(r) == 4 and all(is_number(x) and x >= 0 for x in r) for r in ranges):
        raise FluxtrtError(f"--calibration {path} holds no ranges by module; make one with `fluxtrt calibrate` (the "
                           "default zero-copy path)")
    if data.get("model_hash") != model_hash:
        raise FluxtrtError(f"--calibration {path} was made for another model; run `fluxtrt calibrate --model ...` "
                           "for this one")
    if data.get("recipe") == "fp8-attn":
        return {"amax": amax, "attention": [tuple(activation_scale(x) for x in r) for r in ranges]}
    return {"amax": amax}


def recipe_record(scales: dict, attention: list | None = None) -> dict:
    """The fp8 recipe as a manifest records it (`ComponentEntry.recipe`): {"name", "scales": {module: [sx, sw]}};
    with `attention` (fp8-attn: attention_scales_from_graph) also "attention": [[sq, sk, sp, sv], ...]."""
    out = {"name": "fp8", "scales": {m: [float(sx), float(sw)] for m, (sx, sw) in sorted(scales.items())}}
    if attention:
        out.update(name="fp8-attn", attention=[[float(x) for x in a] for a in attention])
    return out


def scales_from_record(recipe: dict) -> dict:
    """recipe_record's inverse: {module: (sx, sw)}."""
    return {m: tuple(v) for m, v in recipe["scales"].items()}


# --- fp8-attn: E4M3 on both inputs of attention's two MatMuls ------------------------------------------------------
# The exported graph computes attention as torch.onnx decomposes scaled_dot_product_attention: q and k^T each
# multiplied by sqrt(1/sqrt(d)), MatMul, Softmax, MatMul with v. The recipe puts a Q/DQ pair (static per-tensor
# scale from calibration, bf16-rounded as activation_scale) on each MatMul input: q*c, (k*c)^T, p and v.

def attention_scales_from_graph(header) -> list[tuple]:
    """[(sq, sk, sp, sv), ...], one per attention in forward order (double-stream blocks, then single-stream), of an
    fp8-attn graph (quantize.qdq recorded which MatMul of which attention each Q/DQ pair feeds); [] for others."""
    from onnx import numpy_helper

    record = [r for r in read_qdq(header).values() if "attention" in r]
    wanted = {n for r in record for n in r["input_scales"]}
    values = {t.name: float(numpy_helper.to_array(t).astype("float32")) for t in header.graph.initializer
              if t.name in wanted}
    out: dict[int, list] = {}
    for r in record:
        out.setdefault(r["attention"], [None] * 4)[2 * r["matmul"]: 2 * r["matmul"] + 2] = \
            [values[n] for n in r["input_scales"]]
    if sorted(out) != list(range(len(out))) or any(None in v for v in out.values()):
        raise FluxtrtError("the transformer's fp8-attn ONNX records its attention scales incompletely; rebuild it "
                           "with `fluxtrt build --force`")
    return [tuple(out[i]) for i in range(len(out))]


def sdpa_root_scale(head_dim: int):
    """sqrt(1/sqrt(d)) in fp32, as the exported graph computes the factor it multiplies q and k^T by."""
    import torch

    return torch.tensor(float(head_dim)).sqrt().reciprocal().sqrt()


def attention_recipe(q, k, v, scales):
    """fp8-attn's attention as the graph computes it, in fp32: q, k, v [..., S, D] (after RoPE), `scales`
    (sq, sk, sp, sv). softmax(fq(q c) fq(k c)^T) quantized, times fq(v); fq = E4M3 quantize-dequantize."""
    sq, sk, sp, sv = scales
    c = sdpa_root_scale(q.shape[-1])
    s = fp8_fake_quant(q.float() * c, sq) @ fp8_fake_quant(k.float() * c, sk).transpose(-1, -2)
    return fp8_fake_quant(s.softmax(-1), sp) @ fp8_fake_quant(v.float(), sv)

