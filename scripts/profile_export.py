"""Where the export's time goes, phase by phase, for one component traced on the meta device (no weights
needed: the architecture's config is enough). Prints one JSON line per phase.

  python3 scripts/profile_export.py --model random:flux.1-dev --component transformer --dtype bf16"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:flux.1-dev")
    ap.add_argument("--component", default="transformer")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--no-shape-inference", action="store_true", help="run the optimizer without ONNX shape inference")
    args = ap.parse_args()

    import onnxscript.optimizer
    import onnxscript.rewriter.onnx_fusions
    import torch

    from fluxtrt.components import specs_for
    from fluxtrt.dtypes import torch_dtype
    from fluxtrt.export.trace import dynamic_shapes, example_point, export_patches, quiet_exporter
    from fluxtrt.export.zerocopy import empty_component
    from fluxtrt.models.source import resolve_model

    src = resolve_model(args.model)
    spec = specs_for(src.geometry, [args.component])[args.component]
    dt = torch_dtype(args.dtype)

    def phase(name, t0, **extra):
        print(json.dumps({"phase": name, "seconds": round(time.perf_counter() - t0, 1), **extra}), file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    raw, _ = empty_component(src.path, spec.subfolder, dt)
    module = spec.wrap(raw).eval()
    example = spec.sample_inputs(example_point(src.geometry), src.geometry, seed=0)
    argv = tuple((v.to(dt) if v.is_floating_point() else v).to("meta") for v in example.values())
    phase("build meta module", t0)
    with export_patches(module), torch.no_grad(), quiet_exporter():
        t0 = time.perf_counter()
        ep = torch.export.export(module, argv, dynamic_shapes=dynamic_shapes(spec), strict=False)
        phase("torch.export.export", t0, nodes=len(ep.graph.nodes))
        t0 = time.perf_counter()
        ep = ep.run_decompositions()
        phase("run_decompositions", t0, nodes=len(ep.graph.nodes))
        t0 = time.perf_counter()
        program = torch.onnx.export(ep, argv, dynamo=True, opset_version=19, optimize=False,
                                    input_names=[t.name for t in spec.inputs],
                                    output_names=[t.name for t in spec.outputs])
        phase("torch.onnx.export(ExportedProgram), translation", t0, nodes=len(list(program.model.graph)))
        graph = program.model.graph
        for v in graph.initializers.values():
            v.const_value = None
        t0 = time.perf_counter()
        onnxscript.optimizer.optimize_ir(program.model, onnx_shape_inference=not args.no_shape_inference)
        phase("onnxscript optimize_ir" + (" (no shape inference)" if args.no_shape_inference else ""), t0,
              nodes=len(list(graph)))
        t0 = time.perf_counter()
        onnxscript.rewriter.onnx_fusions.fuse(program.model)
        phase("onnx_fusions.fuse", t0, nodes=len(list(graph)))


if __name__ == "__main__":
    main()
