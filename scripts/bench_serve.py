"""Serving throughput and latency of `fluxtrt serve` on a CUDA machine, against one-at-a-time generation in the
same run (the library's `Pipeline.generate`, no server, no batching).

For each replica count: start `fluxtrt serve` (PyTorch executor on the chosen model), warm it up, then for every
size and concurrency send `--requests` requests from that many client threads over loopback HTTP: images per
minute (requests / wall time) and p50 / p95 client latency. Writes JSON rows and prints a table.

  python3 scripts/bench_serve.py --model random:flux.1-dev --sizes 512,1024 --concurrency 1,4,8 --out serve.json
  python3 scripts/bench_serve.py --replicas 1,2 --sizes 512 --concurrency 8 --no-baseline --out replicas.json
The fast path (issue 32): `--fp8 --compile` serves the fp8 recipe compiled (`fluxtrt serve --backend torch
--calibration FILE --compile`, the calibration made here as `fluxtrt calibrate` makes it), and `--baseline
diffusers` measures one-at-a-time diffusers eager (FluxPipeline) instead of Pipeline.generate:
  python3 scripts/bench_serve.py --sizes 512 --requests 16 --concurrency 8 --fp8 --compile --baseline diffusers \
      --out serve_fp8.json
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def post(url, body, timeout=900):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - t0


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def row(kind, size, concurrency, replicas, latencies, wall):
    return {"system": kind, "size": size, "concurrency": concurrency, "replicas": replicas,
            "requests": len(latencies), "images_per_min": round(60 * len(latencies) / wall, 3),
            "p50_s": round(statistics.median(latencies), 3), "p95_s": round(percentile(latencies, 0.95), 3),
            "wall_s": round(wall, 3)}


def sequential(model, sizes, counts, steps, baseline="pipeline"):
    import torch

    from fluxtrt.models.source import resolve_model
    from fluxtrt.runtime.assembly import open_pipeline

    src = resolve_model(model)
    if baseline == "diffusers":
        dpipe = src.load_pipeline(torch.bfloat16, "cuda")
        dpipe.set_progress_bar_config(disable=True)

        def generate(prompt, size, seed):
            dpipe(prompt=prompt, height=size, width=size, num_inference_steps=steps,
                  generator=torch.Generator().manual_seed(seed), output_type="np")
            torch.cuda.synchronize()
        kind = "sequential (diffusers eager bf16)"
    else:
        pipe = open_pipeline(None, backend="torch", model=src)

        def generate(prompt, size, seed):
            pipe.generate([prompt], size, size, steps, seed=seed)
        kind = "sequential (Pipeline.generate)"
    rows = []
    for size, n in zip(sizes, counts):
        generate("warm up", size, 0)
        lat, t0 = [], time.perf_counter()
        for k in range(n):
            t = time.perf_counter()
            generate(f"a photo of a red fox, take {k}", size, k)
            lat.append(time.perf_counter() - t)
        rows.append(row(kind, size, 1, 1, lat, time.perf_counter() - t0))
        print(rows[-1], flush=True)
    torch.cuda.empty_cache()
    return rows


def calibration_file(model: str, work: str) -> str:
    """What `fluxtrt calibrate` writes for a bf16 checkpoint (module ranges; 1 prompt, 1 step: scales do not
    change speed), for `--calibration`; on the GPU when there is one (a CPU rehearses it on tiny)."""
    from pathlib import Path

    import torch

    from fluxtrt.models.source import resolve_model
    from fluxtrt.quantize.calibration import calibrate_modules

    return str(calibrate_modules(resolve_model(model), "fp8", Path(work) / "calibration", None, 1, steps=1,
                                 opt_resolution=512, dtype="bf16",
                                 device="cuda" if torch.cuda.is_available() else "cpu").path)


def serve(model, replicas, max_batch, sizes, counts, concurrencies, steps, extra=(), partial=None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/images/generations"
    proc = subprocess.Popen([sys.executable, "-m", "fluxtrt.cli", "serve", "--backend", "torch", "--model", model,
                             "--port", str(port), "--replicas", str(replicas), "--max-batch", str(max_batch),
                             *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    t_start = time.perf_counter()
    for line in proc.stdout:
        if "serving on" in line:
            break
    else:
        raise SystemExit(f"fluxtrt serve exited with {proc.wait()}")
    threading.Thread(target=lambda: [print("  serve:", x, end="", flush=True) for x in proc.stdout], daemon=True).start()
    print(f"server up with {replicas} replica(s) in {time.perf_counter() - t_start:.1f} s", flush=True)
    rows = []
    try:
        for size, n in zip(sizes, counts):
            warm = [{"prompt": "warm up", "size": f"{size}x{size}", "steps": steps, "seed": k}
                    for k in range(max(concurrencies) * replicas)]
            with ThreadPoolExecutor(max(concurrencies)) as pool:  # every replica, every batch size seen once
                list(pool.map(lambda b: post(url, b), warm))
            for c in concurrencies:
                bodies = [{"prompt": f"a photo of a red fox, take {k}", "size": f"{size}x{size}", "steps": steps,
                           "seed": k} for k in range(n)]
                t0 = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    lat = list(pool.map(lambda b: post(url, b), bodies))
                label = "fluxtrt serve" + (" fp8" if "--calibration" in extra else "") + (
                    " compiled" if "--compile" in extra else "")
                rows.append(row(label, size, c, replicas, lat, time.perf_counter() - t0))
                print(rows[-1], flush=True)
                if partial:
                    partial(rows)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:flux.1-dev")
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--requests", default="16,8", help="requests per size (per concurrency level)")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--replicas", default="1")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--baseline", choices=["pipeline", "diffusers"], default="pipeline")
    ap.add_argument("--fp8", action="store_true", help="serve the fp8 recipe (a calibration made first)")
    ap.add_argument("--compile", action="store_true", help="serve --compile (each batch size compiled at start)")
    ap.add_argument("--work", default="/tmp/bench-serve")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    sizes, counts, conc = ints(a.sizes), ints(a.requests), ints(a.concurrency)
    if a.compile and len(sizes) > 1:
        raise SystemExit("--compile compiles the server for one size (its --size): give one --sizes")
    extra = (["--calibration", calibration_file(a.model, a.work)] if a.fp8 else []) + (
        ["--compile", "--size", f"{sizes[0]}x{sizes[0]}"] if a.compile else [])
    rows = [] if a.no_baseline else sequential(a.model, sizes, counts, a.steps, a.baseline)

    def partial(more):  # a run cut short keeps what it measured
        with open(a.out, "w") as f:
            json.dump({"meta": {"partial": True}, "rows": rows + more}, f, indent=1)

    partial([])
    for r in ints(a.replicas):
        rows += serve(a.model, r, a.max_batch, sizes, counts, conc, a.steps, extra, partial)
    base = {(x["size"]): x["images_per_min"] for x in rows if x["system"].startswith("sequential")}
    one = {(x["size"], x["concurrency"]): x["images_per_min"] for x in rows if x.get("replicas") == 1
           and x["system"].startswith("fluxtrt serve")}
    for x in rows:
        if x["size"] in base:
            x["ratio_vs_sequential"] = round(x["images_per_min"] / base[x["size"]], 3)
        if x["system"].startswith("fluxtrt serve") and (x["size"], x["concurrency"]) in one:
            x["ratio_vs_one_replica"] = round(x["images_per_min"] / one[(x["size"], x["concurrency"])], 3)
    import torch

    meta = {"model": a.model, "steps": a.steps, "max_batch": a.max_batch, "device": torch.cuda.get_device_name(),
            "gpus": torch.cuda.device_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{'system':36} {'size':>5} {'conc':>4} {'repl':>4} {'img/min':>8} {'p50 s':>7} {'p95 s':>7} {'vs seq':>7}")
    for x in rows:
        print(f"{x['system']:36} {x['size']:>5} {x['concurrency']:>4} {x['replicas']:>4} {x['images_per_min']:>8} "
              f"{x['p50_s']:>7} {x['p95_s']:>7} {x.get('ratio_vs_sequential', ''):>7}")


if __name__ == "__main__":
    main()
