"""The two TensorRT build backends behind one small interface. Their Python APIs match for what fluxtrt
uses (parser, strongly typed network, profiles, builder config, serialization); they differ in import
name, in where they can build (TensorRT-RTX: ahead of time for a chosen compute capability on any machine;
full TensorRT: only for the GPU present), and in the flags they offer."""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import BackendUnavailableError


class _Log:
    """One TensorRT logger per process (TensorRT keeps the first one registered); its sink is switchable."""

    instance = None

    def __init__(self, trt):
        class Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.file = None
                self.cpu_note = False
                self.errors: list[str] = []
                self.memory: dict[str, int] = {}  # what the builder reports (build_memory_report)

            def log(self, severity, msg):
                building = self.file is not None
                if severity <= trt.ILogger.Severity.ERROR and not (building and _expected_without_gpu(msg)):
                    self.errors.append(msg)
                record_memory(self.memory, msg)
                if building and severity <= trt.ILogger.Severity.INFO:
                    if _expected_without_gpu(msg):  # an ahead-of-time build on a machine with no GPU
                        if not self.cpu_note:
                            self.cpu_note = True
                            self.file.write("[NOTE] no usable CUDA driver here: expected for an ahead-of-time build "
                                            "on a CPU; TensorRT-RTX's CUDA messages are left out of this log\n")
                        return
                    self.file.write(f"[{severity.name}] {msg}\n")

        self.logger = Logger()


MEMORY_LINES = {"activations": "Total Activation Memory:", "weights": "Total Weights Memory:",
                "persistent": "Total Device Persistent Memory:"}


def record_memory(memory: dict, msg: str) -> None:
    """The builder's own report of an engine's device memory (INFO lines, TensorRT and TensorRT-RTX alike):
    activations (sized for the profile's max shapes), weights, persistent memory; bytes."""
    for key, prefix in MEMORY_LINES.items():
        if msg.startswith(prefix):
            try:
                memory[key] = int(msg[len(prefix):].split()[0])
            except (IndexError, ValueError):
                pass


def _expected_without_gpu(msg: str) -> bool:
    text = msg.lower()
    return "cuda driver version is insufficient" in text or "no cuda-capable device" in text


class Backend:
    name = ""
    module = ""
    install_hint = ""
    uses_timing_cache = True  # full TensorRT times tactics at build time and can reuse the timings

    def __init__(self):
        self._trt = None

    @property
    def trt(self):
        if self._trt is None:
            try:
                self._trt = importlib.import_module(self.module)
            except ImportError:
                raise BackendUnavailableError(f"the {self.name} backend needs the '{self.module}' package: "
                                              f"{self.install_hint}") from None
        return self._trt

    @property
    def version(self) -> str:
        return self.trt.__version__

    @property
    def logger(self):
        key = self.module
        if _Log.instance is None or _Log.instance[0] != key:
            _Log.instance = (key, _Log(self.trt).logger)
        return _Log.instance[1]

    def check_target(self, compute_capability: str) -> None:
        raise NotImplementedError

    def configure(self, config, compute_capability: str) -> None:
        raise NotImplementedError

    def runtime_validity(self, engine_file: Path) -> str | None:
        """What the installed runtime says of an engine file for this machine (None if it cannot tell)."""
        return None


class TensorRTRTX(Backend):
    name = "tensorrt-rtx"
    module = "tensorrt_rtx"
    # "ITimingCache ... does not affect engines built by TensorRT-RTX. Using them forces a GPU query during
    # ahead-of-time compilation" (TensorRT-RTX docs, Timing Cache Migration): never set one
    uses_timing_cache = False
    install_hint = "pip install 'fluxtrt[rtx]' (tensorrt-rtx-cu12)"
    capabilities = {"8.0": "SM80", "8.6": "SM86", "8.9": "SM89", "12.0": "SM120", "12.1": "SM121"}

    def check_target(self, compute_capability: str) -> None:
        if compute_capability not in self.capabilities:
            raise BackendUnavailableError(
                f"TensorRT-RTX cannot build for compute capability {compute_capability} (supported: "
                f"{', '.join(self.capabilities)}); use a config with backend: tensorrt"
            )
        _ = self.trt  # import now, with the install hint if missing

    def configure(self, config, compute_capability: str) -> None:
        """Ahead-of-time build for one compute capability: no GPU needed on this machine."""
        trt = self.trt
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, self.capabilities[compute_capability]), 0)

    def runtime_validity(self, engine_file: Path) -> str | None:
        trt = self.trt
        try:
            runtime = trt.Runtime(self.logger)
            with open(engine_file, "rb") as f:
                header = f.read(runtime.engine_header_size)
            validity, diagnostics = runtime.get_engine_validity(header)
        except Exception as e:  # no CUDA driver, unreadable file: say so instead of failing the inspection
            return f"cannot check here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        return f"{validity.name}" + (f" ({diagnostics})" if diagnostics else "")


class TensorRT(Backend):
    name = "tensorrt"
    module = "tensorrt"
    install_hint = ("pip install 'fluxtrt[trt]' (NVIDIA's tensorrt wheels; they download from NVIDIA's index), "
                    "or pick a GPU config whose backend is tensorrt-rtx")

    def check_target(self, compute_capability: str) -> None:
        _ = self.trt  # import now: the install hint if missing
        present = local_gpu_capabilities()
        if compute_capability not in present:
            found = ", ".join(f"sm{c.replace('.', '')}" for c in present) or "no CUDA GPU"
            raise BackendUnavailableError(
                f"full TensorRT builds only for the GPU it runs on: the target is "
                f"sm{compute_capability.replace('.', '')} but this machine has {found}; build on the target GPU"
            )

    def configure(self, config, compute_capability: str) -> None:
        pass  # builds for the local GPU, checked in check_target


def local_gpu_capabilities() -> list[str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return sorted({"{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})
    except Exception:
        return []


BACKENDS = {"tensorrt-rtx": TensorRTRTX, "tensorrt": TensorRT}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise BackendUnavailableError(f"unknown backend '{name}'; choose {', '.join(BACKENDS)}") from None
