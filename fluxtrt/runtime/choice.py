"""Which executor runs a set of engines on this machine (`--backend auto`), and what falls back to PyTorch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BackendUnavailableError, FluxtrtError
from ..records import RUN_COMPONENTS, Manifest, read_manifest

BACKENDS = ("auto", "tensorrt", "onnxruntime", "torch")


@dataclass
class BackendChoice:
    backend: str
    fallback: list = field(default_factory=list)  # components run by PyTorch ("name@cpu": on the CPU)
    notes: list = field(default_factory=list)  # each choice said once, for the user


def choose_backend(requested: str, engines: Path | None, fallback=()) -> BackendChoice:
    """`auto`: the TensorRT executor where this GPU can run the engines; else PyTorch on a CUDA GPU (e.g.
    TensorRT-RTX engines on Hopper); else ONNX Runtime. Components the manifest lacks fall back to PyTorch, except
    those a stopped build never made (refused, naming them, unless the user's `fallback` names them); engines
    larger than the free GPU memory (weight streaming excepted) run in PyTorch on the CPU."""
    if requested not in BACKENDS:
        raise FluxtrtError(f"--backend {requested}: choose {', '.join(BACKENDS)}")
    if engines is None:
        if requested not in ("auto", "torch"):
            raise FluxtrtError(f"--backend {requested} runs built engines or their ONNX: pass --engines DIR; --model "
                               "alone runs the PyTorch modules (--backend torch)")
        return BackendChoice("torch")
    manifest = read_manifest(engines)
    missing = [c for c in RUN_COMPONENTS if c not in manifest.components]
    asked = {x.split("@")[0] for f in fallback or () for x in str(f).split(",")}
    stopped = [c for c in missing if c in manifest.pending and c not in asked]
    if stopped:
        raise manifest.lacking(stopped, engines)
    notes = [f"no engine for {', '.join(missing)}: running PyTorch for it"] if missing else []
    if manifest.backend == "torch":  # compiled PyTorch engines: the torch executor runs them
        if requested not in ("auto", "torch"):
            raise FluxtrtError(f"{engines} holds compiled PyTorch engines (.pt2 packages): run them with --backend "
                               "torch (or auto); --backend tensorrt and onnxruntime run TensorRT builds")
        return BackendChoice("torch", missing, notes)
    if requested != "auto":
        return BackendChoice(requested, missing, notes)
    from ..core.backends import get_backend, local_gpu_capabilities
    from .executors import check_gpu_for

    try:
        check_gpu_for(manifest, get_backend(manifest.backend))
    except FluxtrtError as e:
        if local_gpu_capabilities():
            return BackendChoice("torch", missing, notes + [f"running the PyTorch modules on this GPU instead ({e})"])
        return BackendChoice("onnxruntime", missing, notes + ["no NVIDIA GPU here: ONNX Runtime runs the ONNX the "
                                                              "engines were built from"])
    too_big = engines_that_do_not_fit(manifest, missing)
    if too_big:
        notes.append(f"{', '.join(too_big)} engine(s) do not fit the free GPU memory and were not built with weight "
                     "streaming: running them with PyTorch on the CPU")
    return BackendChoice("tensorrt", missing + [f"{c}@cpu" for c in too_big], notes)


def known_ort_provider(requested: str) -> str:
    """An --ort-provider name, checked (auto or a key of executors.ORT_PROVIDERS)."""
    from .executors import ORT_PROVIDERS

    if requested not in ("auto", *ORT_PROVIDERS):
        raise FluxtrtError(f"--ort-provider {requested}: choose auto, {', '.join(ORT_PROVIDERS)}")
    return requested


def ort_provider(requested: str = "auto") -> str:
    """--ort-provider: `auto` is CUDA where onnxruntime-gpu and a CUDA GPU are both here, else the CPU; a named
    provider this ONNX Runtime does not offer (or a GPU one without a GPU) is refused with the fix."""
    from ..onnxio import onnxruntime
    from .executors import ORT_PROVIDERS

    known_ort_provider(requested)
    ort = onnxruntime()
    have = ort.get_available_providers()
    import torch

    gpu = torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if gpu and "CUDAExecutionProvider" in have else "cpu"
    if ORT_PROVIDERS[requested][0] not in have:
        fix = ("pip install 'fluxtrt[gpu]' (onnxruntime-gpu, instead of onnxruntime)" if requested == "cuda" else
               f"install an onnxruntime build with {ORT_PROVIDERS[requested][0]} and its libraries")
        raise BackendUnavailableError(f"--ort-provider {requested}: this ONNX Runtime {ort.__version__} offers "
                                      f"{', '.join(have)}; {fix}, or use --ort-provider cpu")
    if requested != "cpu" and not gpu:
        raise BackendUnavailableError(f"--ort-provider {requested} needs a CUDA GPU and PyTorch with CUDA; this "
                                      "machine has none: use --ort-provider cpu")
    return requested


def engines_that_do_not_fit(manifest: Manifest, skip=()) -> list[str]:
    """Components whose engine is larger than the GPU's free memory (weight-streaming engines excepted)."""
    import torch

    free = torch.cuda.mem_get_info()[0]
    return [c for c, e in manifest.components.items()
            if c not in skip and c != "vae_encoder" and not e.weight_streaming and e.bytes > free]
