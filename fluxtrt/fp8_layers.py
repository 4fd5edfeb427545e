"""The fp8 recipe (fp8.py) as PyTorch layers, for the torch executor: `quantize_module` makes a transformer compute
it, on a GPU with FP8 tensor cores (compute capability 8.9+) as `Fp8Linear`s running `torch._scaled_mm` on E4M3
operands, with the projections that read one activation joined into one GEMM as the graph joins them
(`fuse_projections`); elsewhere emulated (fp8.emulate: dequantized E4M3, the same arithmetic)."""

from __future__ import annotations

from .errors import FluxtrtError
from .fp8 import FP8_MAX, emulate, to_e4m3


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
            return self.on_codes(to_e4m3(x.reshape(-1, x.shape[-1]), self.sx), x.shape[:-1], x.dtype)

        def on_codes(self, x8, lead, dtype):
            """The GEMM on the input's E4M3 codes x8 [rows, in] (quantized with `sx`): [*lead, out] in `dtype`."""
            y = torch._scaled_mm(x8, self.w8.t(), scale_a=self.sx, scale_b=self.sw, bias=self.bias, out_dtype=dtype)
            return y.reshape(*lead, self.out_features)

    return Fp8Linear()


def weight_only(module) -> str:
    """The fp8-wo precision (precisions.py) in place: each nn.Linear of `module` keeps its weight as E4M3 with one
    fp32 scale per output row (max |w| / 448; weight bytes halved against bf16), dequantized (fp32, then the
    layer's dtype) at each call and multiplied in the layer's dtype as before. Activations are not quantized, so no
    calibration. What T5 needs: its GEMMs run once per prompt, its weights stay resident (9.5 GB in bf16 at full
    size). Returns what was done, in words."""
    import torch

    class Fp8WeightOnlyLinear(torch.nn.Module):
        weight = None  # transformers' T5 casts its input to `wo.weight`'s dtype when that is a tensor: done here

        def __init__(self, lin):
            super().__init__()
            self.in_features, self.out_features, self.dtype = lin.in_features, lin.out_features, lin.weight.dtype
            w = lin.weight.detach().float()
            s = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            self.register_buffer("w8", to_e4m3(w, s[:, None]).contiguous())
            self.register_buffer("s", s.contiguous())
            self.bias = None if lin.bias is None else torch.nn.Parameter(lin.bias.detach().clone(), requires_grad=False)

        def forward(self, x):
            w = (self.w8.float() * self.s[:, None]).to(self.dtype)
            return torch.nn.functional.linear(x.to(self.dtype), w, self.bias)

    names = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        setattr(owner, leaf, Fp8WeightOnlyLinear(getattr(owner, leaf)))
    return f"fp8-wo: {len(names)} linear layers' weights in E4M3 (a scale per output row), multiplied in the layers' dtype"


FUSED = (("to_qkv", ("to_q", "to_k", "to_v")), ("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")))
SINGLE = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")  # a single-stream block's projections of one input
JOINED = "fluxtrt_joined"  # fuse_projections records on the module: {joined GEMM: [(part, its output rows), ...]}


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
    out = gelu_linear(self.proj_out, self.act_mlp, mlp, attn_output, tanh=self.act_mlp.approximate == "tanh")
    hidden_states = residual + gate.unsqueeze(1) * out
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def gelu_linear(lin, act, m, a=None, *, tanh: bool):
    """lin(cat([a, act(m)], -1)) (a: none, or the part before the activation's). Where `act` is a GELU with the tanh
    approximation (`tanh`) and `lin` an fp8 GEMM as fp8_linear makes it, the GELU and the GEMM's input quantize
    are one kernel (kernels/gelu_quantize.py) writing the E4M3 codes the GEMM reads; any other `lin` (a LoRA's
    wrapper reads the activation itself) or activation: computed as written."""
    if tanh and hasattr(lin, "on_codes"):
        from .kernels.gelu_quantize import gelu_quantize

        return lin.on_codes(gelu_quantize(m, lin.sx, a), m.shape[:-1], m.dtype)
    return written_out(lin, act, m, a)


def written_out(lin, act, m, a=None):
    """lin(cat([a, act(m)], -1)) as written: the activation materialised, then the layer (its own quantize)."""
    import torch

    x = act(m)
    return lin(x if a is None else torch.cat([a, x], dim=-1))


def _feed_forward(self, hidden_states, *args, **kwargs):
    """diffusers' FeedForward.forward for net = [GELU(tanh), Dropout, Linear] (eval: the dropout is the identity),
    its GELU and the last GEMM's input quantize as one kernel where that GEMM is fp8 (gelu_linear)."""
    act, _, out = self.net
    return gelu_linear(out, act.gelu, act.proj(hidden_states), tanh=True)


def fuse_gelu_quantize(module) -> int:
    """Each feed-forward of `module` that is [GELU(tanh), Dropout, Linear] computes through gelu_linear (the
    single-stream blocks' forward of fuse_projections does already). Returns how many."""
    import types

    import torch

    count = 0
    for sub in module.modules():
        net = getattr(sub, "net", None)
        if (isinstance(net, torch.nn.ModuleList) and len(net) == 3 and hasattr(net[0], "proj")
                and getattr(net[0], "approximate", None) == "tanh" and isinstance(net[1], torch.nn.Dropout)):
            sub.forward = types.MethodType(_feed_forward, sub)
            count += 1
    return count


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
    joined, as E4M3 GEMMs; the parts are dropped, and recorded on the module (JOINED: where runtime/lora.py puts a
    part's low-rank term). Returns the number of joined GEMMs."""
    import types

    import torch

    if not hasattr(module, "fuse_qkv_projections"):
        return 0
    rows = {name: sub.out_features for name, sub in module.named_modules() if isinstance(sub, torch.nn.Linear)}
    module.fuse_qkv_projections()
    count = 0
    joined = getattr(module, JOINED, {})

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
                joined[prefix + "proj_qkv_mlp"] = [(n, rows[n]) for n in names]
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
                joined[prefix + whole] = [(n, rows[n]) for n in names]
                for part in parts:
                    delattr(sub, part)
                count += 1
            else:  # parts with their own scales: run them unfused
                delattr(sub, whole)
                sub.fused_projections = False
    setattr(module, JOINED, joined)
    return count


def attention_kernel(device) -> str | None:
    """Which kernel computes fp8-attn's attention on `device`: "flashinfer" (Hopper with the flashinfer package),
    "triton" (other FP8 tensor cores), None (emulated)."""
    if not tensor_cores(device):
        return None
    from .kernels import flashinfer_fp8_attention

    return "flashinfer" if flashinfer_fp8_attention.available() is None else "triton"


def single_stream_fn(fa3, scales):
    """fp8-attn's attention of a single-stream block on FlashInfer from its projections before RMSNorm and RoPE (the
    processor calls it where an attention fn has it, attention.Processor): fa3.attention_single_stream."""
    return lambda q, k, v, attn, rotary: fa3.attention_single_stream(q, k, v, attn, rotary, scales=scales)


def quantize_attention(module, attention: list, device) -> str:
    """fp8-attn's attention on the transformer `module`, in place: each attention (forward order) gets its scales
    (sq, sk, sp, sv) and computes on FP8 tensor cores where `device` has them (on Hopper with the flashinfer package:
    its FA3 FP8 kernel, kernels/flashinfer_fp8_attention.py; else kernels/fp8_attention.py, a Triton kernel over
    E4M3 Q, K, V and P), else fp8.attention_recipe emulated (E4M3 quantize-dequantize, fp32 MatMuls and softmax:
    the graph's arithmetic). Returns what it did, in words."""
    from .attention import use_attention
    from .fp8 import attention_recipe

    kernel = attention_kernel(device)
    fa3 = None  # FlashInfer's kernel module where it runs here
    if kernel == "flashinfer":
        from .kernels import flashinfer_fp8_attention as fa3
    fused = []  # the single-stream fns set: the note counts the single blocks that take them

    def fn_of(scales):
        def emulated(q, k, v):  # [B, S, H, D], as diffusers' processor holds them
            t = (1, 2)
            return attention_recipe(q.transpose(*t), k.transpose(*t), v.transpose(*t), scales).transpose(*t)

        def on_tensor_cores(q, k, v):
            if fa3 is not None:
                return fa3.attention(q, k, v, scales)
            from .kernels.fp8_attention import attention as fp8_attention

            return fp8_attention(q, k, v, scales)
        if fa3 is not None:  # single-stream blocks: q's and k's RMSNorm, RoPE and quantize as one kernel each
            single = single_stream_fn(fa3, scales)
            if single is not None:
                on_tensor_cores.single_stream = single
                fused.append(single)
        return on_tensor_cores if kernel else emulated

    try:
        n = use_attention(module, [fn_of(tuple(s)) for s in attention])
    except ValueError as e:
        raise FluxtrtError(f"the fp8-attn recipe does not fit this transformer ({e}): it was built for another "
                           "model; build the engines again for this one") from None
    if kernel:
        which = "FlashInfer's FA3 FP8 kernel" if fa3 is not None else "Triton kernel"
        singles = sum(1 for m in module.modules() if getattr(m, "added_kv_proj_dim", 0) is None
                      and hasattr(m, "norm_q")) if fused else 0
        tail = f"; q and k of {singles} single blocks normed, rotated and quantized in one Triton kernel each" \
            if singles else ""
        return f"attention in E4M3 on FP8 tensor cores in {n} attentions ({which}{tail})"
    return f"attention in E4M3 emulated in {n} attentions (fp32 MatMuls of dequantized E4M3)"


def quantize_module(module, by_module: dict, device, fuse: bool = True, scaled_mm: bool | None = None, *,
                    attention: list | None = None) -> str:
    """Make the transformer `module` compute the recipe `by_module` ({module: (sx, sw)}), in place: on FP8 tensor
    cores where `device` has them (projections of one input joined into one E4M3 GEMM where they share their
    scales, as in the graph), else emulated. `scaled_mm` forces one or the other (tests: torch._scaled_mm also
    runs on a CPU). `attention` (fp8-attn: [(sq, sk, sp, sv)] in forward order): quantize_attention too. Returns
    which, in words."""
    linear = _quantize_linear(module, by_module, device, fuse, scaled_mm)
    return f"{linear}; {quantize_attention(module, attention, device)}" if attention else linear


def _quantize_linear(module, by_module: dict, device, fuse: bool, scaled_mm: bool | None) -> str:
    import torch

    if not (tensor_cores(device) if scaled_mm is None else scaled_mm):
        emulate(module, by_module)
        return f"fp8 recipe emulated on {device} (dequantized E4M3, same arithmetic; no speedup without FP8 tensor cores)"
    fused = fuse_projections(module, by_module) if fuse else 0
    feed_forwards = fuse_gelu_quantize(module)
    done = 0
    for name, (sx, sw) in by_module.items():
        parent, _, leaf = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        if isinstance(getattr(owner, leaf, None), torch.nn.Linear):  # joined parts are gone
            setattr(owner, leaf, fp8_linear(getattr(owner, leaf), sx, sw))
            done += 1
    gelu = gelu_quantize_note(device, feed_forwards + (fused and _single_blocks(module)))
    return (f"fp8 recipe on {device} through torch._scaled_mm (E4M3 GEMMs): {len(by_module)} linear layers in "
            f"{done + fused} GEMMs ({fused} joined projections){gelu}")


def _single_blocks(module) -> int:
    return sum(1 for sub in module.modules() if hasattr(sub, "proj_qkv_mlp"))


def gelu_quantize_note(device, gemms: int) -> str:
    """What computes the GELU and input quantize of `gemms` fp8 GEMMs on `device`, in words ("" for none)."""
    if not gemms:
        return ""
    from .kernels.gelu_quantize import runs_on

    how = "one Triton kernel" if runs_on(device) else "PyTorch (no Triton kernel on this device)"
    return f"; GELU and input quantize of {gemms} GEMMs as {how}"


def calibrated_scales(raw, spec, geo, module_amax: dict, *, device, dtype) -> dict:
    """The recipe's scales {module: (sx, sw)} for the transformer `raw` from calibrated activation ranges by module
    (`fluxtrt calibrate`) and its weights, projections of one input grouped as the graph fuses them (the torch
    executor and the compiled packages both come through here)."""
    from . import fp8
    from .components import ShapePoint

    m = geo.pixel_multiple
    feeds = spec.sample_inputs(ShapePoint(1, 4 * m, 4 * m), geo, 0)
    args = [feeds[t.name].to(device, dtype) if feeds[t.name].is_floating_point() else feeds[t.name].to(device)
            for t in spec.inputs if t.name in feeds]
    groups = fp8.linear_groups(spec.wrap(raw), args, root=raw)
    return fp8.scales_from_calibration(raw, module_amax, groups)

