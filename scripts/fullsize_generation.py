"""One whole generation through `fluxtrt run`'s pipeline on ONNX Runtime against diffusers' FluxPipeline, step by
step (issue 20, item 3): per-step latent error, the image difference, and as the yardstick diffusers against
itself with another attention kernel (SDPA's math kernel vs its default), all in the same dtype on one GPU.

  python3 scripts/fullsize_generation.py --engines BUILD/4090 --model FOLDER --provider cuda \
      --size 1024 --steps 28 --dtype bf16 --json OUT/generation.jsonl --image OUT/generation

On a CPU with the tiny model (a check of this script): --provider cpu --device cpu --dtype fp32 --size 256.
Random weights make the images noise; the numbers are what the comparison is about."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def diffusers_run(src, prompt, size, steps, seed, dtype, device, math: bool):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pipe = src.load_pipeline(dtype, device)
    latents = []

    def keep(p, i, t, kw):
        latents.append(kw["latents"].float().cpu())
        return {}

    import contextlib

    with sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext():
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        img = pipe([prompt], height=size, width=size, num_inference_steps=steps, guidance_scale=3.5,
                   max_sequence_length=src.geometry.t5_length, generator=torch.Generator().manual_seed(seed),
                   output_type="np", callback_on_step_end=keep).images
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del pipe
    if device == "cuda":
        torch.cuda.empty_cache()
    return (img * 255).round().astype("uint8"), latents, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=Path, help="a `fluxtrt build` GPU folder (its ONNX is run)")
    ap.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch"],
                    help="torch: fluxtrt's pipeline over the PyTorch modules of --model (no --engines)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--provider", default="cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--prompt", default="a red fox in the snow")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--image", type=Path, help="write PNGs with this prefix")
    args = ap.parse_args()

    import numpy as np

    from fluxtrt.dtypes import torch_dtype
    from fluxtrt.models.source import resolve_model
    from fluxtrt.runtime.assembly import open_pipeline
    from fluxtrt.validate import relative_errors

    src = resolve_model(args.model)
    dtype = torch_dtype(args.dtype)
    ref, ref_lat, ref_s = diffusers_run(src, args.prompt, args.size, args.steps, args.seed, dtype, args.device, False)
    alt, alt_lat, alt_s = diffusers_run(src, args.prompt, args.size, args.steps, args.seed, dtype, args.device, True)
    t0 = time.perf_counter()
    if args.backend == "torch":
        pipe = open_pipeline(None, backend="torch", model=src, torch_dtype=args.dtype, device=args.device)
    else:
        pipe = open_pipeline(args.engines, backend="onnxruntime", ort_provider=args.provider, torch_dtype=args.dtype,
                           device=args.device)
    load_s = time.perf_counter() - t0
    res = pipe.generate([args.prompt], args.size, args.size, args.steps, 3.5, seed=args.seed, trace=True)
    res = pipe.generate([args.prompt], args.size, args.size, args.steps, 3.5, seed=args.seed, trace=True)  # warm
    rows = []
    for i, (ours, r, a) in enumerate(zip(res.latents_per_step, ref_lat, alt_lat)):
        err, mean = relative_errors(ours.float().cpu(), r)
        pair, pair_mean = relative_errors(a, r)
        rows.append({"step": i + 1, "error": err, "mean_error": mean, "reference": pair, "reference_mean": pair_mean})
    img_err = np.abs(res.images.astype(int) - ref.astype(int))
    img_pair = np.abs(alt.astype(int) - ref.astype(int))
    summary = {"size": args.size, "steps": args.steps, "dtype": args.dtype, "backend": args.backend,
               "provider": args.provider if args.backend == "onnxruntime" else None,
               "precisions": {n: e.precision for n, e in pipe.manifest.components.items()} if pipe.manifest else None,
               "image_max_diff": int(img_err.max()), "image_mean_diff": float(img_err.mean()),
               "reference_image_max_diff": int(img_pair.max()), "reference_image_mean_diff": float(img_pair.mean()),
               "diffusers_s": ref_s, "diffusers_math_s": alt_s, "fluxtrt_load_s": load_s,
               "fluxtrt_timings": {k: v for k, v in vars(res.timings).items()} if hasattr(res, "timings") else None}
    text = "".join(json.dumps(r) + "\n" for r in rows) + json.dumps(summary, default=str) + "\n"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(text)
    print(text, end="")
    if args.image is not None:
        from PIL import Image

        for tag, im in (("fluxtrt", res.images[0]), ("diffusers", ref[0])):
            Image.fromarray(im).save(f"{args.image}-{tag}.png")


if __name__ == "__main__":
    main()
