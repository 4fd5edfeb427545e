"""Full-size transformer graph on ONNX Runtime's CUDA provider against PyTorch on the same GPU (issue 20).

The graph is what `fluxtrt build` hands TensorRT for a bf16 checkpoint (zero-copy, graph passes on the linked
graph), run by fluxtrt's ONNX Runtime executor (IOBinding on a torch stream, bf16 as it is). The PyTorch side is
diffusers' module in bf16. So that the error means something, the same module is also computed with other
attention backends (SDPA flash / memory-efficient / math): two correct bf16 computations of the same network,
the pair to beat. Also the time per call of both (CUDA events, median of 5, after 2 warm-up calls).

    python3 scripts/ort_gpu_fullsize.py --model CHECKPOINT --work DIR --json OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def rel(a, b) -> dict:
    d = (a.float() - b.float()).abs()
    return {"max": float(d.max() / b.float().abs().max()), "mean": float(d.mean() / b.float().abs().mean())}


def timed(fn, reps=5, warm=2) -> float:
    import torch

    for _ in range(warm):
        fn()
    ms = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ms.append(s.elapsed_time(e))
    return statistics.median(ms)


def main() -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.fileio import sha256_file
    from fluxtrt.models.source import resolve_model
    from fluxtrt.records import ComponentEntry
    from fluxtrt.runtime.executors import OnnxRuntimeExecutor
    from fluxtrt.stages.build import ensure_onnx

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    out = args.json.open("a")

    def emit(rec):
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n")
        out.flush()

    src = resolve_model(args.model)
    geo = src.geometry
    spec = specs_for(geo, ["transformer"])["transformer"]
    t0 = time.perf_counter()
    onnx_path, _ = ensure_onnx(src, "transformer", "bf16", args.work, validate=False)
    emit({"step": "export", "seconds": round(time.perf_counter() - t0, 1), "onnx": str(onnx_path)})
    entry = ComponentEntry(engine="", sha256="", bytes=0, precision="bf16", onnx=str(onnx_path),
                           onnx_sha256=sha256_file(onnx_path), build_key="", layers=0, inputs=[], outputs=[], profile={})
    stream = torch.cuda.Stream()
    ex = OnnxRuntimeExecutor("transformer", entry, onnx_path, spec, geo, "cuda")
    ex.stream = stream
    t0 = time.perf_counter()
    ex.activate()
    emit({"step": "ort-session", "seconds": round(time.perf_counter() - t0, 1),
          "providers": ex.session.get_providers(), "gpu_gb": round(torch.cuda.memory_reserved() / 1e9, 1)})
    t0 = time.perf_counter()
    module = spec.wrap(src.load_component(spec.subfolder, torch.bfloat16, "cuda")).eval()
    emit({"step": "torch-module", "seconds": round(time.perf_counter() - t0, 1)})
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH}
    for point, seed in ((ShapePoint(1, 1024, 1024), 1), (ShapePoint(2, 512, 768), 2)):
        feeds = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).cuda()
                 for k, v in spec.sample_inputs(point, geo, seed).items()}
        torch_args = [feeds[t.name] for t in spec.inputs]
        with torch.cuda.stream(stream):
            got = ex.infer(feeds)["noise_pred"]
        torch.cuda.synchronize()
        refs = {}
        with torch.inference_mode():
            for name, b in backends.items():
                with sdpa_kernel([b]):
                    refs[name] = module(*torch_args)
        torch.cuda.synchronize()
        pair = {f"{n}_vs_flash": rel(refs[n], refs["flash"]) for n in ("efficient", "math")}
        onnx_err = rel(got, refs["flash"])
        worst_pair = max(p["max"] for p in pair.values())

        def ort_call(feeds=feeds):
            with torch.cuda.stream(stream):
                ex.infer(feeds)
            torch.cuda.current_stream().wait_stream(stream)

        def torch_call(torch_args=torch_args):
            with torch.inference_mode():
                module(*torch_args)

        emit({"step": "compare", "batch": point.batch, "height": point.height, "width": point.width,
              "onnx_bf16_ort_cuda_vs_torch_flash": onnx_err, **pair,
              "ratio_max": round(onnx_err["max"] / worst_pair, 2),
              "ort_cuda_ms": round(timed(ort_call), 1), "torch_eager_ms": round(timed(torch_call), 1),
              "output_abs_max": float(refs["flash"].float().abs().max())})


if __name__ == "__main__":
    main()
