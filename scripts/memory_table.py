"""Device memory the whole pipeline needs at 1024², batch 1, per transformer precision: the engines' weights as
TensorRT-RTX's builder reported them, plus one activation buffer (the largest component's, from a static
1024² build), all resident and with --low-vram (fluxtrt.records.Manifest.memory_needed: the same computation
`fluxtrt build` prints). Activations are taken from the static bf16 build for every precision (quantized
activations are transient inside a layer; the buffers between layers are bf16 in all three).
    python3 scripts/memory_table.py STATIC_MANIFEST bf16=MANIFEST fp8=MANIFEST fp4=MANIFEST"""

import copy
import json
import sys

from fluxtrt.records import Manifest


def main(static_path, pairs):
    static = Manifest.from_json(json.loads(open(static_path).read()))
    rows = []
    for pair in pairs:
        precision, path = pair.split("=", 1)
        other = Manifest.from_json(json.loads(open(path).read())).components["transformer"]
        m = copy.deepcopy(static)
        t = m.components["transformer"]
        t.memory = dict(t.memory, weights=other.memory["weights"], persistent=other.memory.get("persistent", 0))
        rows.append({"transformer": precision, "transformer_weights_gb": round(other.memory["weights"] / 1e9, 2),
                     "engine_gb": round(other.bytes / 1e9, 2), "default_gb": round(m.memory_needed() / 1e9, 1),
                     "low_vram_gb": round(m.memory_needed(low_vram=True) / 1e9, 1)})
    others = {c: round(e.memory["weights"] / 1e9, 2) for c, e in static.components.items() if c != "transformer"}
    acts = {c: round(e.memory["activations"] / 1e9, 2) for c, e in static.components.items()}
    print(json.dumps({"other_weights_gb": others, "activations_gb_static_1024": acts, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
