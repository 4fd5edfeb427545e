"""Context parallelism on GPUs (issue 44): one image's latency with the transformer split over N ranks
(`--parallel N`, each attention mode) against the same pipeline on one GPU, in one process (the leader), and
each image against the 1-rank image of the same size. Rows go to --out as JSON after every measurement
([{size, ranks, attention, steps, first_s, e2e_s, speedup, max_diff_255, command}]).

Device (a machine with several GPUs), random full-size FLUX.1-dev with its linear weights N(0, 0.005) (with the
default initialisation the transformer is chaotic and runs that differ only in rounding diverge):
  python3 scripts/write_random_checkpoint.py --out /tmp/flux-cp \\
      --components transformer,text_encoder,text_encoder_2,vae --linear-std 0.005 --device cuda
  python3 scripts/context_parallel.py --model /tmp/flux-cp --ranks 1,2,4 --attention auto,gather \\
      --sizes 1024,2048 --compile --calibration CAL.json --out $OUT/context_parallel.json
Rehearse here: python3 scripts/context_parallel.py --model tiny --device cpu --torch-dtype fp32 --ranks 1,2 \\
      --sizes 256 --steps 2 --out /tmp/cp.json"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np


def timed(pipe, size: int, steps: int):
    """(seconds, image) of one generation (its images come back to the host, so the GPU work is done)."""
    t0 = time.perf_counter()
    res = pipe.generate(["a red fox in the snow"], size, size, steps, 3.5, seed=7)
    return time.perf_counter() - t0, res.images[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model name or folder (run in PyTorch)")
    ap.add_argument("--ranks", default="1,2", help="comma list; 1 is the baseline and runs first")
    ap.add_argument("--attention", default="auto", help="comma list of auto, ulysses, gather (N > 1)")
    ap.add_argument("--sizes", default="1024", help="comma list of square sizes in pixels")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=3, help="timed generations after the first (median)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--torch-dtype", default="bf16")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--calibration", type=Path, default=None, help="fluxtrt calibrate's file: the fp8 recipe")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    from fluxtrt.runtime.assembly import open_pipeline

    command = "python3 scripts/context_parallel.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    ranks = [int(n) for n in a.ranks.split(",")]
    if ranks[0] != 1:
        raise SystemExit("--ranks starts with 1 (the baseline)")
    rows, base = [], {}
    for n in ranks:
        for mode in (["auto"] if n == 1 else a.attention.split(",")):
            pipe = open_pipeline(model=a.model, backend="torch", device=a.device, torch_dtype=a.torch_dtype,
                                 compile=a.compile, calibration=a.calibration, parallel=n, parallel_attention=mode)
            try:
                for size in (int(s) for s in a.sizes.split(",")):
                    first, image = timed(pipe, size, a.steps)
                    times = [timed(pipe, size, a.steps)[0] for _ in range(a.repeats)]
                    e2e = float(np.median(times))
                    if n == 1:
                        base[size] = (e2e, image)
                    ref_s, ref = base[size]
                    rows.append({"size": size, "ranks": n, "attention": pipe.executors["transformer"].parallel_mode,
                                 "asked": mode, "steps": a.steps, "first_s": round(first, 3), "e2e_s": round(e2e, 3),
                                 "speedup": round(ref_s / e2e, 3),
                                 "max_diff_255": int(np.abs(image.astype(int) - ref.astype(int)).max()),
                                 "compile": a.compile, "fp8": a.calibration is not None, "command": command})
                    a.out.write_text(json.dumps(rows, indent=1))
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                pipe.close()


if __name__ == "__main__":
    main()
