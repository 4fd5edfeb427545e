"""The weight map: how every initializer of an optimized graph derives from tensors of the checkpoint, so an
engine or a weight-free ONNX can be filled from the user's own safetensors at load (refit).

Export names each parameter initializer by its checkpoint key; each stage that derives a new weight from
another records a recipe (provenance), kept in the ONNX file's metadata under `fluxtrt.weights`:
  {"tensor": KEY}                                  the checkpoint tensor as stored
  {"op": "cast", "to": DTYPE, "of": R}             dtype change (numpy / ml_dtypes rounding)
  {"op": "transpose", "perm": [...], "of": R}      layout change (linear weights)
  {"op": "reshape", "shape": [...], "of": R}       (also Unsqueeze/Squeeze/Identity folded on a weight)
  {"op": "concat", "axis": A, "of": [R, ...]}      fused q/k/v (and MLP) projections
Initializers without a recipe are the graph's own constants (shape arithmetic, epsilons, rotary indices):
they do not depend on the checkpoint and stay in the engine/ONNX. Quantized weights (Q/DQ recipes) are
derived with calibration data and are not refittable from a checkpoint; their map says so."""

from __future__ import annotations

import contextlib
import contextvars
import json

from ..dtypes import cast, np_dtype
from ..errors import FluxtrtError

KEY = "fluxtrt.weights"
_current: contextvars.ContextVar = contextvars.ContextVar("fluxtrt_provenance", default=None)


def read(model) -> dict:
    for p in model.metadata_props:
        if p.key == KEY:
            return json.loads(p.value)
    return {}


def write(model, prov: dict) -> None:
    names = {t.name for t in model.graph.initializer}
    kept = {k: v for k, v in prov.items() if k in names}
    for p in list(model.metadata_props):
        if p.key == KEY:
            model.metadata_props.remove(p)
    if kept:
        entry = model.metadata_props.add()
        entry.key, entry.value = KEY, json.dumps(kept, sort_keys=True, separators=(",", ":"))


@contextlib.contextmanager
def tracking(prov: dict):
    """Make `prov` the provenance the graph passes read and extend."""
    token = _current.set(prov)
    try:
        yield prov
    finally:
        _current.reset(token)


def recipe_of(name: str):
    prov = _current.get()
    return prov.get(name) if prov is not None else None


def derive(out_name: str, op: dict, *inputs: str) -> None:
    """Record that `out_name` is `op` applied to weights `inputs` (only when every input is tracked)."""
    prov = _current.get()
    if prov is None:
        return
    parts = [prov.get(i) for i in inputs]
    if any(p is None for p in parts):
        return
    prov[out_name] = dict(op, of=parts if op["op"] == "concat" else parts[0])


def source_keys(recipe) -> list[str]:
    if "tensor" in recipe:
        return [recipe["tensor"]]
    of = recipe["of"]
    return [k for r in (of if isinstance(of, list) else [of]) for k in source_keys(r)]


def evaluate(recipe, get):
    """The array a recipe describes; `get(key)` returns a checkpoint tensor as numpy."""
    import numpy as np

    if "tensor" in recipe:
        return get(recipe["tensor"])
    op = recipe["op"]
    if op == "concat":
        return np.concatenate([evaluate(r, get) for r in recipe["of"]], axis=recipe["axis"])
    x = evaluate(recipe["of"], get)
    if op == "cast":
        return cast(x, recipe["to"])
    if op == "transpose":
        return np.transpose(x, recipe["perm"])
    if op == "reshape":
        return np.reshape(x, recipe["shape"])
    raise FluxtrtError(f"weight map: unknown recipe op '{op}'")


def build_map(model, component: str, subfolder: str, quantized: bool = False) -> dict:
    """The JSON weight map of an optimized ModelProto (from its recorded provenance)."""
    from onnx import helper

    prov = {} if quantized else read(model)
    entries = []
    for t in model.graph.initializer:
        if t.name in prov:
            entries.append({"name": t.name, "shape": list(t.dims),
                            "dtype": str(helper.tensor_dtype_to_np_dtype(t.data_type)), "recipe": prov[t.name]})
    keys = sorted({k for e in entries for k in source_keys(e["recipe"])})
    reason = ("quantized weights are derived with calibration data; rebuild instead" if quantized else
              "" if entries else "its ONNX records no weight provenance (exported by an older fluxtrt); rebuild "
              "with --force")
    return {"component": component, "subfolder": subfolder, "refittable": not quantized and bool(entries),
            "reason": reason,
            "weights": entries, "checkpoint_tensors": keys}


RECIPE_OPS = {"cast": ("to",), "transpose": ("perm",), "reshape": ("shape",), "concat": ("axis",)}
MAX_RECIPE_DEPTH = 16


def _check_recipe(r, where: str, depth: int = 0) -> None:
    from ..dtypes import TABLE

    def bad(why):
        return FluxtrtError(f"{where}: {why}; the weight map was edited or is damaged: rebuild the engines")

    if depth > MAX_RECIPE_DEPTH or not isinstance(r, dict):
        raise bad("a recipe is not an object or is nested too deeply")
    if "tensor" in r:
        if not isinstance(r["tensor"], str):
            raise bad(f"tensor {r['tensor']!r} is not a name")
        return
    op = r.get("op")
    if op not in RECIPE_OPS or any(k not in r for k in RECIPE_OPS[op]) or "of" not in r:
        raise bad(f"unknown recipe {str(r)[:60]!r}")
    ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)  # noqa: E731
    if (op == "cast" and r["to"] not in {d.numpy for d in TABLE}) or (op in ("transpose", "reshape") and not ints(
            r[RECIPE_OPS[op][0]])) or (op == "concat" and not (isinstance(r["axis"], int) and isinstance(r["of"], list))):
        raise bad(f"recipe {op} has bad arguments {str(r)[:60]!r}")
    for part in (r["of"] if op == "concat" else [r["of"]]):
        _check_recipe(part, where, depth + 1)


def read_map(path) -> dict:
    """A weight map file (untrusted: engine folders travel) with every field fluxtrt reads checked."""
    from ..dtypes import TABLE
    from ..fileio import read_json

    where = str(path)
    data = read_json(path, "a weight map", "rebuild the engines")
    ok = (isinstance(data, dict) and isinstance(data.get("refittable"), bool) and isinstance(data.get("subfolder"), str)
          and isinstance(data.get("weights"), list) and isinstance(data.get("reason", ""), str))
    if not ok:
        raise FluxtrtError(f"{where} is not a fluxtrt weight map (fields refittable, subfolder, weights); rebuild the "
                           "engines")
    for e in data["weights"]:
        if not (isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("shape"), list)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in e["shape"])
                and e.get("dtype") in {d.numpy for d in TABLE}):
            raise FluxtrtError(f"{where}: entry {str(e)[:80]!r} lacks a name, shape or known dtype; rebuild the engines")
        _check_recipe(e.get("recipe"), where)
    return data


def materialize(weight_map: dict, get) -> dict:
    """name -> array for every weight of the map, checked against the recorded shape and dtype."""
    out = {}
    for e in weight_map["weights"]:
        try:
            arr = evaluate(e["recipe"], get)
        except (ValueError, TypeError, IndexError) as err:
            raise FluxtrtError(f"weight {e['name']}: the weight map's recipe does not apply to your checkpoint "
                               f"({type(err).__name__}: {str(err).splitlines()[0][:80]}); rebuild the engines") from None
        if list(arr.shape) != e["shape"]:
            raise FluxtrtError(f"weight {e['name']}: your checkpoint gives shape {list(arr.shape)}, the engine "
                               f"was built with {e['shape']}; the checkpoint's architecture differs")
        if arr.dtype != np_dtype(e["dtype"]):
            arr = cast(arr, e["dtype"])
        out[e["name"]] = arr
    return out


# Where a weight-free ONNX says its mapped weights are: nowhere on disk; fluxtrt fills them from the
# checkpoint through the weight map (ONNX Runtime: as session initializers; TensorRT: by refit).
CHECKPOINT_LOCATION = "fluxtrt-weights-from-checkpoint"


def write_weightfree(onnx_path, weight_map: dict, dest) -> int:
    """Write the optimized graph without the weights the map can rebuild (graph constants stay inline).
    Returns the bytes written."""
    from ..fileio import write_bytes_atomic
    from ..onnxio import load_onnx, set_external

    mapped = {e["name"] for e in weight_map["weights"]}
    model = load_onnx(onnx_path, skip=mapped)  # the graph's own constants inline, the weights not read
    for t in model.graph.initializer:
        if t.name in mapped:
            set_external(t, CHECKPOINT_LOCATION, 0, 0)
    data = model.SerializeToString()
    write_bytes_atomic(dest, data)
    return len(data)
