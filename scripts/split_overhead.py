"""First-Block Cache's split engines against the single transformer engine, by TensorRT-RTX's own reports, at
growing depth: a copy of `tiny` (bf16, zero-copy path) whose transformer has D double + 2D single blocks, built for
the 4090 on this CPU with `--first-block-cache`. The extra layers and bytes of head + tail + out over the single
engine stay constant with depth (what the split adds is fixed), so their share falls as 1/depth.

Run: python3 scripts/split_overhead.py --depths 2,8 --out docs/bench/split_overhead.json"""

import argparse
import json
import shutil
import tempfile
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="2,8")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from fluxtrt import api
    from fluxtrt.components import TRANSFORMER_PARTS

    rows = []
    for depth in (int(d) for d in a.depths.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            folder = deep_copy_of_tiny(depth, Path(tmp) / "model")
            built = api.build(gpu="4090", model=str(folder), out_dir=Path(tmp) / "engines",
                              components=["transformer"], first_block_cache=True)
            c = built.manifest.components
            one = c["transformer"]
            parts = [c[p] for p in TRANSFORMER_PARTS]
            row = {"double_blocks": depth, "single_blocks": 2 * depth,
                   "transformer": {"layers": one.layers, "computed_layers": one.computed_layers, "bytes": one.bytes},
                   "parts": {"layers": sum(p.layers for p in parts),
                             "computed_layers": sum(p.computed_layers for p in parts),
                             "bytes": sum(p.bytes for p in parts)}}
            row["extra"] = {k: row["parts"][k] - row["transformer"][k] for k in row["parts"]}
            row["extra_share"] = {k: round(row["extra"][k] / row["transformer"][k], 4) for k in row["parts"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps({"command": "python3 scripts/split_overhead.py --depths " + a.depths,
                                       "target": "4090 (sm89), TensorRT-RTX 1.7, bf16 zero-copy", "rows": rows},
                                      indent=1))


if __name__ == "__main__":
    main()
