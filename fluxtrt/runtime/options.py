"""How a pipeline is opened: the one record of what runs each component and how (`fluxtrt run`, `bench`, `serve`,
the drop-in modules and the Python API all embed it). The request's own settings (prompt, size, steps, seed) are
not here: they belong to each call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..errors import FluxtrtError


@dataclass(frozen=True)
class PipelineOptions:
    engines: Path | None = None  # an engines folder (`fluxtrt build`): TensorRT plans, their ONNX, or .pt2 packages
    model: object = None  # without engines: a model (name, folder or models.source.ModelSource) run in PyTorch
    backend: str = "auto"  # auto, tensorrt, onnxruntime, torch (runtime/choice.py)
    ort_provider: str = "auto"  # ONNX Runtime's execution provider: auto, cpu, cuda, ...
    fallback: tuple = ()  # components run by their PyTorch module ("name@cpu": on the CPU)
    torch_dtype: str = "bf16"  # the PyTorch modules' dtype
    device: str | None = None  # the PyTorch modules' device (None: cuda where there is one)
    compile: bool = False  # torch.compile the PyTorch modules
    cuda_graph: bool = False  # capture the transformer step as a CUDA graph
    low_vram: bool = False  # load and free the stages one by one
    weight_streaming_budget: int | None = None  # MB of streamed TensorRT weights kept on the GPU
    allow_host_code: bool = False  # TensorRT engines with embedded host code
    kernel_specialization: str = "eager"  # TensorRT-RTX: eager, or lazy (a server: never stall on a new shape)
    weights: Path | None = None  # the user's checkpoint, refitted into weightless engines / weight-free ONNX
    lora: tuple = ()  # transformer LoRAs, stacked (runtime/lora.LoraRef: `--lora FILE[:SCALE]`, repeatable)
    calibration: Path | None = None  # `fluxtrt calibrate`'s file: the fp8 recipe for the PyTorch transformer
    parallel: int = 1  # ranks the PyTorch transformer's tokens are split over (runtime/parallel.py)
    parallel_attention: str = "auto"  # how a split attention sees the whole sequence: auto, ulysses, gather

    def check(self) -> "PipelineOptions":
        """These options checked and normalised (paths as Path, fallback as a tuple); one line per problem."""
        from ..dtypes import check_float
        from .lora import LoraRef

        if self.weight_streaming_budget is not None and self.weight_streaming_budget < 0:
            raise FluxtrtError(f"--weight-streaming-budget is MB of weights kept on the GPU, at least 0; got "
                               f"{self.weight_streaming_budget}")
        if self.kernel_specialization not in ("eager", "lazy"):
            raise FluxtrtError(f"kernel specialization is eager or lazy, got {self.kernel_specialization!r}")
        check_float(self.torch_dtype, "--torch-dtype")
        if self.parallel != 1:
            from .parallel import MAX_RANKS

            if not isinstance(self.parallel, int) or isinstance(self.parallel, bool) or \
                    not 1 <= self.parallel <= MAX_RANKS:
                raise FluxtrtError(f"--parallel takes 1 to {MAX_RANKS} ranks, got {self.parallel}")
            from .parallel import ATTENTION

            if self.parallel_attention not in ATTENTION:
                raise FluxtrtError(f"--parallel-attention takes {', '.join(ATTENTION)}, got {self.parallel_attention!r}")
            if self.cuda_graph or self.low_vram:
                raise FluxtrtError("--parallel: --cuda-graph and --low-vram are not yet for a split transformer; drop "
                                   "them")
        given = (self.fallback,) if isinstance(self.fallback, str) else self.fallback or ()  # "clip,t5" too
        fallback = [v.strip() for item in given for v in str(item).split(",") if v.strip()]
        twice = sorted({v for v in fallback if fallback.count(v) > 1})
        if twice:
            raise FluxtrtError(f"{', '.join(twice)} given twice in --fallback; list each component once")
        paths = {k: Path(v) if v is not None else None for k, v in (("engines", self.engines), ("weights", self.weights),
                                                                   ("calibration", self.calibration))}
        loras = (self.lora,) if isinstance(self.lora, (str, Path, LoraRef)) else self.lora or ()
        return dataclasses.replace(self, fallback=tuple(fallback), lora=tuple(LoraRef.parse(v) for v in loras), **paths)

    def notes(self, backend: str, ort_provider: str = "cpu") -> list[str]:
        """What these options do not do on `backend` (said once, not refused)."""
        flags = [f for f, on in (("--cuda-graph", self.cuda_graph),
                                 ("--low-vram", self.low_vram and (backend != "onnxruntime" or ort_provider == "cpu")),
                                 ("--weight-streaming-budget", self.weight_streaming_budget is not None),
                                 ("--allow-host-code", self.allow_host_code)) if on]
        if backend == "onnxruntime":
            flags += ["--compile"] if self.compile else []
            return [f"{', '.join(flags)} ha{'s' if len(flags) == 1 else 've'} no effect with ONNX Runtime "
                    f"({ort_provider.upper()})"] if flags else []
        if backend == "torch":  # --cuda-graph captures the PyTorch step too (compiled or not)
            ignored = [f for f in flags if f in ("--weight-streaming-budget", "--allow-host-code")]
            return [f"{', '.join(ignored)}: TensorRT engine options, unused by the PyTorch modules"] if ignored else []
        return []


FIELDS = tuple(f.name for f in dataclasses.fields(PipelineOptions))
