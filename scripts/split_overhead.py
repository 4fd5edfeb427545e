"""First-Block Cache's split engines against the single transformer engine, by TensorRT-RTX's own reports, at
growing depth: a copy of `tiny` (bf16, zero-copy path) whose transformer has D double + 2D single blocks, built for
the 4090 on this CPU with `--first-block-cache`. The extra layers and bytes of head + tail + out over the single
engine stay constant with depth (what the split adds is fixed), so their share falls as 1/depth.

Run: python3 scripts/split_overhead.py --depths 2,8 --out docs/bench/split_overhead.json
Full size (the device machine's CPU side, TensorRT-RTX staged; two calls, the second reusing the first's engine):
     python3 scripts/split_overhead.py --full-size /root/split --phase single --out $OUT/split_full.json
     python3 scripts/split_overhead.py --full-size /root/split --phase split --out $OUT/split_full.json
  (random FLUX.1-dev transformer written as a bf16 checkpoint, built for the 4090 without validation)"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def deep_copy_of_tiny(depth: int, dest: Path) -> Path:
    from diffusers import FluxTransformer2DModel

    from fluxtrt.models.source import resolve_model

    src = resolve_model("tiny")
    shutil.copytree(src.path, dest)
    cfg = json.loads((dest / "transformer" / "config.json").read_text())
    cfg.update(num_layers=depth, num_single_layers=2 * depth)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    torch.manual_seed(depth)
    model = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
    shutil.rmtree(dest / "transformer")
    model.save_pretrained(dest / "transformer")
    return dest


def sizes(entry) -> dict:
    """An engine's numbers from the builder's reports, as the manifest records them."""
    return {"layers": entry.layers, "computed_layers": entry.computed_layers, "bytes": entry.bytes}


def report(single: dict, each_part: dict) -> dict:
    """The single engine against its parts: totals, what the split adds, and its share."""
    total = {k: sum(v[k] for v in each_part.values()) for k in single}
    extra = {k: total[k] - single[k] for k in single}
    return {"transformer": single, "parts": total, "each_part": each_part, "extra": extra,
            "extra_share": {k: round(extra[k] / single[k], 4) for k in single}}


def full_size(a) -> None:
    """The real FLUX.1-dev transformer (random bf16 weights), single engine then parts, for the 4090."""
    from fluxtrt import api
    from fluxtrt.components import TRANSFORMER_PARTS

    work = Path(a.full_size)
    model = work / "model"
    if not model.exists():
        subprocess.run([sys.executable, "scripts/write_random_checkpoint.py", "--model", "random:flux.1-dev",
                        "--out", str(model), "--components", "transformer", "--dtype", "bf16", "--device", "cuda"],
                       check=True)
    out = Path(a.out)
    doc = json.loads(out.read_text()) if out.exists() else {
        "command": "python3 scripts/split_overhead.py --full-size DIR --phase single, then --phase split",
        "target": "4090 (sm89), TensorRT-RTX 1.7, bf16 zero-copy, random FLUX.1-dev transformer, not validated"}
    t = time.perf_counter()
    if a.phase == "single":
        built = api.build(gpu="4090", model=str(model), out_dir=work / "engines", components=["transformer"],
                          validate=False)
        one = built.manifest.components["transformer"]
        doc["transformer"] = sizes(one)
        (work / "engines" / "4090" / one.engine).unlink()  # 24 GB: the machine's disk holds one such engine
    else:  # the parts alone (same request, `--first-block-cache`'s three extra components)
        built = api.build(gpu="4090", model=str(model), out_dir=work / "parts", components=list(TRANSFORMER_PARTS),
                          validate=False)
        c = built.manifest.components
        doc["row"] = {"double_blocks": 19, "single_blocks": 38,
                      **report(doc["transformer"], {p: sizes(c[p]) for p in TRANSFORMER_PARTS})}
    doc[a.phase + "_build_s"] = round(time.perf_counter() - t, 1)
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="2,8")
    ap.add_argument("--full-size", metavar="DIR", help="work folder for the full-size measurement")
    ap.add_argument("--phase", choices=["single", "split"], default="single")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.full_size:
        return full_size(a)
    from fluxtrt import api
    from fluxtrt.components import TRANSFORMER_PARTS

    rows = []
    for depth in (int(d) for d in a.depths.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            folder = deep_copy_of_tiny(depth, Path(tmp) / "model")
            built = api.build(gpu="4090", model=str(folder), out_dir=Path(tmp) / "engines",
                              components=["transformer"], first_block_cache=True)
            c = built.manifest.components
            row = {"double_blocks": depth, "single_blocks": 2 * depth,
                   **report(sizes(c["transformer"]), {p: sizes(c[p]) for p in TRANSFORMER_PARTS})}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps({"command": "python3 scripts/split_overhead.py --depths " + a.depths,
                                       "target": "4090 (sm89), TensorRT-RTX 1.7, bf16 zero-copy", "rows": rows},
                                      indent=1))


if __name__ == "__main__":
    main()
