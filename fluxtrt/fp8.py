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
- `quantize_module`: a PyTorch transformer made to compute the recipe: on a GPU with FP8 tensor cores (compute
  capability 8.9+) every quantized linear is an `Fp8Linear` running `torch._scaled_mm` on E4M3 operands (q/k/v
  fused as the graph fuses them); elsewhere the same arithmetic emulated (`fake_quantize_fp8`: dequantized E4M3
  weights, activations quantized and dequantized), which is what validation compares ONNX Runtime against."""

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
    """The activation ranges by module of a `fluxtrt calibrate` cache file (untrusted: checked), for this model."""
    from .fileio import read_json
    from .records import is_number

    data = read_json(path, "a calibration file", "pass --calibration the file `fluxtrt calibrate` wrote")
    amax = data.get("amax") if isinstance(data, dict) else None
    if not isinstance(amax, dict) or data.get("method") != "linear-inputs" or not all(
            isinstance(k, str) and is_number(v) and v >= 0 for k, v in amax.items()):
        raise FluxtrtError(f"--calibration {path} holds no ranges by module; make one with `fluxtrt calibrate` (the "
                           "default zero-copy path)")
    if data.get("model_hash") != model_hash:
        raise FluxtrtError(f"--calibration {path} was made for another model; run `fluxtrt calibrate --model ...` "
                           "for this one")
    return amax


def tensor_cores(device) -> bool:
    """Whether `device` runs E4M3 GEMMs (torch._scaled_mm): a CUDA GPU of compute capability 8.9 or newer."""
    import torch

    from .precisions import REGISTRY

    dev = torch.device(device)
    return (dev.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(dev) >= REGISTRY["fp8"].min_cc)


def fp8_linear(lin, sx: float, sw: float):
    """An nn.Module computing `lin` as the recipe does on FP8 tensor cores: the input quantized with the static
    scale `sx` (fp32 divide, saturate, round to nearest even), the weight stored as E4M3 with scale `sw`,
    torch._scaled_mm accumulating in fp32 and writing the input's dtype, the bias added there."""
    import torch

    class Fp8Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.in_features, self.out_features = lin.in_features, lin.out_features
            # [out, in] row-major; passed as .t(): the column-major [in, out] operand _scaled_mm wants
            self.register_buffer("w8", to_e4m3(lin.weight.detach(), sw).contiguous())
            self.register_buffer("sx", torch.tensor(sx, dtype=torch.float32, device=lin.weight.device))
            self.register_buffer("sw", torch.tensor(sw, dtype=torch.float32, device=lin.weight.device))
            self.bias = None if lin.bias is None else torch.nn.Parameter(lin.bias.detach().clone(), requires_grad=False)

        def forward(self, x):
            shape = x.shape
            x8 = to_e4m3(x.reshape(-1, shape[-1]), self.sx)
            y = torch._scaled_mm(x8, self.w8.t(), scale_a=self.sx, scale_b=self.sw, bias=self.bias,
                                 out_dtype=x.dtype)
            return y.reshape(*shape[:-1], self.out_features)

    return Fp8Linear()


FUSED = (("to_qkv", ("to_q", "to_k", "to_v")), ("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")))
SINGLE = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")  # a single-stream block's projections of one input


def _single_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                          joint_attention_kwargs=None):
    """diffusers' FluxSingleTransformerBlock.forward with q/k/v and the MLP input as one GEMM (`proj_qkv_mlp`);
    the attention's `to_qkv` is the identity on the q/k/v part (tests compare it with the block it replaces)."""
    import torch

    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    qkv, mlp = self.proj_qkv_mlp(norm_hidden_states).split([self.qkv_width, self.mlp_hidden_dim], dim=-1)
    attn_output = self.attn(hidden_states=qkv, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    hidden_states = torch.cat([attn_output, self.act_mlp(mlp)], dim=2)
    hidden_states = residual + gate.unsqueeze(1) * self.proj_out(hidden_states)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def _joined(parts):
    """One nn.Linear over the concatenated output features of `parts` (same input; biases all or none)."""
    import torch

    w = torch.cat([p.weight.detach() for p in parts])
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if lin.bias is not None:
            lin.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    return lin


def fuse_projections(module, by_module: dict | None = None) -> int:
    """The transformer's projections that read one activation as one GEMM each, as the optimize stage's
    fuse_projections joins them: q/k/v of every attention (diffusers' fuse_qkv_projections) and a single-stream
    block's q/k/v with its MLP input. With `by_module` ({module: (sx, sw)}) only parts sharing their scales are
    joined, as E4M3 GEMMs; the parts are dropped. Returns the number of joined GEMMs."""
    import types

    import torch

    if not hasattr(module, "fuse_qkv_projections"):
        return 0
    module.fuse_qkv_projections()
    count = 0

    def linear(lin, names):
        return fp8_linear(lin, *by_module[names[0]]) if by_module is not None else lin

    def shared(names):
        return by_module is None or (all(n in by_module for n in names) and len({by_module[n] for n in names}) == 1)

    for name, sub in list(module.named_modules()):
        prefix = f"{name}." if name else ""
        if hasattr(sub, "proj_mlp") and getattr(getattr(sub, "attn", None), "fused_projections", False):
            names = [prefix + p for p in SINGLE]
            if shared(names):
                sub.proj_qkv_mlp = linear(_joined([sub.attn.to_qkv, sub.proj_mlp]), names)
                sub.qkv_width = sub.attn.to_qkv.out_features
                sub.attn.to_qkv = torch.nn.Identity()
                for part in ("to_q", "to_k", "to_v"):
                    delattr(sub.attn, part)
                del sub.proj_mlp
                sub.forward = types.MethodType(_single_block_forward, sub)
                count += 1
                continue
        for whole, parts in FUSED:
            fused = getattr(sub, whole, None)
            if not isinstance(fused, torch.nn.Linear):
                continue
            names = [prefix + p for p in parts]
            if shared(names):
                setattr(sub, whole, linear(fused, names))
                for part in parts:
                    delattr(sub, part)
                count += 1
            else:  # parts with their own scales: run them unfused
                delattr(sub, whole)
                sub.fused_projections = False
    return count


def quantize_module(module, by_module: dict, device, fuse: bool = True, scaled_mm: bool | None = None) -> str:
    """Make the transformer `module` compute the recipe `by_module` ({module: (sx, sw)}), in place: on FP8 tensor
    cores where `device` has them (projections of one input joined into one E4M3 GEMM where they share their
    scales, as in the graph), else emulated. `scaled_mm` forces one or the other (tests: torch._scaled_mm also
    runs on a CPU). Returns which, in words."""
    import torch

    if not (tensor_cores(device) if scaled_mm is None else scaled_mm):
        emulate(module, by_module)
        return f"fp8 recipe emulated on {device} (dequantized E4M3, same arithmetic; no speedup without FP8 tensor cores)"
    fused = fuse_projections(module, by_module) if fuse else 0
    done = 0
    for name, (sx, sw) in by_module.items():
        parent, _, leaf = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        if isinstance(getattr(owner, leaf, None), torch.nn.Linear):  # joined parts are gone
            setattr(owner, leaf, fp8_linear(getattr(owner, leaf), sx, sw))
            done += 1
    return (f"fp8 recipe on {device} through torch._scaled_mm (E4M3 GEMMs): {len(by_module)} linear layers in "
            f"{done + fused} GEMMs ({fused} joined projections)")
