"""Compiled PyTorch engines (AOTInductor packages) against diffusers on one GPU (issue: engines for the GPU you have).

build: `fluxtrt build --backend torch` as the product runs it (api.build), each component's build seconds and package
  bytes recorded, the build's wall time too.
first: a fresh process (`fluxtrt run --engines DIR`, empty Inductor cache) timed from its start to the image written:
  what a new server replica pays before its first image.
speed: in one process, diffusers eager bf16 (the baseline, same run) then the packages (`--cuda-graph` where asked):
  end to end (text encoders, N steps, VAE decode), load time, peak GPU memory, ratios against the baseline.

Rows go to --out as JSON after every measurement (a cut run keeps what it measured).
Device:  python3 scripts/aot_engines.py build --gpu h200 --precision transformer=fp8 --out $OUT/build.json
         python3 scripts/aot_engines.py load --engines aot/h200-torch-fp8 --out $OUT/load.json
         python3 scripts/aot_engines.py read --engines aot/h200-torch-fp8 --out $OUT/read.json
         python3 scripts/aot_engines.py first --engines aot/h200-torch-fp8 --out $OUT/first.json
         python3 scripts/aot_engines.py speed --engines aot/h200-torch-fp8 --out $OUT/speed.json
Rehearse here: python3 scripts/aot_engines.py build --gpu cpu --model tiny --root /tmp/aot --out /tmp/b.json
               python3 scripts/aot_engines.py first --engines /tmp/aot/cpu --steps 2 --size 256 --out /tmp/f.json
               python3 scripts/aot_engines.py speed --engines /tmp/aot/cpu --steps 2 --size 256 --out /tmp/s.json"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write(path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, default=str))


def meta(a) -> dict:
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "argv": sys.argv[1:]}


def build(a) -> None:
    from fluxtrt import api
    from fluxtrt.records import CalibrationSettings

    t0 = time.perf_counter()
    done = api.build(gpu=a.gpu, model=a.model or "random:flux.1-dev", out_dir=a.root, backend="torch",
                     precision=a.precision or None, static_shape=a.static,
                     components=a.components.split(",") if a.components else None,
                     calibration=CalibrationSettings(size=a.calibration_size, steps=1))
    wall = time.perf_counter() - t0
    rows = [{"component": n, "precision": e.precision, "bytes": e.bytes, "build_s": e.build_seconds,
             "peak_rss_mb": e.peak_rss_mb, "status": next((r.status for r in done.results if r.component == n), None),
             "detail": next((r.detail for r in done.results if r.component == n), "")}
            for n, e in done.manifest.components.items()]
    write(a.out, {"meta": meta(a), "gpu_dir": str(done.gpu_dir), "wall_s": round(wall, 1),
                  "runtime": done.manifest.runtime, "rows": rows})
    print(json.dumps({"wall_s": round(wall, 1), "gpu_dir": str(done.gpu_dir)}), flush=True)
    for r in rows:
        print(json.dumps(r), flush=True)


def first(a) -> None:
    """`fluxtrt run` in a fresh process with an empty Inductor cache, timed from its start to the image written."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        out = Path(a.out).with_suffix(".png")
        cmd = [sys.executable, "-m", "fluxtrt.cli", "run", "--engines", a.engines, "--prompt", "a red fox in the snow",
               "--steps", str(a.steps), "--height", str(a.size), "--width", str(a.size), "--out", str(out)]
        cmd += ["--cuda-graph"] if a.cuda_graph else []
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
    row = {"meta": meta(a), "command": " ".join(cmd), "returncode": proc.returncode,
           "fresh_process_to_image_s": round(wall, 2), "image_written": out.is_file(),
           "output_tail": proc.stdout[-1500:].splitlines()}
    write(a.out, row)
    print(json.dumps({"fresh_process_to_image_s": round(wall, 2), "rc": proc.returncode}), flush=True)
    if a.profile:  # where the time goes: the same fresh process again under cProfile (its costliest calls)
        import io
        import pstats

        with tempfile.TemporaryDirectory() as cache:
            prof = Path(cache) / "run.prof"
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            t0 = time.perf_counter()
            p2 = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), *cmd[1:]], env=env,
                                capture_output=True, text=True)
            row["profiled_s"] = round(time.perf_counter() - t0, 2)
            text = io.StringIO()
            if prof.is_file():
                stats = pstats.Stats(str(prof), stream=text)
                stats.sort_stats("cumulative").print_stats(r"fluxtrt|torch|safetensors|transformers|tokenizers", 70)
                stats.sort_stats("tottime").print_stats(25)
            row["profile"] = text.getvalue().splitlines() or p2.stderr[-2000:].splitlines()
        write(a.out, row)
        print("\n".join(row["profile"]), flush=True)


def load(a) -> None:
    """Each package of the folder opened on its own, its phases timed: the package's sha256, its weights read (and
    hashed) to the device, the kernels loaded, the weights handed over, one call at the profile's opt size.
    Host RSS and the device's peak after each (a load that dies shows how far it got: rows are written as it goes)."""
    import faulthandler
    import resource

    import torch

    from fluxtrt.core import packages
    from fluxtrt.dtypes import torch_dtype_of_engine
    from fluxtrt.fileio import sha256_file
    from fluxtrt.records import read_manifest

    faulthandler.enable()
    folder = Path(a.engines)
    manifest = read_manifest(folder)
    device = packages.run_device(manifest.runtime)
    rows = []
    for name, e in manifest.components.items():
        if not (e.engine or "").endswith(packages.EXTENSION):
            continue
        row = {"component": name, "pt2_bytes": e.bytes, "constants_bytes": (e.constants or {}).get("bytes")}
        rows.append(row)

        def mark(key, t0, row=row, name=name):
            row[key] = round(time.perf_counter() - t0, 2)
            row["rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
            if device == "cuda":
                torch.cuda.synchronize()
                row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
            write(a.out, {"meta": meta(a), "rows": rows})
            print(name, key, row[key], flush=True)

        t = time.perf_counter()
        sha256_file(folder / e.engine)
        mark("pt2_sha256_s", t)
        t = time.perf_counter()
        weights = packages.read_constants(folder / e.constants["file"], e.constants, device, name)
        mark("weights_read_s", t)
        if row["constants_bytes"]:
            row["weights_gb_per_s"] = round(row["constants_bytes"] / 1e9 / max(row["weights_read_s"], 1e-3), 2)
        t = time.perf_counter()
        fn = packages.load_package(folder / e.engine, name, device)
        mark("kernels_load_s", t)
        t = time.perf_counter()
        wanted = fn.get_constant_fqns()
        row["constants"], row["missing"] = len(wanted), sorted(set(wanted) - set(weights))[:5]
        fn.load_constants({k: weights[k] for k in wanted}, check_full_update=True, user_managed=True)
        mark("constants_handover_s", t)
        args = []  # random inputs at the profile's opt shape, in the recorded dtypes (timing only)
        for t in e.inputs:
            shape, dtype = e.profile[t["name"]]["opt"], torch_dtype_of_engine(t["dtype"])
            args.append(torch.randint(0, 100, shape, device=device, dtype=dtype) if not dtype.is_floating_point
                        else torch.randn(shape, device=device).to(dtype))
        if args:
            for key in ("first_call_s", "second_call_s"):
                t = time.perf_counter()
                with torch.inference_mode():
                    fn(*args)
                mark(key, t)
        del fn, weights
        if device == "cuda":
            torch.cuda.empty_cache()


def read(a) -> None:
    """The weights files of a package folder read as the runtime reads them (core/packages.read_constants: read,
    sha256 and the copy to the device overlapped), each timed: GB/s."""
    import hashlib

    import torch

    from fluxtrt.core import packages
    from fluxtrt.records import read_manifest

    folder = Path(a.engines)
    manifest = read_manifest(folder)
    device = "cuda" if torch.cuda.is_available() and manifest.runtime.get("target") != "cpu" else "cpu"
    # the three parts of a load apart (GB/s each): sha256 of bytes in memory, host to device (pageable and pinned)
    buf = bytearray(1 << 30)
    t0 = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    parts = {"sha256_gb_per_s": round(1.074 / (time.perf_counter() - t0), 2)}
    if device == "cuda":
        for pin in (False, True):
            host = torch.frombuffer(buf, dtype=torch.uint8).pin_memory() if pin else torch.frombuffer(buf, dtype=torch.uint8)
            host.to(device)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.to(device)
            torch.cuda.synchronize()
            parts[f"h2d_{'pinned' if pin else 'pageable'}_gb_per_s"] = round(1.074 / (time.perf_counter() - t0), 2)
    print(json.dumps(parts), flush=True)
    rows = [parts]
    for name, e in manifest.components.items():
        if not e.constants:
            continue
        t0 = time.perf_counter()  # the file's bytes alone, 64 MiB at a time (page cache as the build left it)
        with open(folder / e.constants["file"], "rb", buffering=0) as f:
            chunk = bytearray(64 << 20)
            while f.readinto(chunk):
                pass
        raw = time.perf_counter() - t0
        t0 = time.perf_counter()
        packages.read_constants(folder / e.constants["file"], e.constants, device, name)
        if device == "cuda":
            torch.cuda.synchronize()
        s = time.perf_counter() - t0
        rows.append({"component": name, "bytes": e.constants["bytes"], "read_s": round(s, 2),
                     "gb_per_s": round(e.constants["bytes"] / 1e9 / s, 2), "device": device,
                     "file_read_alone_gb_per_s": round(e.constants["bytes"] / 1e9 / raw, 2)})
        print(json.dumps(rows[-1]), flush=True)
        write(a.out, {"meta": meta(a), "rows": rows})


def kernels(a) -> None:
    """Where a fresh process's first package load goes (52 s for the first CUDA package on the H200, later ones
    0.0 s): torch imported, the CUDA context made, torch._inductor imported, then each package's kernels loaded,
    the first under cProfile (its 20 costliest calls by cumulative time in the rows)."""
    import cProfile
    import io
    import pstats

    t0 = time.perf_counter()
    import torch

    rows = {"import_torch_s": round(time.perf_counter() - t0, 2)}
    from fluxtrt.core import packages
    from fluxtrt.records import read_manifest

    manifest = read_manifest(Path(a.engines))
    device = packages.run_device(manifest.runtime)
    t = time.perf_counter()
    if device == "cuda":
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
    rows["cuda_context_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    import torch._inductor  # noqa: F401
    import torch._inductor.package  # noqa: F401

    rows["import_inductor_s"] = round(time.perf_counter() - t, 2)
    profiled = None  # the first package's name: its load is profiled
    for name, e in manifest.components.items():
        if not (e.engine or "").endswith(packages.EXTENSION):
            continue
        profiled = profiled or name
        prof = cProfile.Profile() if profiled == name else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        packages.load_package(Path(a.engines) / e.engine, name, device)
        if prof:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(20)
            rows[f"{name}_profile"] = text.getvalue().splitlines()[-30:]
        rows[f"{name}_kernels_load_s"] = round(time.perf_counter() - t, 2)
        print(name, rows[f"{name}_kernels_load_s"], flush=True)
        write(a.out, {"meta": meta(a), "rows": rows})
    print("\n".join(rows.get(f"{profiled}_profile", [])), flush=True)


def speed(a) -> None:
    import gc

    import torch

    from fluxtrt.bench import add_ratios, bench_diffusers, bench_fluxtrt
    from fluxtrt.models.source import resolve_model
    from fluxtrt.records import read_manifest
    from fluxtrt.runtime.assembly import open_pipeline

    manifest = read_manifest(Path(a.engines))
    src = resolve_model(a.model or manifest.model.id)
    cuda = torch.cuda.is_available()
    rows, table = [], []

    def save():
        write(a.out, {"meta": meta(a), "rows": rows})
        write(Path(a.out).with_name("aot_engines_rows.json"), table)

    for variant in a.variants.split(","):
        t0 = time.perf_counter()
        if variant == "diffusers":
            pipe = src.load_pipeline(torch.bfloat16 if cuda else torch.float32, "cuda" if cuda else "cpu")
            pipe.set_progress_bar_config(disable=True)
        else:
            pipe = open_pipeline(Path(a.engines), backend="torch", cuda_graph=variant.endswith("graph"),
                            torch_dtype="bf16" if cuda else "fp32")
            for ex in pipe.executors.values():
                ex.activate()  # the load, timed: packages read from disk
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        if variant == "diffusers":
            row = bench_diffusers(pipe, src.geometry, a.size, a.size, 1, steps=a.steps, runs=a.runs, warmup=1,
                                  device=torch.device("cuda" if cuda else "cpu"))
            row.system = variant
        else:
            row = bench_fluxtrt(pipe, f"fluxtrt packages {variant}", a.size, a.size, 1, steps=a.steps, runs=a.runs,
                                warmup=1)
        first_call = time.perf_counter() - t1 - row.end_to_end_s.median * a.runs
        rows.append({"variant": variant, "row": row, "load_s": load_s, "first_call_s": first_call})
        base = next((r["row"] for r in rows if r["variant"] == "diffusers"), None)
        if base is not None and base is not row:
            add_ratios(row, base)
        table.append({"size": a.size, "batch": 1, "steps": a.steps, "variant": variant,
                      "e2e_s": round(row.end_to_end_s.median, 4),
                      "baseline_s": round(base.end_to_end_s.median, 4) if base is not None else None,
                      "ratio": round(base.end_to_end_s.median / row.end_to_end_s.median, 3) if base else None,
                      "step_ms": round(row.transformer_step_s.median * 1000, 2), "load_s": round(load_s, 2),
                      "first_call_s": round(first_call, 2), "peak_gb": row.peak_memory_gb,
                      "peak_vs_baseline": round(row.peak_memory_gb / base.peak_memory_gb, 3)
                      if base is not None and row.peak_memory_gb and base.peak_memory_gb else None})
        print(json.dumps(table[-1]), flush=True)
        save()
        del pipe
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["build", "load", "read", "first", "speed", "kernels"])
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--model", default="", help="build: default random:flux.1-dev; speed: default the manifest's")
    ap.add_argument("--root", default="aot", help="build: the build root")
    ap.add_argument("--precision", action="append", default=[], help="build: -p values")
    ap.add_argument("--components", default="", help="build: comma-separated (default: the four run components)")
    ap.add_argument("--static", action=argparse.BooleanOptionalAction, default=True,
                    help="build: pin the profile to the config's opt size (static shapes)")
    ap.add_argument("--calibration-size", type=int, default=2)
    ap.add_argument("--engines", default="")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--variants", default="diffusers,packages-graph")
    ap.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True, help="first: --cuda-graph")
    ap.add_argument("--profile", action="store_true", help="first: then once more under cProfile")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.phase == "build" and not a.components:
        a.components = "clip,t5,transformer,vae_decoder"
    {"build": build, "load": load, "read": read, "first": first, "speed": speed, "kernels": kernels}[a.phase](a)


if __name__ == "__main__":
    main()
