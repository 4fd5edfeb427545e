"""First-Block Cache on the torch executor (issue: step caching), one process:

1. bf16 eager, uncached: the baseline (end to end, median of --runs);
2. the same with --cache-threshold at each of --thresholds: end to end and the steps skipped;
3. the parts' own times (head, tail, out; CUDA events, median of 5): what a skipped step costs;
4. fp8 compiled (the fast path; scales from one calibration call of this very model) through the parts: every
   step computed (threshold 1e-9) against the threshold of --fp8-threshold.

The transformer's linear weights are redrawn N(0, 0.005) (with the class's default initialisation nothing is
skipped below T = 0.3); rows go to --out after every measurement.

Device:   python3 scripts/fbcache_bench.py --out $OUT/fbcache.json
Rehearse: python3 scripts/fbcache_bench.py --model tiny --device cpu --size 256 --steps 6 --runs 1 \\
              --thresholds 0.5,1.2 --fp8-threshold 0.5 --no-compile --out /tmp/fb.json"""

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from fluxtrt.components import transformer_parts
from fluxtrt.models.source import resolve_model
from fluxtrt.runtime.assembly import open_pipeline

PROMPT = "a photo of a lighthouse on a rocky coast at dusk"


def redraw(load):
    """src.load_component with the transformer's linear weights and biases redrawn N(0, 0.005), seeded."""
    def load_component(sub, dtype, device):
        module = load(sub, dtype, device)
        if sub == "transformer":
            g = torch.Generator(device).manual_seed(1)
            with torch.no_grad():
                for m in module.modules():
                    if isinstance(m, torch.nn.Linear):
                        m.weight.copy_(torch.randn(m.weight.shape, generator=g, device=device) * 0.005)
                        if m.bias is not None:
                            m.bias.copy_(torch.randn(m.bias.shape, generator=g, device=device) * 0.005)
        return module
    return load_component


def e2e(pipe, a, threshold, runs) -> dict:
    times, cache = [], None
    for k in range(runs):
        res = pipe.generate([PROMPT], a.size, a.size, a.steps, 3.5, seed=k, cache_threshold=threshold)
        times.append(res.timings.total)
        cache = res.timings.cache
    return {"e2e_s": round(statistics.median(times), 4), "cache": cache}


def part_times(pipe, a) -> dict:
    """Median ms of each part at this size (CUDA events on the GPU, the clock on a CPU)."""
    dev = pipe.device
    ex, parts = pipe.executors["transformer"], transformer_parts(pipe.geo)
    from fluxtrt.components import ShapePoint

    feeds = {k: v.to(dev) for k, v in parts["transformer_head"].sample_inputs(ShapePoint(1, a.size, a.size),
                                                                              pipe.geo, 0).items()}
    head = ex.infer_part(parts["transformer_head"], feeds)
    calls = {"head": lambda: ex.infer_part(parts["transformer_head"], feeds),
             "tail": lambda: ex.infer_part(parts["transformer_tail"], dict(head, img_ids=feeds["img_ids"],
                                                                             txt_ids=feeds["txt_ids"])),
             "out": lambda: ex.infer_part(parts["transformer_out"], {"hidden": head["head_hidden"],
                                                                     "temb": head["temb"]})}
    out = {}
    for name, fn in calls.items():
        fn()
        ms = []
        for _ in range(5):
            if dev.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                ms.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                fn()
                ms.append(1000 * (time.perf_counter() - t0))
        out[name] = round(statistics.median(ms), 3)
    return out


def calibration_file(pipe, src, a, path: Path) -> Path:
    """A `fluxtrt calibrate`-format file for this (redrawn) model: max |input| of every transformer linear over
    one 2-step generation at this size."""
    amax, hooks = {}, []
    module = pipe.executors["transformer"].module.model
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, inp, n=name: amax.__setitem__(n, max(amax.get(n, 0.0), float(inp[0].abs().max())))))
    pipe.generate([PROMPT], a.size, a.size, 2, 3.5, seed=0)
    for h in hooks:
        h.remove()
    path.write_text(json.dumps({"method": "linear-inputs", "model_hash": src.content_hash, "amax": amax}))
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:flux.1-dev")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--thresholds", default="0.12,0.14,0.16,0.18,0.2,0.3")
    ap.add_argument("--fp8-threshold", type=float, default=0.16)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    src = resolve_model(a.model)
    object.__setattr__(src, "load_component", redraw(src.load_component))  # a frozen dataclass
    dtype = "bf16" if a.device == "cuda" else "fp32"
    rows = {"meta": {"model": a.model, "weights": "transformer linears redrawn N(0, 0.005)", "size": a.size,
                     "steps": a.steps, "runs": a.runs, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                     "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu"}}

    def save(key, value):
        rows[key] = value
        print(json.dumps({key: value}), flush=True)
        Path(a.out).write_text(json.dumps(rows, indent=1))

    pipe = open_pipeline(None, backend="torch", model=src, device=a.device, torch_dtype=dtype)
    e2e(pipe, a, 0.0, 1)  # warm-up
    save("bf16 eager, uncached", e2e(pipe, a, 0.0, a.runs))
    for t in (float(v) for v in a.thresholds.split(",")):
        save(f"bf16 eager, threshold {t}", e2e(pipe, a, t, a.runs))
    save("bf16 eager, part ms", part_times(pipe, a))
    cal = calibration_file(pipe, src, a, Path(a.out).with_name("fbcache_calibration.json"))
    del pipe
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    fast = open_pipeline(None, backend="torch", model=src, device=a.device, torch_dtype=dtype, compile=a.compile,
                       calibration=cal)
    t0 = time.perf_counter()
    e2e(fast, a, 1e-9, 1)  # compiles the three parts
    save("fp8 compiled, first call s", round(time.perf_counter() - t0, 1))
    save("fp8 compiled, parts, every step computed", e2e(fast, a, 1e-9, a.runs))
    save(f"fp8 compiled, threshold {a.fp8_threshold}", e2e(fast, a, a.fp8_threshold, a.runs))
    save("fp8 compiled, part ms", part_times(fast, a))


if __name__ == "__main__":
    main()
