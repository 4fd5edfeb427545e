"""GPU targets: `fluxtrt/data/configs/<gpu>.yaml` (the checkout's `configs/` links there; the wheel ships them),
loaded with a safe YAML loader and validated field by field."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from . import precisions
from .components import ALL as COMPONENTS
from .components import ShapePoint, ShapeRange
from .errors import ConfigError
from .fileio import sha256_json

BACKENDS = ("tensorrt-rtx", "tensorrt", "torch")  # torch: compiled PyTorch packages (AOTInductor, engine/aoti.py)
# Compute capabilities TensorRT-RTX 1.7 builds for (it refuses sm90: Hopper needs full TensorRT).
RTX_CAPABILITIES = ("8.0", "8.6", "8.9", "12.0", "12.1")
PIXEL_MULTIPLE = 16
TORCH_BF16_VAE = ("vae_decoder", "vae_encoder")  # fp32 in a config becomes bf16 with --backend torch on a GPU


def configs_dir() -> Path:
    return Path(os.environ.get("FLUXTRT_CONFIGS", Path(__file__).resolve().parent / "data" / "configs"))


def known_gpus() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


@dataclass(frozen=True)
class GpuConfig:
    key: str  # "4090", or the file stem of a custom config
    name: str
    compute_capability: str  # "8.9"
    vram_gb: float
    backend: str
    precision: dict
    weight_streaming: tuple = ()
    batch: tuple = (1, 1, 4)
    resolution: tuple = (256, 1024, 1536)
    static: bool = False
    builder_optimization_level: int = 3
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def sm(self) -> str:
        return "cpu" if self.compute_capability == "cpu" else "sm" + self.compute_capability.replace(".", "")

    def for_backend(self, backend: str | None) -> "GpuConfig":
        """The config built with another backend (`build --backend torch`: compiled PyTorch packages for this GPU,
        in their own folder `<gpu>-torch/`; weight streaming is TensorRT's). Compiled PyTorch on a GPU runs the VAE
        in bf16 where the config keeps fp32 for TensorRT, as diffusers' bf16 pipeline does: at 1024² its decoder's
        fp32 activations added 3.1 GB to the H100 packages' peak (`-p vae_decoder=fp32` keeps fp32)."""
        from dataclasses import replace

        if backend is None or backend == self.backend:
            return self
        if backend not in BACKENDS:
            raise ConfigError(f"--backend {backend}: a build takes {', '.join(BACKENDS)}")
        precision = dict(self.precision)
        if backend == "torch" and self.compute_capability != "cpu":
            precision.update({c: "bf16" for c in TORCH_BF16_VAE if precision.get(c) == "fp32"})
        _check_precisions(precision, f"{self.key} with --backend {backend}", self.compute_capability, backend)
        return replace(self, key=f"{self.key}-{backend}", backend=backend, weight_streaming=(), precision=precision,
                       raw={**self.raw, "backend": backend, "precision": precision})

    @property
    def config_hash(self) -> str:
        return sha256_json(self.raw)

    def shape_range(self, static: bool | None = None) -> ShapeRange:
        """The profile's min/opt/max request sizes; static pins all three to opt."""
        (bmin, bopt, bmax), (rmin, ropt, rmax) = self.batch, self.resolution
        opt = ShapePoint(bopt, ropt, ropt)
        if self.static if static is None else static:
            return ShapeRange(opt, opt, opt)
        return ShapeRange(ShapePoint(bmin, rmin, rmin), opt, ShapePoint(bmax, rmax, rmax))

    def with_precision(self, overrides: dict) -> "GpuConfig":
        """The config with some components' precision replaced (`precisions.apply_overrides` reads `-p`)."""
        from dataclasses import replace

        merged = {**self.precision, **overrides}
        raw = {**self.raw, "precision": merged}
        _check_precisions(merged, f"--precision for {self.key}", self.compute_capability, self.backend)
        return replace(self, precision=merged, raw=raw)


def _check_precisions(prec: dict, where: str, compute_capability: str | None = None,
                      backend: str | None = None) -> None:
    for comp, p in prec.items():
        precisions.check(comp, p, where, compute_capability, backend)


def _triple(raw, name: str, where: str, multiple: int = 1, top: int = 1 << 30) -> tuple[int, int, int]:
    if (not isinstance(raw, (list, tuple)) or len(raw) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw)):
        raise ConfigError(f"{where}: profile.{name} must be [min, opt, max] integers, got {raw!r}")
    lo, opt, hi = raw
    if not 1 <= lo <= opt <= hi <= top:
        raise ConfigError(f"{where}: profile.{name} needs 1 <= min <= opt <= max <= {top}, got {list(raw)}")
    if any(v % multiple for v in raw):
        raise ConfigError(f"{where}: profile.{name} values must be multiples of {multiple}, got {list(raw)}")
    return lo, opt, hi


def parse_config(data, key: str, where: str) -> GpuConfig:
    """Validate a config mapping; every problem is a ConfigError naming the file and the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    required = {"name": str, "compute_capability": str, "vram_gb": (int, float), "backend": str, "precision": dict}
    for f, typ in required.items():
        if f not in data:
            raise ConfigError(f"{where}: missing field '{f}'")
        if not isinstance(data[f], typ) or isinstance(data[f], bool):
            raise ConfigError(f"{where}: field '{f}' has the wrong type ({type(data[f]).__name__})")
    known = set(required) | {"weight_streaming", "profile", "builder_optimization_level"}
    extra = sorted(set(data) - known)
    if extra:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(extra)}; known fields: {', '.join(sorted(known))}")
    cc = data["compute_capability"]
    parts = cc.split(".")
    if cc == "cpu" and data["backend"] != "torch":
        raise ConfigError(f"{where}: compute_capability cpu is a target of backend: torch only (compiled PyTorch)")
    if cc != "cpu" and (len(parts) != 2 or not all(p.isdigit() for p in parts)):
        raise ConfigError(f"{where}: compute_capability must look like \"8.9\" (or cpu), got {cc!r}")
    if data["backend"] not in BACKENDS:
        raise ConfigError(f"{where}: backend must be one of {', '.join(BACKENDS)}, got {data['backend']!r}")
    if data["backend"] == "tensorrt-rtx" and cc not in RTX_CAPABILITIES:
        raise ConfigError(f"{where}: TensorRT-RTX cannot target compute capability {cc} (it builds for "
                          f"{', '.join(RTX_CAPABILITIES)}); use backend: tensorrt")
    if data["vram_gb"] <= 0 and cc != "cpu":
        raise ConfigError(f"{where}: vram_gb must be positive")
    _check_precisions(data["precision"], where, cc, data["backend"])
    missing = [c for c in COMPONENTS if c not in data["precision"]]
    if missing:
        raise ConfigError(f"{where}: precision lacks {', '.join(missing)}")
    ws = data.get("weight_streaming", [])
    if not isinstance(ws, list) or any(c not in COMPONENTS for c in ws):
        raise ConfigError(f"{where}: weight_streaming must be a list of components ({', '.join(COMPONENTS)})")
    prof = data.get("profile", {})
    if not isinstance(prof, dict) or set(prof) - {"batch", "resolution", "static"}:
        raise ConfigError(f"{where}: profile takes batch, resolution and static, got {prof!r}")
    batch = _triple(prof.get("batch", [1, 1, 4]), "batch", where, top=64)
    res = _triple(prof.get("resolution", [256, 1024, 1536]), "resolution", where, PIXEL_MULTIPLE, top=8192)
    static = prof.get("static", False)
    if not isinstance(static, bool):
        raise ConfigError(f"{where}: profile.static must be true or false")
    level = data.get("builder_optimization_level", 3)
    if not isinstance(level, int) or not 0 <= level <= 5:
        raise ConfigError(f"{where}: builder_optimization_level must be an integer 0-5")
    return GpuConfig(
        key=key, name=data["name"], compute_capability=cc, vram_gb=float(data["vram_gb"]), backend=data["backend"],
        precision=dict(data["precision"]), weight_streaming=tuple(ws), batch=batch, resolution=res, static=static,
        builder_optimization_level=level, raw=data,
    )


def load_config_file(path: Path) -> GpuConfig:
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_config(data, path.stem, str(path))


def load_gpu(gpu: str | None = None, config: Path | None = None) -> GpuConfig:
    """`--gpu 4090` or `--config FILE`."""
    if config is not None:
        return load_config_file(config)
    if not gpu:
        raise ConfigError(f"pass --gpu (one of {', '.join(known_gpus())}) or --config FILE")
    key = gpu.lower().removeprefix("rtx").removeprefix("rtx-").strip()
    path = configs_dir() / f"{key}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown GPU '{gpu}'; known: {', '.join(known_gpus())} (or pass --config FILE)")
    return load_config_file(path)
