"""The one registry of engine precisions and quantization recipes: what each means, which components take it,
what it needs (calibration, a compute capability, a backend). Configs, `--precision`, the build plans,
quantization and the manifest all read it from here."""

from __future__ import annotations

from dataclasses import dataclass

from .components import ALL
from .errors import ConfigError

COMPONENTS = tuple(ALL)


@dataclass(frozen=True)
class Precision:
    name: str
    description: str
    components: tuple = COMPONENTS  # which components an engine of this precision exists for
    recipe: bool = False  # a quantization recipe (Q/DQ in the graph; other layers in `rest`)
    calibrated: bool = False  # needs activation ranges (calibration prompts)
    rest: str | None = None  # the precision of what the recipe leaves unquantized
    min_cc: tuple = (0, 0)
    backends: tuple = ("tensorrt-rtx", "tensorrt", "torch")  # torch: compiled PyTorch packages (AOTInductor)
    zero_copy_graph: str | None = None  # the graph dtype a checkpoint stored in it builds from without a copy
    instead: str = "int8-wo or int4-wo"  # what to use on a target below min_cc


_T = ("transformer",)
_TRT = ("tensorrt-rtx", "tensorrt")  # recipes only TensorRT (and ONNX Runtime, from their ONNX) computes
REGISTRY = {p.name: p for p in (
    Precision("fp32", "float32 everywhere"),
    Precision("fp16", "float16; norms, softmax and outputs stay fp32", zero_copy_graph="fp16"),
    Precision("bf16", "bfloat16; norms, softmax and outputs stay fp32", zero_copy_graph="bf16"),
    Precision(name="fp8", description="E4M3 weights and activations of the linear layers (calibrated)",
              components=_T, recipe=True, calibrated=True, rest="bf16", min_cc=(8, 9), zero_copy_graph="bf16"),
    Precision(name="fp8-attn", description="fp8, plus E4M3 on both inputs of attention's two MatMuls",
              components=_T, recipe=True, calibrated=True, rest="bf16", min_cc=(8, 9)),
    Precision(name="fp8-wo", description="E4M3 weights of the linear layers, a scale per output row, multiplied in "
              "bf16 (weight bytes halved; no calibration): T5's, as ComfyUI's t5xxl_fp8_e4m3fn", components=("t5",),
              recipe=True, rest="bf16", backends=("torch",)),
    Precision(name="int8", description="W8A8 with SmoothQuant (full TensorRT only)", components=_T, recipe=True,
              calibrated=True, rest="bf16", backends=("tensorrt",)),
    Precision(name="int8-wo", description="INT8 weights, per-channel scales; activations in bf16", components=_T,
              recipe=True, calibrated=False, rest="bf16", backends=_TRT),
    Precision(name="int4-wo", description="INT4 weights in blocks of 128; activations in bf16", components=_T,
              recipe=True, calibrated=False, rest="bf16", backends=_TRT),
    Precision(name="fp4", description="NVFP4: E2M1 weights and activations in blocks of 16 with E4M3 block scales "
              "(calibrated global scales; RTX 50-series)", components=_T, recipe=True, calibrated=True, rest="bf16",
              min_cc=(10, 0), zero_copy_graph="bf16", instead="fp8", backends=_TRT),
)}
FLOATS = tuple(n for n, p in REGISTRY.items() if not p.recipe)
RECIPES = tuple(n for n, p in REGISTRY.items() if p.recipe)
CALIBRATED = tuple(n for n, p in REGISTRY.items() if p.calibrated)
TORCH_PRECISIONS = tuple(n for n, p in REGISTRY.items() if "torch" in p.backends)  # what a .pt2 package computes



def is_quantized(name: str) -> bool:
    return REGISTRY[name].recipe


def check(component: str, name: str, where: str, compute_capability: str | None = None,
          backend: str | None = None) -> None:
    """ConfigError naming `where` unless `component` can be built at precision `name` for the target."""
    if component not in COMPONENTS:
        raise ConfigError(f"{where}: precision for unknown component '{component}'; components are "
                          f"{', '.join(COMPONENTS)}")
    p = REGISTRY.get(name)
    if p is None:
        raise ConfigError(f"{where}: precision '{name}' for {component} is not one of {', '.join(REGISTRY)}")
    if component not in p.components:
        raise ConfigError(f"{where}: '{name}' quantizes the {' and '.join(p.components)}'s linear layers only; "
                          f"{component} takes {', '.join(FLOATS)} (`-p {name}` alone applies it wherever it exists, "
                          f"or name it: `-p {p.components[0]}={name}`)")
    if backend is not None and backend not in p.backends:
        if backend == "torch":
            raise ConfigError(f"{where}: compiled PyTorch engines compute {', '.join(TORCH_PRECISIONS)}, not {name}: "
                              "build it with TensorRT (drop --backend torch)")
        if p.backends == ("torch",):
            raise ConfigError(f"{where}: {name} is computed by compiled PyTorch engines only: build with "
                              "--backend torch, or give the component bf16")
        raise ConfigError(f"{where}: {name} (W8A8) needs the full TensorRT backend; TensorRT-RTX runs INT8 only as "
                          "weight-only GEMMs: use int8-wo")
    if compute_capability and compute_capability != "cpu" and tuple(map(int, compute_capability.split("."))) < p.min_cc:
        family = name.split("-")[0]
        gpu = " (Blackwell: --gpu 5090)" if name == "fp4" else ""
        raise ConfigError(f"{where}: {family} needs compute capability {'.'.join(map(str, p.min_cc))} or newer"
                          f"{gpu} (this target is {compute_capability}); use {p.instead}")


def apply_overrides(precision: dict, overrides: list[str], components=None) -> tuple[dict, list[str]]:
    """`-p` values on top of a config's precision map: `bf16` (every requested component), `fp8` (every
    component the recipe exists for; the others keep the config's precision) or `transformer=fp16`.
    Returns (the merged map, notes saying where a recipe did not apply)."""
    merged, notes = dict(precision), []
    targets = list(components or COMPONENTS)
    seen: dict[str, str] = {}
    for item in overrides:
        key = item.split("=", 1)[0].strip() if "=" in item else "*"
        if key in seen:
            what = f"-p {key}=" if key != "*" else "a precision for every component"
            raise ConfigError(f"{what} is given twice ({seen[key]}, {item}); pass each once")
        seen[key] = item
        if "=" in item:
            comp, name = (x.strip() for x in item.split("=", 1))
            merged[comp] = name
            continue
        p = REGISTRY.get(item)
        if p is None or not p.recipe:
            merged.update({c: item for c in targets})
            continue
        applies = [c for c in targets if c in p.components]
        if not applies:
            raise ConfigError(f"-p {item}: none of the components built ({', '.join(targets)}) has the {item} "
                              f"recipe (it exists for {', '.join(p.components)})")
        merged.update({c: item for c in applies})
        others = [c for c in targets if c not in p.components]
        if others:
            notes.append(f"{item} applies to {', '.join(applies)}; "
                         + ", ".join(f"{c} stays {merged[c]}" for c in others) + " (the config's precision)")
    return merged, notes
