"""What the compiled PyTorch transformer costs at start (issue 32): torch's compile caches against an AOTInductor
package, each phase in a new process (a new start), on the module the torch executor runs (`TorchExecutor` with
compile: projections fused as the optimize stage fuses them; the fp8 recipe with --calibration).

  cold        torch.compile, Inductor's cache folder emptied first: the first call (compile + run)
  warm        torch.compile in a new process on that cache: the first call
  aoti-build  torch.export + AOTInductor package (`transformer.pt2`) without its weights (the form that would ship
              beside the engines), on its own empty cache folder
  aoti-load   a new process loads the model, then the package, hands it the module's weights (shared, not
              copied), and calls it
Every phase also times the loaded module's steady call (median of --calls after the first), so a faster start
is not bought with a slower step. `all` runs the four in order, each in its own process, and writes --out.

Device: python3 scripts/compile_cost.py all --size 1024 --out $OUT/compile_cost.json [--calibration FILE]
Rehearse here: python3 scripts/compile_cost.py all --model tiny --device cpu --size 256 --out /tmp/cc.json"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("cold", "warm", "aoti-build", "aoti-load")


def executor(a):
    """The torch executor's transformer, activated (the module loaded, fused, quantized; compile is lazy)."""
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.models.source import resolve_model
    from fluxtrt.runtime.executors import TorchExecutor

    src = resolve_model(a.model)
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    recipe = None
    if a.calibration:  # as Pipeline reads `--calibration` for the PyTorch transformer
        from fluxtrt import fp8

        recipe = fp8.read_calibration(Path(a.calibration), src.content_hash)
    ex = TorchExecutor("transformer", src, spec, a.device, "bf16" if a.device == "cuda" else "fp32", compile=True,
                       fp8=recipe)
    t0 = time.perf_counter()
    ex.activate()
    load_s = time.perf_counter() - t0
    feeds = spec.sample_inputs(ShapePoint(1, a.size, a.size), src.geometry, 3)
    args = [feeds[t.name].to(ex.device, ex.dtype) if feeds[t.name].is_floating_point() else feeds[t.name].to(ex.device)
            for t in spec.inputs if t.name in feeds]
    return ex, args, load_s


def timed(fn, args, device, calls):
    import torch

    def once():
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            fn(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    first = once()
    steady = [once() for _ in range(calls)]
    return first, statistics.median(steady)


def rel_to_module(fn, module, args) -> float:
    """max |fn - module| / max |module| on the same inputs: the compiled form computes what the module does."""
    import torch

    from fluxtrt.validate import relative_errors

    with torch.inference_mode():
        return relative_errors(fn(*args), module(*args))[0]


def phase(a) -> dict:
    import torch

    work = Path(a.work)
    cache = work / ("inductor-aoti" if a.phase.startswith("aoti") else "inductor")
    if a.phase in ("cold", "aoti-build"):
        shutil.rmtree(cache, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    package = work / "transformer.pt2"
    row = {"phase": a.phase, "model": a.model, "size": a.size, "fp8": bool(a.calibration), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu"}
    ex, args, row["load_s"] = executor(a)
    if a.phase == "aoti-load":  # the package holds no weights: the loaded module's are handed to it, not copied
        t0 = time.perf_counter()
        fn = torch._inductor.aoti_load_package(str(package))
        weights = {**dict(ex.module.named_parameters()), **dict(ex.module.named_buffers())}
        fn.load_constants({k: weights[k] for k in fn.get_constant_fqns()}, check_full_update=True, user_managed=True)
        row["package_load_s"] = time.perf_counter() - t0
        row["first_call_s"], row["steady_ms"] = timed(fn, args, a.device, a.calls)
        row["max_rel_vs_eager"] = rel_to_module(fn, ex.module, args)
    elif a.phase == "aoti-build":
        t0 = time.perf_counter()
        with torch.inference_mode():
            exported = torch.export.export(ex.module, tuple(args))
        row["export_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()  # without its constants: an artifact beside the engines, not a second checkpoint
        torch._inductor.aoti_compile_and_package(exported, package_path=str(package),
                                                 inductor_configs={"aot_inductor.package_constants_in_so": False})
        row["build_s"] = time.perf_counter() - t0
        row["package_mb"] = package.stat().st_size / 2**20
    else:
        row["first_call_s"], row["steady_ms"] = timed(ex._fn, args, a.device, a.calls)
        row["max_rel_vs_eager"] = rel_to_module(ex._fn, ex.module, args)
    if "steady_ms" in row:
        row["steady_ms"] *= 1000
    return {k: v if k == "max_rel_vs_eager" else round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("all", *PHASES))
    ap.add_argument("--model", default="random:flux.1-dev")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--calibration", default=None, help="the fp8 recipe's calibration (fluxtrt calibrate)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--work", default="/tmp/compile-cost")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    Path(a.work).mkdir(parents=True, exist_ok=True)
    if a.phase != "all":
        Path(a.out).write_text(json.dumps(phase(a)))
        return
    rows = []
    for p in PHASES:
        part = Path(a.work) / f"{p}.json"
        cmd = [sys.executable, __file__, p, "--model", a.model, "--device", a.device, "--size", str(a.size),
               "--calls", str(a.calls), "--work", a.work, "--out", str(part)]
        t0 = time.perf_counter()
        subprocess.run(cmd + (["--calibration", a.calibration] if a.calibration else []), check=True)
        rows.append({**json.loads(part.read_text()), "process_s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
