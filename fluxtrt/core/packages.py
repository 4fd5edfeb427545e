"""Compiled PyTorch engines (AOTInductor `.pt2` packages) as the build and the runtime both see them: what a
package needs to run (the torch and CUDA versions and the device it was compiled for) and how it is opened.
engine/aoti.py compiles them; runtime/executors.PackageExecutor runs them."""

from __future__ import annotations

from pathlib import Path

from ..errors import FluxtrtError

EXTENSION = ".pt2"


def device_target(device) -> str:
    """What a package compiled on `device` runs on: "cpu", or the GPU's architecture ("sm90")."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def package_runtime(device) -> dict:
    """The runtime a package compiled here needs: torch version, CUDA version (None on a CPU) and target."""
    import torch

    target = device_target(device)
    return {"torch": torch.__version__, "cuda": torch.version.cuda if target != "cpu" else None, "target": target}


def runtime_problem(recorded: dict, device) -> str | None:
    """Why a package built for `recorded` (package_runtime's dict) cannot load on `device` here, or None."""
    here = package_runtime(device)
    for key, what in (("target", "device"), ("torch", "torch"), ("cuda", "CUDA")):
        if recorded.get(key) != here.get(key):
            return f"it was compiled for {what} {recorded.get(key)}, this machine has {what} {here.get(key)}"
    return None


def load_package(path: Path, component: str, device):
    """The compiled module of a package (already checked against the manifest's sha256 and runtime); a package
    torch cannot open is one line."""
    import torch

    try:
        return torch._inductor.aoti_load_package(str(path), device_index=_index(device))
    except Exception as e:
        raise FluxtrtError(f"{component}: {path} is not a package this torch can load ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); rebuild it with "
                           "`fluxtrt build --backend torch`") from None


def _index(device) -> int:
    import torch

    device = torch.device(device)
    return -1 if device.type == "cpu" else (device.index if device.index is not None else torch.cuda.current_device())
