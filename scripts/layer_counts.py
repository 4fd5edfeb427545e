"""TensorRT-RTX's parsed layers of ONNX files, and of those the ones computed per inference (the rest read only
weights and constants and fold at build; fluxtrt.engine.build.computed_layers). Prints one JSON line per file.
    python3 scripts/layer_counts.py OUT/onnx/*-bf16-zc/transformer.onnx OUT/onnx/*-bf16-zc-opt/transformer.onnx"""

import json
import sys
import time

from fluxtrt.core.backends import TensorRTRTX
from fluxtrt.engine.build import computed_layers


def main(paths):
    backend = TensorRTRTX()
    trt = backend.trt
    for path in paths:
        t0 = time.perf_counter()
        builder = trt.Builder(backend.logger)
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, backend.logger)
        if not parser.parse_from_file(path):
            raise SystemExit(f"{path}: " + "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
        print(json.dumps({"onnx": path, "layers": network.num_layers, "computed_layers": computed_layers(network),
                          "parse_seconds": round(time.perf_counter() - t0, 1)}), flush=True)
        del parser, network, builder


if __name__ == "__main__":
    main(sys.argv[1:])
