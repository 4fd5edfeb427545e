"""Write the real full-size FLUX.1 architecture with random weights as a diffusers folder with sharded
safetensors (what a downloaded FLUX.1-dev folder looks like), for measuring export/build at true scale.

  python3 scripts/write_random_checkpoint.py --model random:flux.1-dev --out /data/flux-random \
      --components transformer --dtype bf16 --device cuda

Components not written keep only their config (enough to export the written ones). Images are noise.

--layout-only writes each shard's safetensors header and leaves its data a sparse, all-zero hole: the files
have the real names, dtypes, shapes and offsets but take no disk space, which is enough to measure a
zero-copy export (and its relinking) at full size on a small machine. Nothing can be validated or built
meaningfully from it."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:flux.1-dev", choices=["random:flux.1-dev", "random:flux.1-schnell"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--components", default="transformer", help="comma list of diffusers subfolders to write")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--device", default="cpu", help="where to draw the random weights (cuda is much faster)")
    ap.add_argument("--shard", default="5GB", help="max shard size, as diffusers' save_pretrained takes it")
    ap.add_argument("--layout-only", action="store_true", help="headers + sparse zero data (see above)")
    ap.add_argument("--linear-std", type=float, default=None,
                    help="redraw every Linear layer's weights N(0, STD) (0.005: the full-size transformer is not "
                    "chaotic, so runs that differ in rounding stay comparable; the default init is)")
    args = ap.parse_args()

    from fluxtrt.dtypes import torch_dtype
    from fluxtrt.models.random_arch import MARKER
    from fluxtrt.models.source import resolve_model

    src = resolve_model(args.model)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose a new folder")
    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src.path, tmp, ignore=shutil.ignore_patterns(MARKER))
    for sub in args.components.split(","):
        t0 = time.perf_counter()
        if args.layout_only:
            write_layout(src.path, sub, tmp / sub, args.dtype, int(args.shard.rstrip("GB")) * 10**9)
            print(f"{sub}: layout written in {time.perf_counter() - t0:.1f} s", flush=True)
            continue
        model = src.load_component(sub, torch_dtype(args.dtype), args.device)
        if args.linear_std is not None:
            redraw_linears(model, args.linear_std)
        model.to("cpu").save_pretrained(tmp / sub, max_shard_size=args.shard, safe_serialization=True)
        n = sum(p.numel() for p in model.parameters())
        del model
        print(f"{sub}: {n / 1e9:.2f} B parameters written in {time.perf_counter() - t0:.1f} s", flush=True)
    tmp.rename(args.out)


def redraw_linears(model, std: float) -> None:
    """Every nn.Linear's weight and bias drawn N(0, std), seeded (the same folder for the same arguments)."""
    import torch

    g = torch.Generator(next(model.parameters()).device).manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                for p in (m.weight, m.bias):
                    if p is not None:
                        p.copy_(torch.randn(p.shape, generator=g, device=p.device) * std)


def write_layout(folder: Path, sub: str, out: Path, dtype: str, shard_bytes: int) -> None:
    """Safetensors shards holding only headers (the data a sparse hole), from the component built on `meta`."""
    import json
    import struct

    from fluxtrt.dtypes import torch_dtype
    from fluxtrt.export.zerocopy import empty_component

    model, _ = empty_component(folder, sub, torch_dtype(dtype))
    code = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}[dtype]
    shards, current, size = [], {}, 0
    for key, t in model.state_dict().items():
        n = t.numel() * t.element_size()
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = (list(t.shape), n)
        size += n
    shards.append(current)
    for i, tensors in enumerate(shards, 1):
        header, offset = {}, 0
        for key, (shape, n) in tensors.items():
            header[key] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path = out / f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)


if __name__ == "__main__":
    main()
