"""What every stage shares: its result row, its record (`export.json` / `optimize.json` beside the outputs),
the one reuse check, and the check of a stage's ONNX against PyTorch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import __version__
from ..components import specs_for
from ..errors import FluxtrtError, ValidationError
from ..export import DEFAULT_OPSET
from ..fileio import peak_rss_mb, sha256_file
from ..records import StageInfo, StageRecord

OPTIMIZE_INFO = "optimize.json"


@dataclass
class StageResult:
    component: str
    stage: str  # "export", "optimize", "quantize" (quantized precisions) or "build"
    status: str  # "built", "reused" (or "skipped": a stage with nothing to do)
    seconds: float
    detail: str = ""
    bytes_written: int = 0
    peak_rss_mb: float = 0.0  # the process's peak RSS when the stage ended (a running maximum)
    info: dict | None = None  # quantize: the quantization record; optimize (zero-copy): what it wrote and why

    def footprint(self) -> dict:
        out = {"status": self.status, "seconds": round(self.seconds, 3), "bytes_written": self.bytes_written,
               "peak_rss_mb": round(self.peak_rss_mb, 1)}
        if self.info and self.stage == "optimize":
            out["zero_copy"] = self.info
        return out


def files_bytes(onnx_path: Path) -> int:
    """Bytes of an ONNX file and its external data."""
    data = Path(f"{onnx_path}.data")
    return onnx_path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def unchanged(path: Path, recorded_sha256: str | None, recorded_inputs: dict, inputs: dict) -> bool:
    """The one reuse rule of every stage, the engine's included: the output still exists with the hash its record
    gives, and every input that decides it is what the record says it was made from."""
    if recorded_sha256 is None or not Path(path).exists() or sha256_file(path) != recorded_sha256:
        return False
    return all(recorded_inputs.get(k) == v for k, v in inputs.items())


def recorded(folder: Path, info_name: str, component: str, inputs: dict, validate: bool = False) -> StageRecord | None:
    """The record of `component` in `folder/info_name` if the stage can be reused (`unchanged`: against an
    optimize.json entry's own `inputs`, or export.json's header) and, when `validate` asks for it, it was
    validated against PyTorch."""
    info = StageInfo.read(folder / info_name)
    entry = info.components.get(component)
    if entry is None:
        return None
    depends = entry.inputs if entry.inputs is not None else info.header
    if not unchanged(folder / f"{component}.onnx", entry.sha256, depends, inputs):
        return None
    return None if validate and entry.max_rel_err is None else entry


def export_inputs(model_hash: str, opset: int = DEFAULT_OPSET) -> dict:
    """What an export depends on, as export.json records it (recorded() compares them)."""
    return {"model_hash": model_hash, "fluxtrt": __version__, "opset": opset}


def validation_text(max_err: float | None) -> str:
    return f"max rel err {max_err:.1e}" if max_err is not None else "not validated"


def record_entry(folder: Path, component: str, entry: StageRecord) -> None:
    """Set `component`'s record in `folder/optimize.json` (written atomically)."""
    info = StageInfo.read(folder / OPTIMIZE_INFO)
    info.components[component] = entry
    info.write(folder / OPTIMIZE_INFO)


def prompts_sha256(calib) -> str:
    """The calibration prompts' hash (a calibrated stage's input); a missing file is one clear line."""
    path = calib.prompts_path()
    try:
        return sha256_file(path)
    except OSError as e:
        raise FluxtrtError(f"cannot read the calibration prompts {path}: {e.strerror}; pass a prompt file with "
                           "--calibration-prompts (one prompt per line)") from None


def calibration_inputs(calib) -> dict:
    """What a calibrated stage's output depends on (both plans' reuse keys): the prompts, their count and steps,
    the resolution they are run at, and SmoothQuant's alpha (int8)."""
    return {"prompts_sha256": prompts_sha256(calib), "size": calib.size, "steps": calib.steps,
            "opt_resolution": calib.opt_resolution, "alpha": calib.alpha}


@dataclass
class Step:
    """One recorded stage of a plan, stated by the plan: where its output goes (`folder/<component>.onnx`),
    the inputs that decide reuse, how to make it, and how to describe it. `run_step` does the rest."""

    stage: str  # "export", "optimize" or "quantize"
    folder: Path
    inputs: dict
    make: Callable  # () -> Made
    dtype: str  # the dtype the output is validated at
    what: str  # the validation's label ("optimized (zero-copy)", ...)
    reused: str  # the reason said when reused
    reusable: Callable = None  # (folder, info, component, inputs, validate) -> StageRecord | None; default recorded
    info_name: str = OPTIMIZE_INFO  # the record file in `folder` (export: export.json)
    write: Callable = None  # (Made, max_rel_err) -> None: writes the record; default record_entry in optimize.json
    phase: str = ""  # what on_phase is told (default: the stage)


@dataclass
class Made:
    """What a step's `make` returns: the output, the record's extra fields, the detail line, and results of
    sub-stages it ran inside it (the copying plan quantizes inside its optimize step)."""

    path: Path
    record: dict = field(default_factory=dict)  # StageRecord fields besides inputs / sha256 / max_rel_err
    detail: str = ""
    info: dict | None = None  # the StageResult's info
    extra: list = field(default_factory=list)  # more StageResults
    seconds_excluded: float = 0.0  # time of `extra`, not this stage's
    bytes: int | None = None  # bytes written, where they are not the output's files (a zero-copy graph's links)
    module: object = None  # the fp32 PyTorch module `make` already holds (the export's): validation reuses it


def run_step(source, component: str, step: Step, *, force: bool, on_phase, validate: bool):
    """The one stage runner of both plans: reuse `step`'s recorded output when its inputs are unchanged, else
    make, validate (deleting a graph that fails) and record it. Returns (path, the reused record or None, the
    made step's [StageResult, ...] or None): the plan says what a reused step reports."""
    import time

    reusable = step.reusable or recorded
    entry = None if force else reusable(step.folder, step.info_name, component, step.inputs, validate)
    if entry:
        return step.folder / f"{component}.onnx", entry, None
    on_phase(step.phase or step.stage)
    t0 = time.perf_counter()
    made = step.make()
    max_err = validated_or_removed(source, component, made.path, step.dtype, step.what, validate=validate,
                                   on_phase=on_phase, module=made.module)
    made.module = None  # a full-size module is not kept alive by the result
    if step.write is not None:
        step.write(made, max_err)
    else:
        record_entry(step.folder, component, StageRecord(inputs=step.inputs, sha256=sha256_file(made.path),
                                                         max_rel_err=max_err, **made.record))
    seconds = time.perf_counter() - t0 - made.seconds_excluded
    detail = ", ".join(x for x in (made.detail, validation_text(max_err)) if x)
    written = files_bytes(made.path) if made.bytes is None else made.bytes
    result = StageResult(component=component, stage=step.stage, status="built", seconds=seconds, detail=detail,
                         bytes_written=written, peak_rss_mb=peak_rss_mb(), info=made.info)
    return made.path, None, [result, *made.extra]


def export_step(source, component: str, folder: Path, dtype: str, *, zero_copy: bool, on_phase,
                reusable: Callable = None, opset: int = DEFAULT_OPSET, exported: list | None = None,
                **export_options) -> Step:
    """Every export (`fluxtrt export` and both plans'), as a step: the component's graph at `dtype` into `folder`
    (zero-copy: weights linked into the checkpoint, the model identified by its layout), validated by the runner
    against the module the export traced, recorded in export.json (or, with `exported`, the ExportResults are
    collected there and the caller writes export.json once). `export_options`: export_component's own (tests:
    external_data_bytes, replicate_blocks)."""
    from ..export import EXPORT_INFO, export_component, write_export_info

    spec = specs_for(source.geometry, [component])[component]
    results = [] if exported is None else exported

    def make() -> Made:
        res = export_component(source, spec, folder, dtype, opset, on_phase=on_phase, zero_copy=zero_copy,
                               **export_options)
        results.append(res)
        made = Made(res.path, detail="zero-copy" if zero_copy else "", bytes=res.bytes, module=res.module)
        res.module = None
        return made

    def write(made: Made, max_err) -> None:
        results[-1].max_rel_err = max_err
        if exported is None:
            write_export_info(folder, source, dtype, opset, results, zero_copy=zero_copy)

    model_hash = source.layout_hash if zero_copy else source.content_hash
    return Step(stage="export", folder=folder, inputs=export_inputs(model_hash, opset), make=make, dtype=dtype,
                what="exported", reused="unchanged checkpoint (zero-copy)" if zero_copy else "unchanged model and exporter",
                reusable=reusable, info_name=EXPORT_INFO, write=write,
                phase="export (zero-copy)" if zero_copy else "export")


def validated_or_removed(source, component: str, onnx_path: Path, dtype: str, what: str, *, validate: bool,
                         on_phase, module=None) -> float | None:
    """validate_against_pytorch when `validate`; a graph that fails is deleted with its external data (never left
    for a later build to pick up) and the error raised. None when not validated."""
    if not validate:
        return None
    on_phase("validate")
    try:
        return validate_against_pytorch(source, component, onnx_path, dtype, what, module=module)
    except FluxtrtError:
        for path in (Path(onnx_path), Path(f"{onnx_path}.data")):
            path.unlink(missing_ok=True)
        raise


def validate_against_pytorch(source, component: str, onnx_path: Path, dtype: str, what: str, *, module=None) -> float:
    """The one check of a stage's ONNX: ONNX Runtime on `onnx_path` vs the fp32 PyTorch module (`module`, or loaded
    from the checkpoint) at `dtype`'s bound; returns the max relative error or raises ValidationError."""
    from ..compare import validate_onnx
    from ..export.trace import export_patches

    spec = specs_for(source.geometry, [component])[component]
    module = module if module is not None else spec.wrap(source.load_component(spec.subfolder)).eval()
    with export_patches(module):
        check = validate_onnx(onnx_path, module, spec, source.geometry, dtype)
    if not check.ok:
        raise ValidationError(f"{what} {component} ({dtype}) disagrees with PyTorch: " + "; ".join(check.failures()))
    return check.max_rel_err

