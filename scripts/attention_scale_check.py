"""The attention-scale rounding (optimize pass exact_attention_scale) at FLUX's real widths, on a CPU: a FLUX.1
transformer with the real hidden size and heads (24 x 128) but 1 double- and 1 single-stream block, random
weights stored in bf16; its zero-copy bf16 graph with and without the pass, computed in fp32 by ONNX Runtime
(the graph widened, as `fluxtrt validate --fp32` runs it), against the PyTorch module in fp32 and in fp64 on the
same inputs.

  python3 scripts/attention_scale_check.py [--size 512] [--json OUT.jsonl]"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path


def midsize_model(folder: Path, seed: int) -> Path:
    """tiny's folder (tokenizers, text encoders, VAE) with a FLUX-width transformer of 1 + 1 blocks in bf16."""
    import torch
    from diffusers import FluxTransformer2DModel

    from fluxtrt.models.random_arch import TRANSFORMER
    from fluxtrt.models.source import resolve_model

    tiny = resolve_model("tiny").path
    shutil.copytree(tiny, folder)
    small = json.loads((tiny / "transformer" / "config.json").read_text())
    cfg = {k: v for k, v in TRANSFORMER.items() if k != "_class_name"} | {
        "num_layers": 1, "num_single_layers": 1, "in_channels": small["in_channels"],
        "joint_attention_dim": small["joint_attention_dim"], "pooled_projection_dim": small["pooled_projection_dim"],
        "guidance_embeds": small.get("guidance_embeds", True)}
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
    shutil.rmtree(folder / "transformer")
    model.save_pretrained(folder / "transformer", safe_serialization=True)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.core.sessions import runnable_session
    from fluxtrt.export import export_component
    from fluxtrt.models.source import resolve_model
    from fluxtrt.optimize.graph import optimize_zero_copy
    from fluxtrt.optimize.passes import DEFAULT_PASSES
    from fluxtrt.validate import relative_errors

    work = Path(tempfile.mkdtemp(prefix="attention-scale-"))
    try:
        src = resolve_model(str(midsize_model(work / "model", args.seed)))
        geo = src.geometry
        spec = specs_for(geo, ["transformer"])["transformer"]
        zc = export_component(src, spec, work / "zc", "bf16", zero_copy=True).path
        without = [p for p in DEFAULT_PASSES if p != "exact_attention_scale"]
        graphs = {"without the pass": optimize_zero_copy(zc, work / "a" / "transformer.onnx", "transformer", without).path,
                  "with the pass": optimize_zero_copy(zc, work / "b" / "transformer.onnx", "transformer").path}
        feeds = spec.sample_inputs(ShapePoint(1, args.size, args.size), geo, args.seed)
        module = src.load_component("transformer", torch.float32, "cpu")
        wrapped = spec.wrap(module)

        def args_in(dtype):
            return [(feeds[t.name].to(dtype) if feeds[t.name].is_floating_point() else feeds[t.name])
                    for t in spec.inputs if t.name in feeds]

        with torch.inference_mode():
            ref32 = wrapped(*args_in(torch.float32))
            module.to(torch.float64)
            ref64 = wrapped(*args_in(torch.float64))
        rows = [{"compare": "PyTorch fp32 vs fp64", "max": relative_errors(ref32, ref64)[0],
                 "mean": relative_errors(ref32, ref64)[1]}]
        for label, path in graphs.items():
            session = runnable_session(path, widen=True)
            names = [i.name for i in session.get_inputs()]
            out = torch.from_numpy(session.run(None, {n: feeds[n].float().numpy() if feeds[n].is_floating_point()
                                                      else feeds[n].numpy() for n in names})[0])
            for against, ref in (("fp32", ref32), ("fp64", ref64)):
                err, mean = relative_errors(out, ref)
                rows.append({"compare": f"ONNX Runtime fp32, {label}, vs PyTorch {against}", "max": err, "mean": mean})
        for r in rows:
            print(f"{r['compare']:<58} max {r['max']:.2e}  mean {r['mean']:.2e}")
        if args.json:
            args.json.write_text("".join(json.dumps(r | {"size": args.size, "seed": args.seed}) + "\n" for r in rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
