"""Build one engine straight from one ONNX file (e.g. a zero-copy export) with TensorRT-RTX, for a GPU
config's compute capability and shape range, streaming the plan to disk.

  python3 scripts/build_onnx_engine.py --model MODEL --component transformer --onnx zc/transformer.onnx \
      --gpu 4090 --out transformer.engine

This is the build stage alone; `fluxtrt build` runs the whole pipeline (export, optimize, quantize, build)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--component", default="transformer")
    ap.add_argument("--onnx", type=Path, required=True)
    ap.add_argument("--gpu", default="4090")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from fluxtrt.components import specs_for
    from fluxtrt.core.backends import get_backend
    from fluxtrt.engine.build import build_engine
    from fluxtrt.gpus import load_gpu
    from fluxtrt.models.source import resolve_model

    src = resolve_model(args.model)
    cfg = load_gpu(args.gpu)
    spec = specs_for(src.geometry, [args.component])[args.component]
    backend = get_backend(cfg.backend)
    t0 = time.perf_counter()
    built = build_engine(backend, args.onnx, spec, src.geometry, cfg.shape_range(), compute_capability=cfg.compute_capability,
                         engine_path=args.out)
    seconds = time.perf_counter() - t0
    print(f"{backend.name} {backend.version}: {spec.name} for sm{cfg.compute_capability.replace('.', '')}, "
          f"{built.layers} layers, {built.bytes / 1e9:.2f} GB, built in {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
