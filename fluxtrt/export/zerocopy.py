"""Zero-copy export: trace a component whose parameters are never materialised (they live on PyTorch's
`meta` device) and write ONNX initializers as external data that points straight into the model folder's own
safetensors files (ONNX external data = file, offset, length; safetensors stores each tensor raw at a known
offset). Nothing of the checkpoint is read into memory or copied to disk.

Layout: `<out>/<component>.onnx` beside `<out>/<component>.weights/`, a folder of symbolic links to the
checkpoint's shards (external data locations are relative to the ONNX file). Weight transforms the exporter
would apply (linear weights transposed) stay graph operations on the original initializer (`Transpose`), which
TensorRT folds at build time; the dtype on disk is the ONNX type exactly (a bf16 checkpoint gives a bf16
graph). The only tensors written are the module's buffers that the checkpoint does not hold (e.g. CLIP's
position ids); export.json lists them with the reason.

The checkpoint is never written: the links are read-only inputs, and every later stage that loads the graph
(`onnxio.load_onnx`) writes its own output elsewhere."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import StoredTensor, check_stored, link, missing_tensor
from ..onnxio import load_header


@dataclass
class ZeroCopyRecord:
    linked: int = 0
    linked_bytes: int = 0
    graph_constants: int = 0
    written: dict = field(default_factory=dict)  # initializer -> why it had to be written
    graph: str = "traced"  # or "from cache": the architecture's traced graph, re-pointed at this checkpoint
    replicated: dict = field(default_factory=dict)  # block family -> depth grown to from 3 traced (replicate.py)

    def as_json(self) -> dict:
        return {"linked_tensors": self.linked, "linked_bytes": self.linked_bytes,
                "graph_constants": self.graph_constants, "written": self.written, "graph": self.graph,
                "replicated_blocks": self.replicated}


@contextlib.contextmanager
def meta_parameters():
    """Build modules with every parameter on the `meta` device (no memory) and buffers real (they are small,
    and the checkpoint may not hold them)."""
    import torch

    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def empty_component(folder: Path, subfolder: str, dtype, overrides: dict | None = None):
    """(module with meta parameters, {buffer name: real tensor}) built from the component's config
    (`overrides` replaces config entries: block replication traces a shallower model)."""
    import torch

    from ..models.random_arch import instantiate

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with meta_parameters(), torch.no_grad():
            model = instantiate(subfolder, folder, overrides)
    finally:
        torch.set_default_dtype(old)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    return model.to("meta").eval(), buffers


def parameter_aliases(module) -> dict[str, list[str]]:
    """Tied parameters (T5's shared / embed_tokens): every name of each parameter object."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: names for names in by_id.values() for n in names}


def stored_key(name: str, aliases: dict, index) -> str | None:
    """The key under which the checkpoint stores parameter `name` (itself or a tied alias)."""
    if name in index:
        return name
    return next((a for a in aliases.get(name, []) if a in index), None)


def is_meta(tensor) -> bool:
    raw = getattr(tensor, "raw", None)
    return getattr(getattr(raw, "device", None), "type", None) == "meta"


def link_initializers(ir_model, module, index: dict[str, StoredTensor], buffers: dict,
                      onnx_path: Path) -> ZeroCopyRecord:
    """Point every parameter initializer of the traced graph at its bytes in the checkpoint (through links in
    `<stem>.weights/`); give buffers their real values. Names must match the checkpoint exactly."""
    import numpy as np
    import onnx_ir as ir

    from ..onnxio import linked_dir

    links = linked_dir(onnx_path)
    links.mkdir(exist_ok=True)
    aliases = parameter_aliases(module)
    record = ZeroCopyRecord()
    for name, value in list(ir_model.graph.initializers.items()):  # named by checkpoint key at export
        stored_name = stored_key(name, aliases, index)
        stored = index.get(stored_name) if stored_name else None
        shape = tuple(int(d) for d in value.shape)
        if stored is not None:
            check_stored(name, stored, shape, value.dtype.name)
            value.const_value = ir.ExternalTensor(
                link(links, stored), stored.offset, stored.length, value.dtype,
                shape=ir.Shape(shape), name=name, base_dir=str(onnx_path.parent))
            record.linked += 1
            record.linked_bytes += stored.length
        elif name in buffers:
            value.const_value = ir.tensor(np.ascontiguousarray(buffers[name].numpy()), name=name)
            record.written[name] = "a buffer the module computes; the checkpoint does not store it"
        elif not is_meta(value.const_value):
            record.graph_constants += 1  # folded shape arithmetic and the like: the graph's own, not weights
        else:
            raise missing_tensor(index, name)
    return record


# --- graph templates: a traced zero-copy graph depends on the architecture, not on the weights ----------------
# Bump when the traced graph's recipe changes, so templates cached by older versions are not reused.
GRAPH_RECIPE = 2
_VOLATILE_CONFIG_KEYS = {"architectures", "transformers_version", "torch_dtype", "dtype"}


def template_key(folder: Path, spec, geo, opset: int, dtype: str) -> str:
    """Everything the traced graph depends on: the component's architecture config (without bookkeeping keys
    such as `_name_or_path`), the model geometry, the spec, dtype, opset and tool versions."""
    import dataclasses

    import onnxscript
    import torch

    from .. import __version__
    from ..fileio import sha256_json

    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    return sha256_json({
        "config": cfg, "geometry": dataclasses.asdict(geo), "component": spec.name,
        "inputs": [(t.name, list(t.dims)) for t in spec.inputs], "dtype": dtype, "opset": opset,
        "versions": [__version__, torch.__version__, onnxscript.__version__, GRAPH_RECIPE],
    })


def template_path(key: str) -> Path:
    from ..models.tiny import cache_root

    return cache_root() / "graphs" / f"{key}.onnx"


def save_template(onnx_file: Path, record: ZeroCopyRecord, key: str) -> None:
    """Keep a traced zero-copy graph (a few MB at full size, no weights) for the next export of this architecture."""
    from ..fileio import write_bytes_atomic, write_json_atomic

    path = template_path(key)
    write_bytes_atomic(path, Path(onnx_file).read_bytes(), check_free=False)
    write_json_atomic(path.with_suffix(".json"), {"written": record.written, "graph_constants": record.graph_constants,
                                                  "replicated": record.replicated})


def relink(key: str, index: dict[str, StoredTensor], onnx_path: Path) -> ZeroCopyRecord | None:
    """The cached template of this architecture with every weight re-pointed at this checkpoint's shards
    (names, dtypes and shapes checked); None when there is no template yet."""
    import onnx

    from ..core import weightmap
    from ..onnxio import external_info, linked_dir, set_external

    template = template_path(key)
    if not template.exists() or not template.with_suffix(".json").exists():
        return None
    model = load_header(template)
    meta = json.loads(template.with_suffix(".json").read_text())
    prov = weightmap.read(model)
    links = linked_dir(onnx_path)
    links.mkdir(exist_ok=True)
    record = ZeroCopyRecord(graph_constants=meta["graph_constants"], written=meta["written"], graph="from cache",
                            replicated=meta.get("replicated", {}))
    for t in model.graph.initializer:
        if external_info(t) is None:
            continue
        key_in_ckpt = prov.get(t.name, {}).get("tensor")
        stored = index.get(key_in_ckpt) if key_in_ckpt else None
        if stored is None:
            raise missing_tensor(index, key_in_ckpt or t.name)
        check_stored(key_in_ckpt, stored, tuple(t.dims), onnx.TensorProto.DataType.Name(t.data_type))
        set_external(t, link(links, stored), stored.offset, stored.length)
        record.linked += 1
        record.linked_bytes += stored.length
    onnx.save(model, str(onnx_path))
    return record
