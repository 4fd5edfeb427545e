"""Calibration: the transformer's real inputs, collected by running diffusers' FluxPipeline on the prompts in
`calibration/prompts.txt` at several resolutions and every denoising step, then the activation ranges (max |x|)
of every MatMul the recipe quantizes, measured by ONNX Runtime on the graph being quantized.

The result is cached on disk (JSON) under a key of everything it depends on: model content hash, prompts
file hash, recipe, sample count, steps, resolutions, and the sha256 of the graph. Rebuilding, or building for
another GPU, reuses it; a changed prompt file or recipe misses the cache and recalibrates."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import __version__
from ..errors import FluxtrtError
from ..fileio import sha256_json, write_json_atomic
from ..records import DEFAULT_PROMPTS  # noqa: E402,F401  (re-read by tests)


@dataclass
class Calibration:
    key: str
    amax: dict  # activation tensor name -> max |x|
    cached: bool
    path: Path
    samples: int
    channel_amax: dict = None  # activation tensor name -> max |x| per channel (last axis), for SmoothQuant


def read_prompts(path: Path) -> list[str]:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise FluxtrtError(f"cannot read calibration prompts {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise FluxtrtError(f"calibration prompts {path} are not UTF-8 text") from None
    prompts = [p.strip() for p in text.splitlines() if p.strip()]
    if not prompts:
        raise FluxtrtError(f"{path} holds no prompts (one per line)")
    return prompts


def resolutions_for(geo, opt: int) -> list[tuple[int, int]]:
    """Two sizes: the profile's opt (square) and a smaller non-square one, both multiples of 16."""
    m = geo.pixel_multiple
    small = max(m * 4, (opt // 2) // m * m)
    return [(opt, opt), (small, small + 2 * m)]


def _run_pipeline(pipe, source, prompts: list[str], sizes: list[tuple[int, int]], steps: int,
                  *, on_prompt: Callable[[int, int], None] = lambda done, total: None) -> None:
    """Denoise every prompt (latents only), cycling through `sizes`; hooks on the pipeline record what they need."""
    import torch

    if source.geometry.model_class != "FluxPipeline":
        from ..errors import FluxtrtError

        raise FluxtrtError(f"calibrated recipes collect the transformer's inputs from text-to-image prompts; "
                           f"{source.geometry.model_class} models (Fill, Control, Kontext) are not calibrated yet: build "
                           "their transformer in bf16 (`-p transformer=bf16`)")
    pipe.set_progress_bar_config(disable=True)
    for i, prompt in enumerate(prompts):
        h, w = sizes[i % len(sizes)]
        with torch.no_grad():
            pipe(prompt, height=h, width=w, num_inference_steps=steps, guidance_scale=3.5,
                 max_sequence_length=source.geometry.t5_length, generator=torch.Generator().manual_seed(i),
                 output_type="latent")
        on_prompt(i + 1, len(prompts))


def collect_inputs(source, prompts: list[str], sizes: list[tuple[int, int]], steps: int) -> list[dict]:
    """Run the reference pipeline; return the transformer's keyword inputs at every step (numpy)."""
    pipe = source.load_pipeline(diffusers_pipeline="FluxPipeline")
    captured = []

    def grab(module, args, kwargs):
        captured.append({k: kwargs[k].detach().float().numpy().copy() for k in
                         ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids",
                          "txt_ids", "guidance") if kwargs.get(k) is not None})

    handle = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        _run_pipeline(pipe, source, prompts, sizes, steps)
    finally:
        handle.remove()
    return captured


def linear_input_ranges(source, prompts: list[str], sizes: list[tuple[int, int]], steps: int, dtype: str,
                        *, device: str, on_prompt: Callable[[int, int], None] = lambda done, total: None,
                        attention: bool = False) -> tuple[dict, int, list | None]:
    """max |input| of every nn.Linear in the transformer (by module name) over the pipeline's denoising steps,
    in PyTorch at `dtype` on `device`: ({module: amax}, transformer calls, attention ranges). With `attention`
    (fp8-attn) also each attention's [max |q c|, max |k c|, max P, max |v|] in forward order (attention_ranges),
    else None. The maxima stay on the device until the end (no host sync per layer)."""
    import torch

    from ..dtypes import torch_dtype

    pipe = source.load_pipeline(torch_dtype(dtype), device, diffusers_pipeline="FluxPipeline")
    amax: dict = {}
    calls = [0]
    handles = [pipe.transformer.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))]

    def hook(name):
        def record(module, args):
            a = args[0].detach().abs().amax().float()
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
        return record

    for name, m in pipe.transformer.named_modules():
        if isinstance(m, torch.nn.Linear):
            handles.append(m.register_forward_pre_hook(hook(name)))
    ranges = recording_attention_ranges(pipe.transformer) if attention else None
    try:
        _run_pipeline(pipe, source, prompts, sizes, steps, on_prompt=on_prompt)
    finally:
        for h in handles:
            h.remove()
    return ({k: float(v) for k, v in amax.items()}, calls[0],
            [[float(x) for x in r] for r in ranges] if attention else None)


def recording_attention_ranges(module) -> list:
    """Every attention of the transformer `module` (forward order) computed by SDPA and its fp8-attn ranges
    recorded: the returned list holds, per attention, attention_ranges' tensor, the maximum over the calls made
    (None before the first)."""
    import torch

    from ..attention import attention_modules, sdpa, use_attention

    ranges = [None] * len(attention_modules(module))

    def measuring(i):
        def fn(q, k, v):
            r = attention_ranges(q, k, v)
            ranges[i] = r if ranges[i] is None else torch.maximum(ranges[i], r)
            return sdpa(q, k, v)
        return fn

    use_attention(module, [measuring(i) for i in range(len(ranges))])
    return ranges


def attention_ranges(q, k, v, chunk: int = 1024):
    """The ranges fp8-attn's four Q/DQ pairs quantize, of one attention call (q, k, v [B, S, H, D] after RoPE):
    tensor [max |q c|, max |k c|, max P, max |v|] (c = fp8.sdpa_root_scale; P = softmax(q k^T c^2), whose row
    maximum is 1 / sum_j exp(s_j - max s), computed over `chunk` queries at a time in fp32)."""
    import torch

    from ..fp8 import sdpa_root_scale

    c = sdpa_root_scale(q.shape[-1]).to(q.device)
    qh, kh = (t.transpose(1, 2).float() * c for t in (q, k))
    p_max = torch.zeros((), device=q.device)
    for i in range(0, qh.shape[2], chunk):
        s = qh[:, :, i: i + chunk] @ kh.transpose(-1, -2)
        p_max = torch.maximum(p_max, (1.0 / torch.exp(s - s.amax(-1, keepdim=True)).sum(-1)).amax())
    return torch.stack([qh.abs().amax(), kh.abs().amax(), p_max, v.detach().float().abs().amax()])


def activation_ranges(model, names: list[str], samples: list[dict], per_channel: bool = False):
    """max |x| of each named tensor over all samples, from ONNX Runtime on the (fp32) graph; with
    `per_channel`, also the max per channel of the last axis: (amax, channel_amax)."""
    import numpy as np
    from onnx import TensorProto, helper

    from ..onnxio import onnxruntime

    ort = onnxruntime()

    probe = copy.deepcopy(model)
    for n in names:
        probe.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    amax: dict[str, float] = {}
    channel: dict[str, np.ndarray] = {}
    for feeds in samples:
        outs = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
        for n, o in zip(names, outs):
            a = np.abs(o)
            amax[n] = max(amax.get(n, 0.0), float(a.max()))
            if per_channel and channel.get(n, 0) is not None:
                c = a.reshape(-1, a.shape[-1]).max(axis=0)
                if n not in channel:
                    channel[n] = c
                elif channel[n].shape == c.shape:
                    channel[n] = np.maximum(channel[n], c)
                else:
                    channel[n] = None  # the last axis is a sequence (attention's k^T), not channels
    if per_channel:
        return amax, {n: v.tolist() for n, v in channel.items() if v is not None}
    return amax


def _cached(source, recipe: str, cache_dir: Path, prompts_file, size: int, *, steps: int, opt_resolution: int,
            key_extra: dict, measure: Callable) -> Calibration:
    """The calibration cache both paths share: a key of everything the ranges depend on (model content hash,
    prompts, recipe, sample count, steps, sizes, fluxtrt version, plus `key_extra`); on a miss,
    `measure(prompts, sizes)` -> (amax, channel_amax or None, samples, extra fields for the file)."""
    prompts_file = Path(prompts_file or DEFAULT_PROMPTS)
    prompts = read_prompts(prompts_file)[:size]
    sizes = resolutions_for(source.geometry, opt_resolution)
    key = sha256_json({
        "model": source.content_hash, "prompts": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
        "recipe": recipe, "size": len(prompts), "steps": steps, "sizes": sizes, "fluxtrt": __version__, **key_extra,
    })
    path = Path(cache_dir) / f"calibration-{key[:16]}.json"
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return Calibration(key=key, amax=data["amax"], cached=True, path=path, samples=data["samples"],
                               channel_amax=data.get("channel_amax"))
    amax, channel, samples, extra = measure(prompts, sizes)
    write_json_atomic(path, {"key": key, "recipe": recipe, "model_hash": source.content_hash,
                             "prompts_file": str(prompts_file), "prompts": len(prompts), "steps": steps,
                             "sizes": sizes, "samples": samples, "amax": amax, "channel_amax": channel,
                             **key_extra, **extra})
    return Calibration(key=key, amax=amax, cached=False, path=path, samples=samples, channel_amax=channel)


def calibrate(source, model, onnx_sha: str, recipe: str, cache_dir: Path, *, prompts_file: Path | None = None,
              size: int = 32, steps: int = 4, opt_resolution: int = 1024) -> Calibration:
    """Activation ranges for `recipe` on `model` (an fp32 ONNX ModelProto of the transformer), measured by
    ONNX Runtime at each quantized MatMul's input, cached."""
    from .qdq import plan

    def measure(prompts, sizes):
        samples = collect_inputs(source, prompts, sizes, steps)
        amax, channel = activation_ranges(model, plan(model, recipe).calibration_inputs(model), samples,
                                          per_channel=True)
        return amax, channel, len(samples), {}

    return _cached(source, recipe, cache_dir, prompts_file, size, steps=steps, opt_resolution=opt_resolution,
                   key_extra={"graph": onnx_sha}, measure=measure)


def calibrate_modules(source, recipe: str, cache_dir: Path, prompts_file: Path | None = None, size: int = 32,
                      *, steps: int = 4, opt_resolution: int = 1024, dtype: str = "bf16", device: str = "cpu",
                      on_prompt: Callable[[int, int], None] = lambda done, total: None) -> Calibration:
    """Activation ranges by module name (linear_input_ranges; fp8-attn: each attention's too, the file's
    "attention_amax"), cached under a key of the model, prompts, recipe, sizes, steps and dtype: not of the
    device, so a cache filled on a GPU machine (`fluxtrt calibrate --device cuda`) serves builds on CPU-only
    machines. Read by quantize.zerocopy and `run --backend torch --calibration`."""

    def measure(prompts, sizes):
        amax, calls, attention = linear_input_ranges(source, prompts, sizes, steps, dtype, device=device,
                                                     on_prompt=on_prompt, attention=recipe == "fp8-attn")
        return amax, None, calls, {"device": device, **({"attention_amax": attention} if attention else {})}

    return _cached(source, recipe, cache_dir, prompts_file, size, steps=steps, opt_resolution=opt_resolution,
                   key_extra={"dtype": dtype, "method": "linear-inputs"}, measure=measure)
