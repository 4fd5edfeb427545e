"""Device memory the whole pipeline needs at 1024², batch 1, per transformer precision: the engines' weights as
TensorRT-RTX's builder reported them, plus one activation buffer (the largest component's, from a static
1024² build), all resident and with --low-vram (fluxtrt.records.Manifest.memory_needed: the same computation
`fluxtrt build` prints). Activations are taken from the static bf16 build for every precision (quantized
activations are transient inside a layer; the buffers between layers are bf16 in all three). A component the
static manifest lacks can be given as NAME=GB of weights (e.g. t5 from its parameter count), activations 0.
    python3 scripts/memory_table.py STATIC_MANIFEST bf16=MANIFEST fp8=MANIFEST fp4=MANIFEST [--missing t5=9.52]
A transformer manifest without the builder's report (older builds) counts its engine's bytes as weights."""

import argparse
import copy
import json

from fluxtrt.records import ComponentEntry, Manifest


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("static")
    ap.add_argument("transformers", nargs="+", help="PRECISION=MANIFEST")
    ap.add_argument("--missing", action="append", default=[], help="NAME=GB of weights for an absent component")
    args = ap.parse_args()
    static = Manifest.from_json(json.loads(open(args.static).read()))
    template = static.components["transformer"]
    for item in args.missing:
        name, gb = item.split("=")
        static.components[name] = dataclass_copy(template, memory={"weights": int(float(gb) * 1e9), "persistent": 0,
                                                                   "activations": 0})
    rows = []
    for pair in args.transformers:
        precision, path = pair.split("=", 1)
        other = Manifest.from_json(json.loads(open(path).read())).components["transformer"]
        weights = other.memory["weights"] if other.memory else other.bytes
        m = copy.deepcopy(static)
        t = m.components["transformer"]
        t.memory = dict(t.memory, weights=weights, persistent=(other.memory or {}).get("persistent", 0))
        rows.append({"transformer": precision, "transformer_weights_gb": round(weights / 1e9, 2),
                     "default_gb": round(m.memory_needed() / 1e9, 1),
                     "low_vram_gb": round(m.memory_needed(low_vram=True) / 1e9, 1)})
    weights = {c: round(e.memory["weights"] / 1e9, 2) for c, e in static.components.items() if c != "transformer"}
    acts = {c: round(e.memory["activations"] / 1e9, 2) for c, e in static.components.items()}
    print(json.dumps({"other_weights_gb": weights, "activations_gb_1024": acts, "rows": rows}, indent=1))


def dataclass_copy(entry: ComponentEntry, **changes) -> ComponentEntry:
    import dataclasses

    return dataclasses.replace(entry, **changes)


if __name__ == "__main__":
    main()
