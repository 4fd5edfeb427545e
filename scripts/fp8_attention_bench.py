"""The fp8-attn attention kernel alone against cuDNN bf16 attention at FLUX's shapes (issue: past 2x on the H200).

For B in --batches and tokens in --tokens (image + 512 text), 24 heads, d 128, random N(0, 1) q, k, v (RMSNorm'd
q and k are of that order): torch's SDPA in bf16 (cuDNN where torch picks it, the baseline), the Triton FP8 kernel
on ready E4M3 operands for each launch configuration in --configs (block_m/block_n/warps/stages), and the chosen
one with its operands' quantization included (what the processor runs per attention). Each timed with CUDA events
(median of --reps after warm-up); mean relative error of each against fp32 attention beside the recipe's own
(fp8.attention_recipe) on a slice; then cuDNN's FP8 flash attention on the same operands where the `cudnn` module
is here (carry the nvidia-cudnn-frontend wheel), and FlashInfer's FP8 prefill (FA3 template) where `flashinfer` is
(alone, with quantization eager and compiled, error vs fp32 and vs its arithmetic). Rows to --out as JSON after each measurement.
Device:  python3 scripts/fp8_attention_bench.py --out $OUT/fp8_attention.json
         (FlashInfer there: `bash scripts/carry_flashinfer.sh` here first, carry .whl; its kernel JIT-compiles on
         the first call, about a minute on 16 cores: its sources compiled here with nvcc 13.0 for sm_90a)
Rehearse here (CPU, Triton's interpreter; timings meaningless):
         TRITON_INTERPRET=1 python3 scripts/fp8_attention_bench.py --batches 1 --tokens 192 --heads 2 --reps 1 \
           --configs 64/64/4/1 --out /tmp/fa.json"""

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

from fluxtrt import fp8
from fluxtrt.kernels import fp8_attention


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() (CUDA events on a GPU, the host clock elsewhere)."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def shape_row(a, dev: str, b: int, s: int) -> dict:
    """One shape's row: SDPA bf16, the kernel per launch configuration, the best with its quantization, errors."""
    g = torch.Generator(dev).manual_seed(b * 10000 + s)
    q, k, v = (torch.randn(b, s, a.heads, a.dim, generator=g, device=dev).bfloat16() for _ in range(3))
    c = float(fp8.sdpa_root_scale(a.dim))
    t = (1, 2)
    # the recipe's scales as calibration takes them (P's from the first 256 queries)
    p = (q[:, :256].transpose(*t).float() @ k.transpose(*t).float().transpose(-1, -2) * c * c).softmax(-1)
    scales = tuple(fp8.activation_scale(float(x.abs().max())) for x in
                   (q.float() * c, k.float() * c, p, v.float()))
    flops = 4 * b * a.heads * s * s * a.dim
    row = {"batch": b, "tokens": s, "heads": a.heads, "dim": a.dim}
    row["sdpa_bf16_ms"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(*t), k.transpose(*t), v.transpose(*t)), a.reps)
    n = min(s, 512)  # accuracy on the first n queries against fp32 attention
    qs, ks, vs = (x.transpose(*t).float() for x in (q, k, v))
    exact = ((qs[:, :, :n] @ ks.transpose(-1, -2)) * c * c).softmax(-1) @ vs
    rel = lambda x: float((x - exact).abs().mean() / exact.abs().mean())  # noqa: E731
    q8, k8, vt8 = fp8_attention.operands(q, k, v, scales)
    best = None
    for cfg in filter(None, a.configs.split(",")):
        bm, bn, w, st = map(int, cfg.split("/"))
        launch = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}
        try:
            ms = timed(functools.partial(fp8_attention.run, q8, k8, vt8, scales, torch.bfloat16, **launch),
                       a.reps)
        except Exception as e:  # a configuration this GPU cannot compile (shared memory): say so, go on
            row[f"kernel_{cfg}"] = f"{type(e).__name__}: {str(e)[:120]}"
            continue
        row[f"kernel_{cfg}_ms"] = ms
        if best is None or ms < best[1]:
            best = (launch, ms, cfg)
    if best is not None:
        launch, ms, cfg = best
        row.update(best_config=cfg, kernel_ms=ms, kernel_tflops=round(flops / ms / 1e9, 1),
                   speedup_vs_sdpa_bf16=round(row["sdpa_bf16_ms"] / ms, 3))
        row["with_quantize_ms"] = timed(lambda: fp8_attention.attention(q, k, v, scales, **launch), a.reps)
        row["speedup_with_quantize"] = round(row["sdpa_bf16_ms"] / row["with_quantize_ms"], 3)
        got = fp8_attention.run(q8[:, :, :n], k8, vt8, scales, torch.float32, **launch)
        recipe = fp8.attention_recipe(qs[:, :, :n], ks, vs, scales)
        row.update(kernel_rel_err=rel(got), recipe_rel_err=rel(recipe),
                   bf16_sdpa_rel_err=rel(torch.nn.functional.scaled_dot_product_attention(
                       *(x.transpose(*t)[:, :, :n] if i == 0 else x.transpose(*t)
                         for i, x in enumerate((q, k, v)))).float()))
    row.update(cudnn_fp8(q, k, v, scales, flops, row["sdpa_bf16_ms"], a.reps, n, rel))
    row.update(flashinfer_fp8(q, k, v, scales, flops, row["sdpa_bf16_ms"], a.reps, n, rel))
    return row


def cudnn_fp8(q, k, v, scales, flops, sdpa_ms, reps, n, rel) -> dict:
    """cuDNN's FP8 flash attention on the same operands (kernels/cudnn_fp8_attention.py): its time alone, with the
    operands' quantization, its error on the first n queries; or why it could not run."""
    from fluxtrt.kernels import cudnn_fp8_attention as cudnn_fa

    why = cudnn_fa.available()
    if why:
        return {"cudnn_fp8": why}
    try:
        q8, k8, v8 = fp8_attention.operands(q, k, v, scales, v_transposed=False)
        plan = cudnn_fa.plan_for(q8, k8, v8, torch.bfloat16)
        ms = timed(lambda: plan(q8, k8, v8, scales), reps)
        fp32 = cudnn_fa.Plan(q8[:, :, :n].contiguous(), k8, v8, torch.float32)
        got = fp32(q8[:, :, :n].contiguous(), k8, v8, scales)
    except Exception as e:  # what this cuDNN or frontend refuses: said in the row
        return {"cudnn_fp8": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    return {"cudnn_fp8_output": plan.output, "cudnn_fp8_ms": ms, "cudnn_fp8_tflops": round(flops / ms / 1e9, 1),
            "cudnn_fp8_vs_sdpa_bf16": round(sdpa_ms / ms, 3), "cudnn_fp8_rel_err": rel(got),
            "cudnn_fp8_with_quantize_ms": timed(lambda: cudnn_fa.attention(q, k, v, scales), reps)}


def flashinfer_fp8(q, k, v, scales, flops, sdpa_ms, reps, n, rel) -> dict:
    """FlashInfer's FP8 prefill (its FA3 template, kernels/flashinfer_fp8_attention.py) on the same operands: its time
    alone, with the operands' quantization, its error on the first n queries against fp32 attention and against
    kernel_arithmetic with its block of keys; or why it could not run."""
    from fluxtrt.kernels import flashinfer_fp8_attention as fi

    why = fi.available()
    if why:
        return {"flashinfer_fp8": why}
    try:
        ops = fi.operands(q, k, v, scales)
        t0 = time.perf_counter()
        out = fi.run(*ops, scales)  # the first call JIT-compiles the kernel (cached after)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        ms = timed(lambda: fi.run(*ops, scales), reps)
        b, s, h, d = q.shape
        got = out.view(s, b, h, d).permute(1, 2, 0, 3)[:, :, :n].float()
        t = (1, 2)
        arithmetic = fp8_attention.kernel_arithmetic(*(x.transpose(*t)[:, :, :n] if i == 0 else x.transpose(*t)
                                                       for i, x in enumerate((q, k, v))), scales,
                                                     **fi.WALK)
        vs_arithmetic = float((got - arithmetic).abs().mean() / arithmetic.abs().mean())
    except Exception as e:  # what this FlashInfer or GPU refuses: said in the row
        return {"flashinfer_fp8": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    row = {"flashinfer_fp8_first_call_s": round(first_s, 1), "flashinfer_fp8_ms": ms,
           "flashinfer_fp8_tflops": round(flops / ms / 1e9, 1), "flashinfer_fp8_vs_sdpa_bf16": round(sdpa_ms / ms, 3),
           "flashinfer_fp8_rel_err": rel(got), "flashinfer_fp8_vs_kernel_arithmetic": vs_arithmetic,
           "flashinfer_fp8_with_quantize_ms": timed(lambda: fi.attention(q, k, v, scales), reps)}
    try:
        row["flashinfer_fp8_with_quantize_compiled_ms"] = timed(functools.partial(_compiled_fi(), q, k, v, scales),
                                                                reps)
    except Exception as e:  # torch.compile refusing the op: said in the row, the eager timings kept
        row["flashinfer_fp8_compiled"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
    return row


@functools.cache
def _compiled_fi():
    """fi.attention under torch.compile: the operands' quantization fused by Inductor, the kernel a custom op."""
    from fluxtrt.kernels import flashinfer_fp8_attention as fi

    return torch.compile(fi.attention)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--tokens", default="4608,1536", help="image + text tokens (1024^2: 4096 + 512; 512^2: 1024 + 512)")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default="128/128/8/3,128/64/8/3,128/128/4/3,64/64/4/3,128/128/8/4",
                    help="the Triton kernel's launch configurations (block_m/block_n/warps/stages); \"\" for none")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "argv": sys.argv[1:],
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d")}

    def save():
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    for b in map(int, a.batches.split(",")):
        for s in map(int, a.tokens.split(",")):
            rows.append(shape_row(a, dev, b, s))
            print(json.dumps(rows[-1]), flush=True)
            save()


if __name__ == "__main__":
    main()
