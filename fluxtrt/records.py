"""Typed records fluxtrt writes beside its outputs and reads back: the engine folder's `manifest.json`
(`Manifest`, one `ComponentEntry` per engine) and the calibration settings a quantized build depends on.
Each has `to_json` / `from_json`; the manifest carries a schema version, and one written by another schema
is refused with one line saying to rebuild. The runtime trusts an engine only if its sha256 matches its entry."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import (
    FluxtrtError,
    ManifestError,  # noqa: F401 - defined in errors.py, raised here
)

MANIFEST = "manifest.json"
RUNTIME_KEYS = {"torch", "cuda", "target", "libstdc++"}  # Manifest.runtime's keys ("libstdc++" since packages record it)
SCHEMA = 2  # manifest schema 2: typed records; 1: the earlier dict manifest (same fields)
READABLE_SCHEMAS = (1, 2)  # schema 1 has the same fields: read as is
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts.txt"  # in the wheel; calibration/ links to it


LOW_VRAM_STAGES = (("clip", "t5"), ("transformer",), ("vae_decoder",))  # engines resident together with --low-vram
RUN_COMPONENTS = tuple(c for stage in LOW_VRAM_STAGES for c in stage)  # what text-to-image runs, in order
IMAGE_COMPONENTS = ("vae_encoder",)  # what the image workflows (img2img, Fill, Control, Kontext) add


@dataclass(frozen=True)
class CalibrationSettings:
    """What a calibrated recipe's activation ranges depend on (the defaults live here and nowhere else)."""

    size: int = 32  # prompts taken from the file
    steps: int = 4  # denoising steps per prompt
    prompts_file: Path | None = None  # None: the prompts shipped with fluxtrt
    alpha: float = 0.5  # int8 SmoothQuant migration strength
    opt_resolution: int = 1024  # the profile's opt size (a smaller non-square size is added)
    device: str | None = None  # zero-copy path: where PyTorch runs (None: cuda if present)

    def prompts_path(self) -> Path:
        return Path(self.prompts_file or DEFAULT_PROMPTS)

    def check(self) -> "CalibrationSettings":
        if self.size < 1 or self.steps < 1:
            raise FluxtrtError("--calibration-size and --calibration-steps must be at least 1")
        if not 0.0 <= self.alpha <= 1.0:
            raise FluxtrtError(f"--smoothquant-alpha must be in 0..1, got {self.alpha}")
        if not isinstance(self.opt_resolution, int) or not 256 <= self.opt_resolution <= 4096 or self.opt_resolution % 16:
            raise FluxtrtError(f"--resolution must be a multiple of 16 in 256..4096, got {self.opt_resolution}")
        if self.size > 100_000 or self.steps > 1000:
            raise FluxtrtError("--calibration-size is at most 100000 prompts and --calibration-steps at most 1000")
        if self.device not in (None, "cpu", "cuda"):
            raise FluxtrtError(f"--device {self.device}: choose cpu or cuda")
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise FluxtrtError(f"calibration prompts {self.prompts_file} not found; pass an existing file with "
                               "--calibration-prompts (one prompt per line)")
        return self

    def replace(self, **changes) -> "CalibrationSettings":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}


class JsonRecord:
    """to_json / from_json of a flat dataclass record (unknown keys of a newer writer are ignored)."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict):
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclass
class ComponentEntry(JsonRecord):
    """One engine of a GPU folder: the file, what built it from what, its I/O and profile."""

    engine: str
    sha256: str
    bytes: int
    precision: str
    onnx: str  # relative to the build root (OUT/)
    onnx_sha256: str
    build_key: str
    layers: int
    inputs: list
    outputs: list
    profile: dict
    weight_streaming: bool = False
    weightless: bool = False
    build_seconds: float = 0.0
    peak_rss_mb: float = 0.0
    stages: dict = field(default_factory=dict)  # stage -> {status, seconds, bytes_written, peak_rss_mb}
    quantization: dict | None = None
    weight_map: str | None = None
    refittable: bool = False
    weightfree_onnx: str | None = None
    weightfree_sha256: str | None = None
    memory: dict | None = None  # device memory the builder reported: activations (profile max), weights, persistent
    computed_layers: int | None = None  # layers that depend on an input (engine.build.computed_layers)
    # the quantization recipe's numbers a runtime needs to compute it (fp8: {"name", "scales": {module: [sx, sw]}};
    # fp8-attn adds "attention": [[sq, sk, sp, sv], ...], one per attention in forward order, and for packages
    # built on Hopper "attention_kernel": "flashinfer" and "attention_module": {"file", "sha256", "flashinfer",
    # "head_dim"}, the FlashInfer kernel module shipped beside them),
    # recorded at build time so that an unpacked archive runs on every backend that computes the recipe
    recipe: dict | None = None
    constants: dict | None = None  # a compiled package's weights file: {"file", "tree_sha256", "bytes"}
    parallel: dict | None = None  # a package split over ranks (`build --parallel N`): {"ranks": N, "attention": mode}

    def dtype_of(self, tensor: str) -> str:
        for t in self.inputs + self.outputs:
            if t["name"] == tensor:
                return t["dtype"]
        raise KeyError(tensor)



@dataclass
class ModelRef:
    id: str
    hash: str
    variant: str
    model_class: str = "FluxPipeline"  # model_index.json's class: which workflows the engines serve


@dataclass
class Manifest:
    """`manifest.json` of one GPU folder."""

    fluxtrt: str
    backend: str
    backend_version: str
    gpu: str
    gpu_name: str
    compute_capability: str
    config_hash: str
    vram_gb: float
    model: ModelRef
    static_shape: bool
    shape_range: dict  # min / opt / max -> [batch, height, width]
    pixel_multiple: int
    components: dict[str, ComponentEntry] = field(default_factory=dict)
    workflows: list = field(default_factory=lambda: ["txt2img", "img2img"])  # what `fluxtrt run` can do with them
    pending: list = field(default_factory=list)  # components the build was asked for and has not finished yet
    runtime: dict | None = None  # compiled PyTorch packages: the torch, CUDA, device and libstdc++ they need
    # (RUNTIME_KEYS; core/packages.package_runtime)
    schema: int = SCHEMA

    @property
    def sm(self) -> str:
        return "cpu" if self.compute_capability == "cpu" else "sm" + self.compute_capability.replace(".", "")

    def missing(self, names) -> list:
        """Which of `names` have no engine here (e.g. the build was stopped before them)."""
        return [n for n in names if n not in self.components]

    def lacking(self, names, folder="the engine folder") -> ManifestError:
        """The one line for engines `names` that are not here: an unfinished build (the manifest's `pending`) is
        finished by running the same build again; others are built with --components; either runs in PyTorch."""
        have = ", ".join(self.components) or "none"
        stopped = any(n in self.pending for n in names)
        what = "is an unfinished build: it has" if stopped else "has"
        fix = ("run the same `fluxtrt build` again to finish it" if stopped
               else f"build them with `fluxtrt build --components {','.join(names)}`")
        return ManifestError(f"{folder} {what} no {', '.join(names)} engine(s) (it has {have}); {fix}, or pass "
                             f"--fallback {','.join(names)} to run them in PyTorch")

    def component(self, name: str) -> ComponentEntry:
        try:
            return self.components[name]
        except KeyError:
            raise self.lacking([name]) from None

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["components"] = {n: e.to_json() for n, e in self.components.items()}
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Manifest":
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        model = dict(data["model"]) if isinstance(data["model"], dict) else data["model"]
        if isinstance(model, dict) and "pipeline" in model:  # its name before 0.1.0's manifests said model_class
            model.setdefault("model_class", model.pop("pipeline"))
        kwargs["model"] = ModelRef(**model)
        kwargs["components"] = {n: ComponentEntry.from_json(e) for n, e in data["components"].items()}
        kwargs["schema"] = SCHEMA
        return cls(**kwargs)

    def memory_needed(self, low_vram: bool = False) -> int | None:
        """Device bytes the run pipeline's engines need (None when an engine lacks the builder's report):
        weights and persistent memory of the engines resident at once (all of them; with --low-vram the largest
        stage: CLIP+T5, the transformer, the VAE decoder), plus one activation buffer shared by all engines,
        sized for the largest engine at the profile's max shapes (TensorRT reserves the max, so a request at
        the opt shape needs the same)."""
        run = [self.components[c] for c in RUN_COMPONENTS if c in self.components]
        if not run or any(not e.memory for e in run):
            return None

        def resident(entries):
            return sum(e.memory.get("weights", 0) + e.memory.get("persistent", 0) for e in entries)

        stages = [[self.components[c] for c in stage if c in self.components] for stage in LOW_VRAM_STAGES]
        weights = max(resident(s) for s in stages) if low_vram else resident(run)
        return weights + max(e.memory.get("activations", 0) for e in run)

    def write(self, folder: Path) -> None:
        from .fileio import write_json_atomic

        write_json_atomic(Path(folder) / MANIFEST, self.to_json())


STAGE_SCHEMA = 1


@dataclass
class StageRecord(JsonRecord):
    """One component's entry in a stage's record beside its outputs (export.json, optimize.json): the output's
    hash, its check against PyTorch, and (optimize / quantize) the inputs it depends on."""

    sha256: str
    max_rel_err: float | None = None  # ONNX Runtime vs PyTorch; None: not validated
    inputs: dict | None = None  # optimize.json: what the output depends on (export.json keeps them at the top)
    quantization: dict | None = None
    nodes: list | None = None  # [before, after] the graph passes
    file: str | None = None
    bytes: int | None = None
    external_data: bool = False
    seconds: float | None = None
    dtype: str | None = None
    zero_copy: dict | None = None  # export: what a linked export points at



@dataclass
class StageInfo:
    """A stage's record file: header fields (export.json: model, model_hash, dtype, opset, ...) and one
    StageRecord per component. A file of another schema or an unreadable one reads as empty (nothing reused)."""

    header: dict = field(default_factory=dict)
    components: dict[str, StageRecord] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> "StageInfo":
        try:
            data = json.loads(Path(path).read_text())
            if data.get("schema") != STAGE_SCHEMA:
                return cls()
            comps = {n: StageRecord.from_json(e) for n, e in data.get("components", {}).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return cls()
        return cls({k: v for k, v in data.items() if k not in ("components", "schema")}, comps)

    def write(self, path: Path) -> None:
        from .fileio import write_json_atomic

        write_json_atomic(Path(path), {**self.header, "schema": STAGE_SCHEMA,
                                       "components": {n: r.to_json() for n, r in self.components.items()}})


def read_manifest(engine_dir: Path, required: bool = True) -> Manifest | None:
    path = Path(engine_dir) / MANIFEST
    if not path.exists():
        if required:
            hint = _subfolders_hint(Path(engine_dir))
            raise ManifestError(f"no {MANIFEST} in {engine_dir}; {hint or 'build engines first with `fluxtrt build`'}")
        return None
    from .fileio import read_json

    try:
        data = read_json(path, "a fluxtrt manifest", "rebuild with `fluxtrt build --force`", ManifestError)
    except ManifestError:
        if required:
            raise
        return None
    if not isinstance(data, dict) or not isinstance(data.get("components"), dict):
        if required:
            raise ManifestError(f"{path} is not a fluxtrt manifest; rebuild with `fluxtrt build`")
        return None
    if data.get("schema") not in READABLE_SCHEMAS:
        if required:
            raise ManifestError(f"{path} was written by another fluxtrt (manifest schema {data.get('schema')}, this "
                                f"one reads {', '.join(map(str, READABLE_SCHEMAS))}); rebuild with `fluxtrt build`")
        return None
    try:
        manifest = Manifest.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if required:
            raise ManifestError(f"{path} lacks {e} (written by an older fluxtrt?); rebuild with `fluxtrt build`") from None
        return None
    try:
        check_manifest(manifest, Path(engine_dir))
    except FluxtrtError as e:
        if required:
            raise ManifestError(f"{path}: {e}") from None
        return None
    return manifest


def _is_int(v, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def is_number(v) -> bool:
    """A finite JSON number (not a bool)."""
    import math

    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "list": list, "dict": dict}


def _has_type(value, annotation: str) -> bool:
    """Whether a JSON value fits a record field's annotation (`str`, `int | None`, `dict[str, X]`, ...); nested
    records (ModelRef, ComponentEntry) are checked on their own."""
    allowed = [a.strip().split("[")[0] for a in annotation.split("|")]
    if value is None:
        return "None" in allowed
    if not any(a in _TYPES for a in allowed):
        return True
    for a in allowed:
        kind = _TYPES.get(a)
        if kind is None:
            continue
        if a in ("int", "float") and isinstance(value, bool):
            continue
        if a == "float" and not is_number(value):
            continue
        if isinstance(value, kind):
            return True
    return False


def check_manifest(m: Manifest, folder: Path) -> None:
    """A manifest is untrusted input (engine folders and archives travel): every field the runtime reads has its
    type, and every path in it resolves inside the engine folder (ONNX paths inside the build root), links
    followed. One line naming the field otherwise."""
    from .fileio import inside

    def bad(what: str, value) -> FluxtrtError:
        return FluxtrtError(f"{what} is {value!r}, not what fluxtrt writes; rebuild or unpack the engines again")

    for record in (m, m.model, *m.components.values()):
        for f in dataclasses.fields(record):
            value = getattr(record, f.name)
            if not _has_type(value, str(f.type)):
                raise bad(f.name, value)
    sr = m.shape_range  # a dict and a list, as typed above; their contents here
    if any(not (isinstance(sr.get(k), list) and len(sr[k]) == 3 and all(_is_int(v, 1) for v in sr[k]))
           for k in ("min", "opt", "max")):
        raise bad("shape_range", sr)
    if not _is_int(m.pixel_multiple, 1):
        raise bad("pixel_multiple", m.pixel_multiple)
    if m.runtime is not None and not (
            isinstance(m.runtime, dict) and {"torch", "cuda", "target"} <= set(m.runtime) <= RUNTIME_KEYS
            and all(v is None or isinstance(v, str) for v in m.runtime.values())
            and re.fullmatch(r"(\d+\.\d+\.\d+)?", m.runtime.get("libstdc++") or "")):
        raise bad("runtime", m.runtime)
    for key in ("workflows", "pending"):
        if not all(isinstance(v, str) for v in getattr(m, key)):
            raise bad(key, getattr(m, key))
    for name, e in m.components.items():
        shapes_ok = all(isinstance(k, str) and isinstance(v, dict) and all(
            isinstance(v.get(p), list) and all(_is_int(d) for d in v[p]) for p in ("min", "opt", "max"))
            for k, v in e.profile.items())
        tensors_ok = all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
                         for t in e.inputs + e.outputs)
        memory_ok = e.memory is None or all(is_number(v) for v in e.memory.values())
        if not (shapes_ok and tensors_ok and memory_ok and _is_int(e.bytes) and _is_int(e.layers)):
            raise bad(f"component {name!r}", "its profile, tensors or sizes")
        if e.recipe is not None and not _recipe_ok(e.recipe):
            raise bad(f"component {name!r} recipe", "not a recipe of scales")
        module = (e.recipe or {}).get("attention_module")
        if module is not None:  # fp8-attn packages built on Hopper: FlashInfer's kernel module beside them
            if not (isinstance(module, dict) and isinstance(module.get("file"), str)
                    and re.fullmatch(r"[0-9a-f]{64}", str(module.get("sha256"))) and isinstance(module.get("flashinfer"), str)
                    and _is_int(module.get("head_dim")) and module["head_dim"] > 0):
                raise bad(f"component {name!r} attention_module", module)
            inside(folder, module["file"], f"{name}.attention_module")
        if e.constants is not None:
            c = e.constants
            if not (isinstance(c.get("file"), str) and isinstance(c.get("tree_sha256"), str) and _is_int(c.get("bytes"))):
                raise bad(f"component {name!r} constants", c)
            inside(folder, c["file"], f"{name}.constants")
        inside(folder, e.engine, f"{name}.engine")
        if e.onnx or m.backend != "torch":  # compiled PyTorch packages have none
            inside(build_root(folder), e.onnx, f"{name}.onnx")
        for what, rel in (("weight_map", e.weight_map), ("weightfree_onnx", e.weightfree_onnx)):
            if rel is not None:
                inside(folder, rel, f"{name}.{what}")


def _recipe_ok(recipe: dict) -> bool:
    """A recorded recipe: its name and its scales by module, each pair finite and positive; fp8-attn's attention
    scales too (a list, in forward order, of four finite positive numbers each)."""
    import math

    def scales_ok(v, n):
        return isinstance(v, list) and len(v) == n and all(is_number(x) and math.isfinite(x) and x > 0 for x in v)

    scales, attention = recipe.get("scales"), recipe.get("attention", [])
    return (isinstance(recipe.get("name"), str) and isinstance(scales, dict)
            and all(isinstance(k, str) and scales_ok(v, 2) for k, v in scales.items())
            and isinstance(attention, list) and all(scales_ok(v, 4) for v in attention))


def build_root(engine_dir: Path) -> Path:
    """The build root of a GPU folder: its parent once links are followed (an engine folder reached through a
    symbolic link still finds its build's onnx/)."""
    return Path(engine_dir).resolve().parent


def built_onnx(engine_dir: Path, entry: ComponentEntry) -> Path:
    """The ONNX an engine was built from, in the build root."""
    return build_root(engine_dir) / entry.onnx


def _subfolders_hint(folder: Path) -> str:
    """For a build root (OUT/) instead of OUT/<gpu>: name the GPU folders it holds."""
    try:
        gpus = sorted(p.name for p in folder.iterdir() if (p / MANIFEST).is_file())
    except OSError:
        return ""
    if not gpus:
        return ""
    return (f"it is a build root holding {', '.join(gpus)}: pass one of them, e.g. "
            f"--engines {folder / gpus[0]}")


@dataclass(frozen=True)
class BuildRequest:
    """One `fluxtrt build`, made once (by the CLI or `api.build`) and passed down whole: what to build for which
    target, and how. `model` None is the embedded `tiny` (said in the build's notes)."""

    gpu: str | None = None  # a shipped config's name, or
    config: Path | None = None  # a GPU config file
    model: str | None = None
    out_dir: Path = Path("engines")
    components: tuple = ()  # names (empty: the five components)
    precision: tuple = ()  # `-p` values
    static_shape: bool | None = None  # None: the config's choice
    force: bool = False  # rebuild every stage
    calibration: CalibrationSettings = CalibrationSettings()
    weightless: bool = False  # refittable engines without weights
    zero_copy: bool = True  # bf16 checkpoints built in place (False: the copying fp32 path for all)
    validate: bool = True  # every ONNX against PyTorch
    first_block_cache: bool = False  # also the transformer's First-Block Cache parts
    backend: str | None = None  # None: the config's; "torch": compiled PyTorch packages (AOTInductor) instead
    parallel: int = 1  # packages whose transformer runs split over this many ranks (`run --parallel N`)
    parallel_attention: str = "auto"  # how their attention sees the whole sequence (attention.attention_mode)

    @classmethod
    def of(cls, **fields) -> "BuildRequest":
        """From keyword arguments (lists for components / precision are taken as given, comma-split later)."""
        import dataclasses

        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise FluxtrtError(f"unknown build option(s) {', '.join(unknown)}")
        for key in ("components", "precision"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key]) if not isinstance(fields[key], str) else (fields[key],)
            else:
                fields.pop(key, None)
        if fields.get("calibration") is None:
            fields.pop("calibration", None)
        if fields.get("out_dir") is not None:
            fields["out_dir"] = Path(fields["out_dir"])
        return cls(**fields)
