"""diffusers' FluxPipeline baseline with torch.compile(transformer) at several sizes and batches, on a GPU:
per transformer step (CUDA events) and end to end, median of --runs after one warm-up (which compiles).
Usage: python3 scripts/diffusers_compile_baseline.py --model random:flux.1-dev --shapes 512x1,512x4,1024x4 --json OUT"""

import argparse
import json
import time

import torch

from fluxtrt.bench import bench_diffusers, to_json
from fluxtrt.models.source import resolve_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:flux.1-dev")
    ap.add_argument("--shapes", default="512x1,512x4,1024x4", help="SIZExBATCH, comma-separated")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    src = resolve_model(a.model)
    pipe = src.load_pipeline(torch.bfloat16, "cuda")
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer = torch.compile(pipe.transformer, fullgraph=False, dynamic=False)
    rows = []
    for shape in a.shapes.split(","):
        size, batch = (int(v) for v in shape.split("x"))
        t0 = time.perf_counter()
        row = bench_diffusers(pipe, src.geometry, size, size, batch, steps=a.steps, runs=a.runs, warmup=1,
                              device=torch.device("cuda"))
        row.system = "diffusers (transformer compiled)"
        rows.append(row)
        print(f"{size}x{size} b{batch}: step {row.transformer_step_s.median * 1000:.1f} ms, end to end "
              f"{row.end_to_end_s.median:.3f} s, outside transformer {100 * row.outside_transformer_share:.1f}% "
              f"(row took {time.perf_counter() - t0:.0f} s incl. compile)", flush=True)
        with open(a.json, "w") as f:  # after every row, so a cut run keeps what it measured
            json.dump(to_json(rows, {"model": a.model, "torch": torch.__version__, "steps": a.steps,
                                     "device": torch.cuda.get_device_name()}), f, indent=1, default=str)


if __name__ == "__main__":
    main()
