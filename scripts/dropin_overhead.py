"""What the drop-in modules cost (issue: drop-in for diffusers): the same diffusers pipeline call, end to end, with
its own PyTorch modules and with fluxtrt.dropin's engine-backed modules on the torch executor, interleaved in one
process (median of --runs after one warm-up each). Writes a JSON row per size to --out.

Device:   python3 scripts/dropin_overhead.py --out $OUT/dropin.json
Rehearse: python3 scripts/dropin_overhead.py --model tiny --device cpu --size 256 --steps 2 --out /tmp/d.json"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fluxtrt.dropin import load_pipeline
from fluxtrt.models.source import resolve_model


def timed(pipe, a, dev) -> float:
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    pipe("a photo of a lighthouse at dusk", height=a.size, width=a.size, num_inference_steps=a.steps,
         generator=torch.Generator().manual_seed(0), output_type="np")
    if dev == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:flux.1-dev")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    src = resolve_model(a.model)
    dtype = "bf16" if a.device == "cuda" else "fp32"
    ref = src.load_pipeline(torch.bfloat16 if dtype == "bf16" else torch.float32, a.device)
    ours = load_pipeline(model=a.model, backend="torch", torch_dtype=dtype)
    for p in (ref, ours):
        p.set_progress_bar_config(disable=True)
        timed(p, a, a.device)  # warm-up
    times = {"diffusers modules": [], "fluxtrt.dropin modules (torch executor)": []}
    for _ in range(a.runs):  # interleaved: drift hits both alike
        for t, p in zip(times.values(), (ref, ours)):
            t.append(timed(p, a, a.device))
    base, mine = (statistics.median(v) for v in times.values())
    row = {"size": a.size, "steps": a.steps, "runs": a.runs, "model": a.model, "dtype": dtype,
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "e2e_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
           "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
           "overhead": round(mine / base - 1, 4), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(row, indent=1), flush=True)
    Path(a.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
