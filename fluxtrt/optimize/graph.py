"""The optimize stage: run named passes over an exported ONNX, place precision, write it atomically, and
report node counts per pass and TensorRT layer counts before/after (TensorRT-RTX parses on CPU)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FluxtrtError
from .passes import DEFAULT_PASSES, PASSES
from .placement import place_precision


@dataclass
class OptimizeReport:
    component: str
    rows: list = field(default_factory=list)  # (pass, nodes before, nodes after, seconds)
    trt_layers_before: int | None = None
    trt_layers_after: int | None = None
    path: Path | None = None
    zero_copy: dict | None = None  # optimize_zero_copy: tensors still linked, and those written with why


WHY_WRITTEN = {"cast": "a vector cast for an op that computes in fp32 (RMSNorm's scale)",
               "concat": "a fused projection's joined bias", "tensor": "a vector read from the checkpoint as stored",
               "reshape": "a vector reshaped for its op", "transpose": "a vector transposed for its op"}


def linked_summary(model) -> dict:
    """Which initializers of a linked graph stay links and which are written into it (with their recipe's why)."""
    from ..core import weightmap
    from ..onnxio import external_info

    prov = weightmap.read(model)
    linked = [t for t in model.graph.initializer if external_info(t) is not None]
    written = {}
    for t in model.graph.initializer:
        if external_info(t) is None and t.name in prov:
            why = WHY_WRITTEN.get(prov[t.name].get("op", "tensor"), prov[t.name].get("op"))
            entry = written.setdefault(why, {"tensors": 0, "bytes": 0})
            entry["tensors"] += 1
            entry["bytes"] += len(t.raw_data)
    return {"linked_tensors": len(linked),
            "linked_bytes": sum(int(external_info(t).get("length", 0)) for t in linked), "written": written}


def check_passes(names) -> list[str]:
    names = list(names or DEFAULT_PASSES)
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise FluxtrtError(f"unknown pass(es) {', '.join(unknown)}; available: {', '.join(PASSES)}")
    return names


def optimize_model(model, passes=None, dtype: str | None = "fp32", component: str = "",
                   report: OptimizeReport | None = None):
    """ModelProto -> optimized ModelProto (passes on graphsurgeon, then precision placement on the proto;
    dtype None: the graph is already in its dtype, as a zero-copy graph is)."""
    import onnx_graphsurgeon as gs

    from ..core import weightmap

    report = report or OptimizeReport(component)
    prov = weightmap.read(model)
    with weightmap.tracking(prov):
        graph = gs.import_onnx(model)
        for name in check_passes(passes):
            before, t0 = len(graph.nodes), time.perf_counter()
            graph = PASSES[name](graph)
            report.rows.append((name, before, len(graph.nodes), time.perf_counter() - t0))
        out = gs.export_onnx(graph)
        if dtype is not None:
            before = len(out.graph.node)
            t0 = time.perf_counter()
            out = place_precision(out, dtype, component)
            report.rows.append((f"precision:{dtype}", before, len(out.graph.node), time.perf_counter() - t0))
    weightmap.write(out, prov)
    out.producer_name = model.producer_name
    out.producer_version = model.producer_version
    return out, report


def save_model(model, path: Path, external_threshold: int = 1_800_000_000) -> None:
    """Write atomically; weights go to `<name>.data` beside it when the model is large."""
    import onnx

    from ..fileio import publish, staging_dir

    path = Path(path)
    with staging_dir(path.parent, path.stem) as tmp:
        external = model.ByteSize() > external_threshold if model.ByteSize() >= 0 else True
        onnx.save(model, str(tmp / path.name), save_as_external_data=external,
                  location=f"{path.name}.data" if external else None)
        publish(sorted(tmp.iterdir(), key=lambda p: p.suffix == ".onnx"), path.parent)


def optimize_zero_copy(in_path: Path, out_path: Path, component: str, passes=None) -> OptimizeReport:
    """The passes on a zero-copy graph, its matrices never read (onnxio.load_linked): rewrites of a linked
    weight are graph operations TensorRT folds at build time; vectors the passes change (a norm scale cast to
    fp32, q/k/v biases joined) are written into the graph, each with its recipe in the weight map. The output
    links into the same checkpoint files. Atomic: nothing appears unless all of it is written."""
    import onnx

    from ..fileio import publish, staging_dir
    from ..onnxio import copy_links, load_linked

    report = OptimizeReport(component)
    optimized, report = optimize_model(load_linked(in_path), passes, None, component, report)
    out_path = Path(out_path)
    with staging_dir(out_path.parent, out_path.stem) as tmp:
        onnx.save(optimized, str(tmp / out_path.name))
        copy_links(in_path, tmp / out_path.name)
        publish(sorted(tmp.iterdir(), key=lambda p: p.suffix == ".onnx"), out_path.parent)
    report.path = out_path
    report.zero_copy = linked_summary(optimized)
    return report


def trt_layer_count(onnx_path: Path) -> int | None:
    """Layers of the network TensorRT-RTX parses from the file (None without tensorrt-rtx)."""
    try:
        from ..core.backends import TensorRTRTX

        backend = TensorRTRTX()
        trt = backend.trt
    except FluxtrtError:
        return None
    builder = trt.Builder(backend.logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, backend.logger)
    if not parser.parse_from_file(str(onnx_path)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise FluxtrtError(f"TensorRT-RTX cannot parse {onnx_path}: {errs}")
    return network.num_layers


def optimize_file(in_path: Path, out_path: Path, component: str, passes=None, dtype: str = "fp32",
                  *, count_layers: bool = True) -> OptimizeReport:
    from ..onnxio import load_onnx

    report = OptimizeReport(component)
    model = load_onnx(in_path)
    optimized, report = optimize_model(model, passes, dtype, component, report)
    save_model(optimized, out_path)
    report.path = Path(out_path)
    if count_layers:
        report.trt_layers_before = trt_layer_count(in_path)
        report.trt_layers_after = trt_layer_count(out_path)
    return report
