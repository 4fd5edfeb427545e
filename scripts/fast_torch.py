"""The torch executor's fast paths against diffusers on one GPU (issue: speed you can see), in one process per phase.

accuracy: one transformer call of the fp8 recipe through torch._scaled_mm against the recipe emulated in fp32, beside
  the bf16-vs-fp32 pair, and fp8-attn's (attention in E4M3 too: its kernel in bf16 and the recipe emulated in fp32,
  attention scales from the same call), on the random full-size transformer with its linear weights redrawn N(0, 0.005) (with the
  class's default initialisation the model is chaotic); the scales come from one calibration call.
speed: end to end (text encoders, N steps, VAE decode) for diffusers eager bf16 (the baseline, same run), diffusers
  with the transformer compiled, fluxtrt's torch executor bf16 compiled (q/k/v fused) and fp8 compiled
  (`--calibration` from `fluxtrt calibrate`: the product's two commands), each with its first call (compile) timed;
  `bf16-graph` / `fp8-graph`: the same with the compiled step captured as a CUDA graph (`--cuda-graph`);
  `fp8attn` / `fp8attn-graph`: the fp8-attn recipe (`fluxtrt calibrate --recipe fp8-attn`: attention in E4M3 too,
  on FlashInfer's FA3 FP8 kernel where it is, else our Triton kernel; the row's notes say which).
  A variant may carry modifiers after "+": `+flash` (SDPA's cuDNN backend off, so flash attention runs),
  `+cdt` (Inductor's coordinate-descent tuning of its Triton kernels, in all directions, epilogue fusion off,
  1x1 convolutions as matrix multiplies: flux-fast's settings), `+autotune` (Inductor's max-autotune GEMMs: Triton
  templates, fp8 scaled_mm included, against cuBLAS, with the pointwise work after a winning template fused into
  its epilogue), `+lora` (`run --lora` with a random rank-32 LoRA over every attention projection: merged into
  bf16 weights, low-rank terms beside fp8 GEMMs), `+percall` (the AdaLN modulation computed in every transformer
  call, as before runtime/modulation.py computed the schedule's up front), `+unfused` (each GELU and the next
  GEMM's input quantize left to Inductor, as before kernels/gelu_quantize.py), `+unfusednorm` (fp8-attn on
  FlashInfer: each single block's q/k RMSNorm, RoPE and quantize left to Inductor, as before
  kernels/norm_rope_quantize.py), e.g. `bf16-graph+flash`, `fp8-graph+autotune`, `fp8-graph+lora`,
  `fp8attn-graph+percall`, `fp8attn-graph+unfused`, `fp8attn-graph+unfusednorm`.
lora: the fp8 recipe with a LoRA merged before quantizing against the base quantized with the low-rank terms
  beside its GEMMs (issue 43: which one the fp8 path takes), in fp32, on accuracy's model and call.
kernels: the GELU + input quantize before the GEMMs that read a GELU (kernels/gelu_quantize.py) at --size, batch 1:
  Inductor's fused kernel against ours in several tiles (median microseconds of 50 calls, each between CUDA
  events, as fp8_attention_bench.py times; TB/s moved; codes differing).

Rows go to --out as JSON after every measurement (a cut run keeps what it measured); `speed` also writes the
`fast_torch.json` form: [{size, batch, steps, variant, e2e_s, baseline_s, ratio, ...}].
Device:  python3 scripts/fast_torch.py accuracy --out $OUT/acc.json
         python3 scripts/fast_torch.py speed --shapes 1024x1 --out $OUT/speed.json
         python3 scripts/fast_torch.py lora --out $OUT/lora.json
         python3 scripts/fast_torch.py kernels --out $OUT/kernels.json
Rehearse here: python3 scripts/fast_torch.py accuracy --model tiny --device cpu --size 256 --out /tmp/a.json
               TRITON_INTERPRET=1 python3 scripts/fast_torch.py kernels --model tiny --device cpu --size 256 ...
               python3 scripts/fast_torch.py lora --model tiny --device cpu --size 256 --out /tmp/l.json
               python3 scripts/fast_torch.py speed --model tiny --device cpu --shapes 256x1 --steps 2 --no-compile ..."""

import argparse
import gc
import json
import os
import time
from functools import partial
from pathlib import Path

import torch

from fluxtrt import fp8, fp8_layers
from fluxtrt.attention import sdpa, use_attention
from fluxtrt.bench import add_ratios, bench_diffusers, bench_fluxtrt
from fluxtrt.components import ShapePoint, specs_for
from fluxtrt.models.source import resolve_model
from fluxtrt.quantize.calibration import recording_attention_ranges

RECIPES = {"fp8": "fp8", "fp8attn": "fp8-attn"}  # variant prefix -> the calibrated recipe it runs


FUSED_GELU_LINEAR = fp8_layers.gelu_linear
FUSED_SINGLE_STREAM = fp8_layers.single_stream_fn


def unfused_gelu_linear(lin, act, m, a=None, *, tanh: bool):
    """fp8_layers.gelu_linear without kernels/gelu_quantize (speed's +unfused): the GELU, then the GEMM's own
    input quantize, which Inductor fuses with it."""
    return fp8_layers.written_out(lin, act, m, a)


def recipe_of(variant: str) -> str | None:
    """The calibrated recipe a variant runs ("fp8attn-graph+flash" -> "fp8-attn"), None for bf16 and diffusers."""
    return RECIPES.get(variant.split("+")[0].split("-")[0])


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().mean() / b.float().abs().mean())


def write(path, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # a chain's step names its own folder
    Path(path).write_text(json.dumps(obj, indent=1, default=str))


def redrawn(src, device):
    """The fp32 transformer with its linear weights and biases redrawn N(0, 0.005), bf16-exact (a bf16 module loaded
    with its state has the same weights); the same draw every call."""
    raw = src.load_component("transformer", torch.float32, device).eval()
    g = torch.Generator(device).manual_seed(1)
    with torch.no_grad():
        for m in raw.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_((torch.randn(m.weight.shape, generator=g, device=device) * 0.005).bfloat16().float())
                if m.bias is not None:
                    m.bias.copy_((torch.randn(m.bias.shape, generator=g, device=device) * 0.005).bfloat16().float())
    return raw


def one_call(a, src, spec):
    """run(module, dtype): one transformer call on fixed inputs at --size, as fp32; run.args(dtype): its inputs."""
    feeds = spec.sample_inputs(ShapePoint(1, a.size, a.size), src.geometry, 7)

    def args(dtype):
        return [feeds[t.name].to(a.device, dtype) if feeds[t.name].is_floating_point() else feeds[t.name].to(a.device)
                for t in spec.inputs if t.name in feeds]

    def run(module, dtype):
        with torch.inference_mode():
            return spec.wrap(module)(*args(dtype)).float()

    run.args = args
    return run


def recording_amax(raw):
    """{linear: max |input|} filled by the next calls, and the hooks to remove."""
    amax, hooks = {}, []
    for name, m in raw.named_modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, inp, n=name: amax.__setitem__(n, max(amax.get(n, 0.0), float(inp[0].abs().max())))))
    return amax, hooks


def accuracy(a) -> None:
    src = resolve_model(a.model)
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    raw = redrawn(src, a.device)
    run = one_call(a, src, spec)
    amax, hooks = recording_amax(raw)
    ranges = recording_attention_ranges(raw)  # fp8-attn's: each attention's [|q c|, |k c|, P, |v|] maxima
    ref32 = run(raw, torch.float32)  # the calibration call (max |input| of every linear) and the fp32 reference
    use_attention(raw, [sdpa] * len(ranges))
    for h in hooks:
        h.remove()
    attention = [tuple(fp8.activation_scale(float(x)) for x in r) for r in ranges]
    raw.to("cpu")  # the fp32 model (48 GB) waits in host memory: with the bf16 and E4M3 copies it overfills 80 GB
    b16 = src.load_component("transformer", torch.bfloat16, a.device).eval()
    b16.load_state_dict(raw.state_dict())  # the same (bf16-exact) weights, without an fp32 copy
    out_b16 = run(b16, torch.bfloat16)
    scales = fp8.scales_from_calibration(b16, amax, fp8.linear_groups(spec.wrap(b16), run.args(torch.bfloat16),
                                                                      root=b16))
    note = fp8_layers.quantize_module(b16, scales, a.device, scaled_mm=True)
    out_mm = run(b16, torch.bfloat16)
    note_attn = fp8_layers.quantize_attention(b16, attention, a.device)  # fp8-attn: attention on its kernel too
    out_attn = run(b16, torch.bfloat16)
    del b16
    gc.collect()
    raw.to(a.device)
    fp8.emulate(raw, scales)
    out_emu32 = run(raw, torch.float32)
    fp8_layers.quantize_attention(raw, attention, "cpu")  # "cpu": no FP8 tensor cores, the recipe emulated (fp32)
    out_attn_emu32 = run(raw, torch.float32)
    use_attention(raw, [sdpa] * len(ranges))  # back to the fp8 recipe alone
    out_emu16 = run(raw.to(torch.bfloat16), torch.bfloat16)
    rows = {"model": a.model, "weights": "linear weights and biases N(0, 0.005), bf16-exact", "size": a.size,
            "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
            "layers": len(scales), "how": note, "metric": "mean |a - b| / mean |b|, one transformer call",
            "scaled_mm_bf16_vs_emulated_fp32": rel(out_mm, out_emu32),
            "emulated_bf16_vs_emulated_fp32": rel(out_emu16, out_emu32),
            "bf16_vs_fp32_unquantized": rel(out_b16, ref32), "recipe_error_emulated_fp32_vs_fp32": rel(out_emu32, ref32),
            "fp8_attn": {"how": note_attn, "recipe_error_emulated_fp32_vs_fp32": rel(out_attn_emu32, ref32),
                         "kernel_bf16_vs_fp32": rel(out_attn, ref32), "fp8_kernel_bf16_vs_fp32": rel(out_mm, ref32),
                         "kernel_bf16_vs_emulated_fp32": rel(out_attn, out_attn_emu32)}}
    print(json.dumps(rows, indent=1), flush=True)
    write(a.out, rows)


def the_lora(a, src) -> Path:
    """One random rank-`--lora-rank` LoRA over every attention projection (serve_lora_bench's: A, B N(0, 0.01))."""
    from serve_lora_bench import write_loras

    folder = Path(a.work) / f"lora-r{a.lora_rank}"
    return folder / f"{write_loras(src, folder, 1, a.lora_rank)[0]}.safetensors"


def lora(a) -> None:
    """The fp8 recipe with a LoRA, two ways, in fp32 (the recipe emulated): the LoRA merged into the weights before
    they are quantized (weight scales of the merged weights, activation scales of the base's calibration: the
    calibration file a user has), or the base quantized and the low-rank term beside each GEMM (the torch
    executor's way, runtime/lora.add_side_paths). Each against the fp32 model with the LoRA merged; `effect_error`:
    how far the change the LoRA makes (with LoRA - without, each computed that way) is from fp32's."""
    from fluxtrt.runtime import lora as lr
    from fluxtrt.runtime.lora import LoraRef

    src = resolve_model(a.model)
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    loras = lr.read_loras([LoraRef(the_lora(a, src), 1.0)])
    run = one_call(a, src, spec)
    raw = redrawn(src, a.device)
    amax, hooks = recording_amax(raw)
    base32 = run(raw, torch.float32)  # the calibration call and the fp32 reference without the LoRA
    for h in hooks:
        h.remove()
    groups = fp8.linear_groups(spec.wrap(raw), run.args(torch.float32), root=raw)
    scales = fp8.scales_from_calibration(raw, amax, groups)
    targets = sorted({layer for lf, _ in loras for layer in lf.factors})
    before = {t: raw.get_submodule(t).weight.detach().to("cpu", copy=True) for t in targets}
    layers = lr.merge_into(raw, loras)
    ref32 = run(raw, torch.float32)
    scales_merged = fp8.scales_from_calibration(raw, amax, groups)
    # in the weights: the E4M3 merged weight's change against the E4M3 base weight, vs the LoRA's delta
    kept = []
    for t in targets:
        w, d = before[t].to(a.device), raw.get_submodule(t).weight.detach() - before[t].to(a.device)
        q = fp8.fp8_fake_quant((w + d).bfloat16().float(), scales_merged[t][1]) - fp8.fp8_fake_quant(w, scales[t][1])
        kept.append(rel(q, d))
    del before
    fp8.emulate(raw, scales_merged)
    merged = run(raw, torch.float32)
    del raw
    gc.collect()
    raw = redrawn(src, a.device)
    fp8.emulate(raw, scales)
    fp8_base = run(raw, torch.float32)
    hosts = lr.add_side_paths(raw, lr.side_path_plan(raw, loras), torch.float32)
    side = run(raw, torch.float32)
    effect = ref32 - base32
    rows = {"model": a.model, "weights": "linear weights and biases N(0, 0.005), bf16-exact", "size": a.size,
            "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
            "lora": f"rank {a.lora_rank} over every attention projection ({layers} layers; A, B N(0, 0.01)), scale 1",
            "metric": "mean |a - b| / mean |b|, one transformer call, the fp8 recipe emulated in fp32",
            "lora_effect_vs_base_fp32": rel(ref32, base32), "fp8_without_lora_vs_fp32": rel(fp8_base, base32),
            "merged_before_quantize": {"vs_fp32_with_lora": rel(merged, ref32),
                                       "effect_error": rel(merged - fp8_base, effect),
                                       "delta_error_in_weights_mean": sum(kept) / len(kept),
                                       "delta_error_in_weights_max": max(kept)},
            "side_terms": {"hosts": hosts, "vs_fp32_with_lora": rel(side, ref32),
                           "effect_error": rel(side - fp8_base, effect)}}
    print(json.dumps(rows, indent=1), flush=True)
    write(a.out, rows)


def speed(a) -> None:
    from fluxtrt import api
    from fluxtrt.quantize.calibration import calibrate_modules
    from fluxtrt.runtime.assembly import open_pipeline

    src = resolve_model(a.model)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    variants = [v for v in a.variants.split(",") if v]
    cal = {}  # recipe -> calibration: what `fluxtrt calibrate [--recipe fp8-attn]` runs for a bf16 checkpoint
    for recipe in sorted({recipe_of(v) for v in variants} - {None}):
        t0 = time.perf_counter()  # (module ranges; fp8-attn: attention's too), also random:
        cal[recipe] = calibrate_modules(src, recipe, Path(a.work) / "calibration", None, 1, steps=1,
                                        opt_resolution=512, dtype="bf16", device=a.device)
        print(f"calibrate {recipe}: {time.perf_counter() - t0:.1f} s -> {cal[recipe].path}", flush=True)
    gc.collect()  # the calibration's pipeline sits in reference cycles: run 12's diffusers row held its 22 GB
    if a.device == "cuda":
        torch.cuda.empty_cache()
    rows, table = [], []

    def save():
        write(a.out, {"meta": {"model": a.model, "steps": a.steps, "runs": a.runs, "torch": torch.__version__,
                               "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                               "compile": a.compile, "date": time.strftime("%Y-%m-%d")}, "rows": rows})
        write(Path(a.out).with_name("fast_torch_rows.json"), table)

    import torch._inductor.config as inductor

    default_backends = inductor.max_autotune_gemm_backends
    for variant in variants:
        kind, *mods = variant.split("+")
        unknown = set(mods) - {"flash", "cdt", "autotune", "lora", "percall", "unfused", "unfusednorm"}
        if unknown:
            raise SystemExit(f"unknown modifier(s) {sorted(unknown)} in {variant}")

        # +cdt: Inductor as flux-fast sets it: coordinate-descent tuning of the Triton kernels in all directions,
        # epilogue fusion off, 1x1 convolutions (the VAE's) as matrix multiplies
        inductor.coordinate_descent_tuning = inductor.coordinate_descent_check_all_directions = "cdt" in mods
        inductor.epilogue_fusion = "cdt" not in mods
        inductor.conv_1x1_as_mm = "cdt" in mods
        # +autotune: Inductor's GEMM templates beside cuBLAS (Triton scaled_mm too), each GEMM timed at compile
        # time; where a template wins, its epilogue takes the pointwise work after it (GELU, the next layer's
        # activation quantize) instead of a separate kernel
        inductor.max_autotune = inductor.max_autotune_gemm = "autotune" in mods
        inductor.max_autotune_gemm_backends = "ATEN,TRITON" if "autotune" in mods else default_backends
        # Inductor's caches key on the traced graph, not on SDPA's backend switches: one cache folder per variant
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(a.work) / "inductor" / variant.replace("+", "_"))
        torch.backends.cuda.enable_cudnn_sdp("flash" not in mods)
        # +unfused: each GELU written out and quantized as the next GEMM's input, as Inductor fuses it by itself
        fp8_layers.gelu_linear = unfused_gelu_linear if "unfused" in mods else FUSED_GELU_LINEAR
        # +unfusednorm: single blocks' q/k through the processor's RMSNorm and RoPE, quantized where Inductor fuses it
        fp8_layers.single_stream_fn = (lambda fa3, scales: None) if "unfusednorm" in mods else FUSED_SINGLE_STREAM
        # what the process holds before this variant loads: peak_gb includes it (calibration, earlier variants)
        held = round(torch.cuda.memory_allocated() / 2**30, 2) if a.device == "cuda" else None
        t_load = time.perf_counter()
        if kind.startswith("diffusers"):
            pipe = src.load_pipeline(dtype, a.device)
            pipe.set_progress_bar_config(disable=True)
            if kind == "diffusers-compiled":
                pipe.transformer = torch.compile(pipe.transformer, fullgraph=False, dynamic=False)
        else:
            recipe = recipe_of(variant)
            pipe = open_pipeline(None, backend="torch", model=src, torch_dtype="bf16" if a.device == "cuda" else "fp32",
                               compile=a.compile, calibration=cal[recipe].path if recipe else None,
                               cuda_graph=kind.endswith("-graph"), lora=(the_lora(a, src),) if "lora" in mods else ())
            if "percall" in mods:  # the modulation computed in every call, not for the schedule up front
                pipe.executors["transformer"].schedule_rows = lambda feeds, schedule: None
        load_s = time.perf_counter() - t_load
        # what it holds once loaded, before its first call (weights, the process's earlier holdings): against
        # peak_gb, what the calls add (activations, CUDA graph pools, compile-time buffers left allocated)
        loaded = round(torch.cuda.memory_allocated() / 2**30, 2) if a.device == "cuda" else None
        for size, batch in shapes:
            t1 = time.perf_counter()
            if kind.startswith("diffusers"):
                row = bench_diffusers(pipe, src.geometry, size, size, batch, steps=a.steps, runs=a.runs, warmup=1, device=dev)
                row.system = variant
            else:
                row = bench_fluxtrt(pipe, f"fluxtrt torch {variant}" + (" compiled" if a.compile else ""), size, size,
                                    batch, steps=a.steps, runs=a.runs, warmup=1)
            wall = time.perf_counter() - t1
            first = wall - row.end_to_end_s.median * a.runs  # the warm-up call: compile included
            rows.append({"variant": variant, "row": row, "load_s": load_s, "first_call_s": first,
                         "notes": api.transformer_notes(pipe) if not kind.startswith("diffusers") else []})
            base = next((r["row"] for r in rows if r["variant"] == "diffusers" and (r["row"].height, r["row"].batch)
                         == (size, batch)), None)  # list diffusers first: the baseline is looked up as measured
            if base is not None and base is not row:
                add_ratios(row, base)
            table.append({"size": size, "batch": batch, "steps": a.steps, "variant": variant,
                          "e2e_s": round(row.end_to_end_s.median, 4),
                          "baseline_s": round(base.end_to_end_s.median, 4) if base is not None else None,
                          "ratio": round(base.end_to_end_s.median / row.end_to_end_s.median, 3) if base else None,
                          "step_ms": round(row.transformer_step_s.median * 1000, 2),
                          "first_call_s": round(first, 1), "peak_gb": row.peak_memory_gb, "held_before_gb": held,
                          "loaded_gb": loaded})
            print(json.dumps(table[-1]), flush=True)
            save()
            if variant == a.profile:
                profile(pipe, size, batch, Path(a.out).with_name(f"profile_{variant}_{size}x{batch}.txt"))
        del pipe
        gc.collect()  # the next variant's memory baseline must not include this one (reference cycles)
        if a.device == "cuda":
            torch.cuda.empty_cache()


def kernels(a) -> None:
    """The GELU + input quantize before the fp8 GEMMs that read a GELU, at 1024² batch 1: Inductor's fused kernel
    (torch.compile of kernels/gelu_quantize.reference, as the compiled model fused it) against ours
    (kernels/triton_gelu_quantize.py) in its default tiles, other tiles, and with libdevice's tanh."""
    from fluxtrt.kernels import gelu_quantize
    from fluxtrt.kernels.triton_gelu_quantize import launch

    geo = resolve_model(a.model).geometry
    dim, text = geo.transformer_dim, geo.t5_length
    tokens = (a.size // (2 * geo.vae_scale_factor)) ** 2
    cases = {"single block proj_out": (tokens + text, dim, 4 * dim), "ff.net.2": (tokens, 0, 4 * dim),
             "ff_context.net.2": (text, 0, 4 * dim)}
    tiles = [(16, 512, 4), (8, 1024, 4), (32, 256, 4), (16, 1024, 8), (64, 128, 4), (4, 2048, 8)]
    inductor = torch.compile(gelu_quantize.reference, fullgraph=True, dynamic=False)

    from fp8_attention_bench import timed  # scripts/: median ms of a call (CUDA events; the host clock on a CPU)

    reps = 50 if a.device == "cuda" else 2  # a CPU rehearses in Triton's interpreter
    rows = []
    for case, (n, na, nm) in cases.items():
        wide = torch.randn(1, n, dim * 3 + nm, device=a.device, dtype=torch.bfloat16) * 2  # a joined GEMM's output
        m = wide[..., dim * 3:]
        x = torch.randn(1, n, na, device=a.device, dtype=torch.bfloat16) * 2 if na else None
        scale = torch.tensor(float(gelu_quantize.gelu_tanh(m).abs().max()) / 448, device=a.device)
        want = gelu_quantize.reference(m, scale, x).reshape(n, na + nm)
        moved = n * (na + nm) * 3  # bf16 read, E4M3 written
        variants = {"inductor": partial(inductor, m, scale, x)}
        for r, c, w in tiles:
            variants[f"triton {r}x{c} w{w}"] = partial(launch, m, scale, x, block_r=r, block_c=c, num_warps=w)
        if a.device == "cuda":  # (the interpreter has no libdevice)
            variants["triton default, libdevice tanh"] = partial(launch, m, scale, x, exact_tanh=True)
        variants["triton default, x * (1/sx)"] = partial(launch, m, scale, x, reciprocal=True)
        for name, fn in variants.items():
            got = fn().reshape(n, na + nm)
            row = {"case": case, "rows": n, "na": na, "nm": nm, "kernel": name, "us": round(timed(fn, reps) * 1000, 2),
                   "codes_differing": float((got.view(torch.uint8) != want.view(torch.uint8)).float().mean())}
            row["TB_s"] = round(moved / row["us"] / 1e6, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (Triton's interpreter)"
    write(a.out, {"meta": {"device": device, "torch": torch.__version__, "size": a.size,
                           "date": time.strftime("%Y-%m-%d")}, "rows": rows})


def profile(pipe, size: int, batch: int, path: Path) -> None:
    """Device time by kernel over a 2-step generation (after the measured runs: nothing is compiled here)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        pipe.generate(["a photo of a cat"] * batch, size, size, 2, seed=3)
    table = p.key_averages().table(sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total",
                                   row_limit=-1, max_name_column_width=160)  # every kernel, whole names
    path.write_text(table)
    print(table[:6000], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["accuracy", "speed", "lora", "kernels"])
    ap.add_argument("--model", default="random:flux.1-dev")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=1024, help="accuracy: image size of the one call")
    ap.add_argument("--shapes", default="1024x1", help="speed: SIZExBATCH, comma-separated")
    ap.add_argument("--variants", default="diffusers,diffusers-compiled,bf16,fp8")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--work", default="/tmp/fast-torch", help="speed: calibration cache root")
    ap.add_argument("--profile", default="", help="speed: this variant's kernels over 2 steps, after its runs")
    ap.add_argument("--lora-rank", type=int, default=32, help="lora, and speed's +lora: the random LoRA's rank")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    {"accuracy": accuracy, "speed": speed, "lora": lora, "kernels": kernels}[a.phase](a)


if __name__ == "__main__":
    main()
