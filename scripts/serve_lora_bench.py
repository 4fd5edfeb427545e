"""Per-request LoRAs on the served fp8 compiled path, against the same load without LoRAs, a diffusers server that
merges and unmerges one adapter per request, and one-at-a-time diffusers eager: all in one process, one GPU.

Rows (throughput in images per minute, p50/p95 latency) go to --out after every measurement:
  served, no LoRA        `fluxtrt serve --backend torch --calibration CAL --compile --max-batch 8 --lora-dir D`'s
                         replica (serving.Service, driven through its request handler: JSON parsing, batching, PNG
                         encoding; no HTTP or Ray), --requests requests naming no LoRA from --concurrency clients at
                         once (a call without LoRA runs the compiled base alone; --servers two: a second replica
                         without --lora-dir instead, at the cost of its start-up's compiles)
  served, LoRA each      the same replica: request i names adapter i % --loras (rank --rank each, every attention
                         projection of every block), so batches mix adapters (counted)
  diffusers merge        FluxPipeline bf16 eager, one request at a time: load_lora_weights + fuse_lora, the image,
                         unfuse_lora + unload_lora_weights (what a server without mixed batches does per request)
  diffusers eager        FluxPipeline bf16 eager, one request at a time, no LoRA (the baseline of the fast path)

Device:    python3 scripts/serve_lora_bench.py --out $OUT/serve_lora.json   (random:flux.1-dev, 512², 20 steps,
           8 concurrent, 32 requests, 8 rank-32 LoRAs; needs peft for the diffusers merge row)
Rehearse:  python3 scripts/serve_lora_bench.py --model tiny --size 256 --steps 2 --requests 4 --concurrency 2
           --loras 2 --rank 2 --no-fp8 --no-compile --out /tmp/serve_lora.json"""

import argparse
import asyncio
import gc
import json
import sys
import time
from pathlib import Path

from bench_serve import calibration_file, row  # scripts/: the serving benchmark's calibration and rows

ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
             "attn.add_v_proj", "attn.to_add_out")


def write(path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, default=str))


def write_loras(model, folder: Path, count: int, rank: int, seed: int = 0) -> list:
    """`count` random rank-`rank` LoRAs (diffusers/peft format, bf16) over every attention projection the model's
    transformer has; small factors (std 0.01) so the images stay images."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model.path / "transformer" / "config.json").read_text())
    hidden = model.geometry.transformer_dim
    layers = [f"transformer_blocks.{b}.{m}" for b in range(config["num_layers"]) for m in ATTENTION]
    layers += [f"single_transformer_blocks.{b}.{m}" for b in range(config["num_single_layers"])
               for m in ATTENTION[:3]]
    g = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        tensors = {}
        for m in layers:
            tensors[f"transformer.{m}.lora_A.weight"] = (torch.randn(rank, hidden, generator=g) * 0.01).bfloat16()
            tensors[f"transformer.{m}.lora_B.weight"] = (torch.randn(hidden, rank, generator=g) * 0.01).bfloat16()
        save_file(tensors, str(folder / f"style{i}.safetensors"))
        names.append(f"style{i}")
    return names


def served(options, a, lora_dir, loads, out) -> None:
    """One replica (serving.Service, with --lora-dir when `lora_dir`) under --concurrency clients, each of `loads`
    [(row name, adapter names: request k names names[k % len], none if empty)] sending --requests requests after
    a warm-up load of its own; each row appended to out["rows"] and written to --out as it is measured."""
    from fluxtrt.serving import Service

    t0 = time.perf_counter()
    service = Service(options, max_batch=a.concurrency, max_queue=64, size=f"{a.size}x{a.size}",
                      lora_dir=lora_dir)
    start_s = time.perf_counter() - t0

    def body(k, names):
        req = {"prompt": f"a photo of a red fox, take {k}", "size": f"{a.size}x{a.size}", "steps": a.steps,
               "seed": k}
        if names:
            req["lora"] = names[k % len(names)]
        return json.dumps(req).encode()

    async def load(count, offset, names):
        gate = asyncio.Semaphore(a.concurrency)
        lat = []

        async def one(k):
            async with gate:
                t = time.perf_counter()
                status, payload, _ = await service.generate(body(offset + k, names))
                if status != 200:
                    raise SystemExit(f"request {k}: {status} {payload}")
                lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        await asyncio.gather(*(one(k) for k in range(count)))
        return lat, time.perf_counter() - t

    try:
        for name, names in loads:
            asyncio.run(load(a.concurrency, 10_000, names))  # warm-up: every adapter's first load, the shapes
            s = service.batcher.stats
            before = (s.lora_calls, s.mixed_lora_calls, s.steps_run)
            lat, wall = asyncio.run(load(a.requests, 0, names))
            out["rows"].append({**row(name, a.size, a.concurrency, 1, lat, wall), "start_s": round(start_s, 1),
                                "transformer_calls": s.steps_run - before[2], "lora_calls": s.lora_calls - before[0],
                                "mixed_lora_calls": s.mixed_lora_calls - before[1]})
            print(json.dumps(out["rows"][-1]), flush=True)
            write(a.out, out)
    finally:
        service.close()


def diffusers_rows(model, a, folder, names, device) -> list:
    import torch

    pipe = model.load_pipeline(torch.bfloat16 if device == "cuda" else torch.float32, device)
    pipe.set_progress_bar_config(disable=True)

    def image(k):
        pipe(prompt=f"a photo of a red fox, take {k}", height=a.size, width=a.size, num_inference_steps=a.steps,
             generator=torch.Generator().manual_seed(k), output_type="np")
        if device == "cuda":
            torch.cuda.synchronize()

    def merged(k):
        pipe.load_lora_weights(str(folder / f"{names[k % len(names)]}.safetensors"), adapter_name="req")
        pipe.fuse_lora()
        image(k)
        pipe.unfuse_lora()
        pipe.unload_lora_weights()

    rows = []
    for kind, fn in (("diffusers eager, one at a time", image),
                     ("diffusers eager, merge + unmerge one LoRA per request", merged)):
        fn(10_000)  # warm-up
        lat, t0 = [], time.perf_counter()
        for k in range(a.requests):
            t = time.perf_counter()
            fn(k)
            lat.append(time.perf_counter() - t)
        rows.append(row(kind, a.size, 1, 1, lat, time.perf_counter() - t0))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:flux.1-dev")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--servers", choices=("one", "two"), default="one",
                    help="one: the no-LoRA load on the --lora-dir server (a call without LoRA runs the base alone: "
                         "bank.on is off); two: a separate server without --lora-dir (a second start-up)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--loras", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--work", default="/tmp/serve-lora")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch

    from fluxtrt.models.source import resolve_model
    from fluxtrt.runtime.options import PipelineOptions

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = resolve_model(a.model)
    folder = Path(a.work) / "loras"
    names = write_loras(model, folder, a.loras, a.rank)
    out = {"meta": {"argv": sys.argv[1:], "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}, "rows": []}
    options = PipelineOptions(model=a.model, backend="torch", compile=a.compile,
                              torch_dtype="bf16" if device == "cuda" else "fp32",
                              calibration=Path(calibration_file(a.model, a.work)) if a.fp8 else None).check()
    plain, mixed = ("fluxtrt serve, no LoRA", []), ("fluxtrt serve, LoRA per request", names)
    if a.servers == "one":  # requests without LoRA on the LoRA server: the same compiled base, one start-up
        served(options, a, folder, [plain, mixed], out)
    else:  # a server without --lora-dir, then one with it (two start-ups' compiles)
        for lora_dir, load in ((None, plain), (folder, mixed)):
            served(options, a, lora_dir, [load], out)
            gc.collect()  # the replica's pipeline freed before the next
    if device == "cuda":
        torch.cuda.empty_cache()
    out["rows"] += diffusers_rows(model, a, folder, names, device)
    by = {r["system"]: r["images_per_min"] for r in out["rows"]}
    lora = by["fluxtrt serve, LoRA per request"]
    out["ratios"] = {"lora_vs_no_lora": round(lora / by["fluxtrt serve, no LoRA"], 3),
                     "lora_vs_diffusers_merge": round(lora / by["diffusers eager, merge + unmerge one LoRA per request"], 3),
                     "served_vs_diffusers_eager": round(by["fluxtrt serve, no LoRA"] / by["diffusers eager, one at a time"], 3)}
    print(json.dumps(out["ratios"]), flush=True)
    write(a.out, out)


if __name__ == "__main__":
    main()
