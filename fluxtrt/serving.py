"""`fluxtrt serve`: text-to-image and image edits over HTTP on Ray Serve, each replica a `Pipeline` with a continuous
batcher (runtime/batching.py). On one machine Ray runs embedded (a local runtime started in-process); with
`--address` the same app joins an existing Ray cluster, one replica per GPU.

HTTP API (OpenAI-style images):
  POST /v1/images/generations  {"prompt": str, "n": 1, "size": "WIDTHxHEIGHT", "steps": int, "guidance": float,
                                "seed": int, "cache_threshold": float, "lora": "name" | [{"name", "scale"}],
                                "response_format": "b64_json"}
                                (all but prompt optional; cache_threshold: First-Block Cache per image, 0 off;
                                lora: LoRAs of --lora-dir by file stem, stacked, mixed with others in one batch)
    200 {"created": unix time, "data": [{"b64_json": PNG, "seed": int[, "cache": {...}]}], "timings": {...}}
    400 {"error": {"message": one line}} for anything `fluxtrt run` refuses and for unknown fields; 503 +
    Retry-After when the queue is full; 500 when a generation fails (the server keeps serving); a client that
    disconnects cancels its samples at the next step. 404 / 405 / 414 (long URLs) in the same JSON shape.
  POST /v1/images/edits  multipart (OpenAI's images.edit): "image" (a file), optional "mask" (a file: with
                                alpha, transparent = edit; without, white = edit), "prompt", "strength" and the
                                fields above as form text ("lora" a name or JSON); img2img, Fill (a mask, on Fill
                                engines) or Kontext, as the engines' model serves; the size defaults to the image's
    200 / 4xx as above; 413 past 32 MB
  GET /v1/loras  the LoRAs --lora-dir serves: {"data": [{"name", "loaded", "bytes"}], "slots": n}
  GET /health  200 {"status": "ok", ...} once the engines are loaded (with --lora-dir: LoRA calls, mixed calls)
  GET /metrics the answering replica's queue depth, running batch, step time and batch sizes (Prometheus text)
Metrics (also on Ray's Prometheus exporter): fluxtrt_queue_depth, fluxtrt_running_batch, fluxtrt_step_seconds;
/metrics also fluxtrt_cancelled_total."""

import asyncio
import base64
import io
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .core.limits import MAX_CACHE_THRESHOLD, MAX_GUIDANCE, MAX_STEPS, check_number
from .errors import BadRequest, FluxtrtError, TooLarge  # noqa: F401 - defined in errors.py, raised here
from .runtime.options import PipelineOptions

log = logging.getLogger("fluxtrt")

MAX_PROMPT_CHARS = 10_000  # T5 reads at most 512 tokens; a longer body is a client bug, not a prompt
MAX_N = 8
MAX_BODY_BYTES = 64 << 10  # a request is a prompt and a few numbers: 64 KiB is far more than the largest
MAX_JSON_DEPTH = 8
ROUTE = "/v1/images/generations"
EDITS_ROUTE = "/v1/images/edits"
MAX_EDIT_BYTES = 32 << 20  # an edit uploads an image and a mask: a few MB each at most
MAX_URL_CHARS = 2048  # path and query: the API's URLs are short; a longer one is refused before routing
# The request's fields. "model" and "user" are OpenAI's own (its clients may send them): accepted, and they change
# nothing (the engines decide the model). Any other name is refused, with the nearest known one.
FIELDS = ("prompt", "n", "size", "steps", "guidance", "seed", "cache_threshold", "lora", "response_format", "model",
          "user")
EDIT_FIELDS = ("image", "mask", "strength") + FIELDS  # POST /v1/images/edits (multipart): OpenAI's and fluxtrt's


def too_large(size: str | int) -> TooLarge:
    return TooLarge(f"the body has {size} bytes, over the {MAX_BODY_BYTES} byte limit; send a prompt and a few settings")


def _depth(body: bytes) -> int:
    """How deeply a JSON text nests arrays and objects (brackets inside strings are not counted), read before
    parsing: a deeply nested body must not reach the parser's recursion limit."""
    depth = top = 0
    in_str = escaped = False
    for ch in body.decode("utf-8", errors="replace"):
        if in_str:
            escaped, in_str = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            top = max(top, depth)
        elif ch in "]}":
            depth -= 1
    return top


@dataclass
class Generation:
    prompt: str
    n: int
    width: int
    height: int
    steps: int | None
    guidance: float | None
    seed: int
    cache_threshold: float = 0.0
    lora: tuple = ()  # ((name, scale), ...)


def parse_size(size, what: str = "size") -> tuple[int, int]:
    """(width, height) from "WIDTHxHEIGHT", or BadRequest naming `what`."""
    match = re.fullmatch(r"([0-9]{1,5})[xX]([0-9]{1,5})", size) if isinstance(size, str) else None
    if match is None:  # ASCII digits only: int() would also take fullwidth or Arabic-Indic ones
        raise BadRequest(f"{what} must be \"WIDTHxHEIGHT\" in pixels, e.g. \"1024x768\"; got {str(size)[:40]!r}")
    width, height = int(match[1]), int(match[2])
    if min(width, height) < 1:
        raise BadRequest(f"{what} must be positive pixels, e.g. \"1024x768\"; got {size!r}")
    return width, height


def parse_request(body: bytes, default_size: tuple[int, int], default_steps: int,
                  default_cache_threshold: float = 0.0) -> Generation:
    """The request body as a Generation, or BadRequest naming the field and what it takes."""
    if len(body) > MAX_BODY_BYTES:
        raise too_large(len(body))
    if _depth(body) > MAX_JSON_DEPTH:
        raise BadRequest(f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels; send a flat JSON object")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON ({e.__class__.__name__}); send a JSON object") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object with at least \"prompt\"")
    return generation(data, default_size, default_steps, default_cache_threshold)


def generation(data: dict, default_size: tuple[int, int], default_steps: int | None,
               default_cache_threshold: float = 0.0, *, fields: tuple = FIELDS,
               default_guidance: float | None = 3.5) -> Generation:
    """A request's fields (a JSON object, or an edit's form with its numbers parsed) as a Generation (steps and
    guidance None where not given and no default: the workflow's); BadRequest naming the field otherwise."""
    for key in data:
        if key not in fields:
            raise BadRequest(unknown_field(key, fields))

    def number(key, default, kind, lo, hi):
        value = data.get(key, default)
        if value is None and key not in data:
            return None
        ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok or (kind is float and not math.isfinite(value)):
            raise BadRequest(f"\"{key}\" must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if not lo <= value <= hi:
            raise BadRequest(f"\"{key}\" must be in {lo}..{hi}, got {value}")
        return kind(value)

    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRequest("\"prompt\" must be a non-empty string")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise BadRequest(f"\"prompt\" has {len(prompt)} characters; at most {MAX_PROMPT_CHARS} (T5 reads 512 tokens)")
    if data.get("response_format", "b64_json") != "b64_json":
        raise BadRequest("\"response_format\" must be \"b64_json\" (images are returned inline as base64 PNG)")
    width, height = parse_size(data.get("size", f"{default_size[1]}x{default_size[0]}"), "\"size\"")
    lora = parse_lora(data.get("lora"))
    return Generation(lora=lora, prompt=prompt, n=number("n", 1, int, 1, MAX_N), width=width, height=height,
                      steps=number("steps", default_steps, int, 1, MAX_STEPS),
                      guidance=number("guidance", default_guidance, float, 0.0, MAX_GUIDANCE),
                      seed=number("seed", 0, int, 0, 2**63 - 1 - MAX_N),
                      cache_threshold=number("cache_threshold", default_cache_threshold, float, 0.0, MAX_CACHE_THRESHOLD))


def parse_edit(form: dict, default_size: tuple[int, int], default_cache_threshold: float = 0.0):
    """POST /v1/images/edits' multipart form ({field: str, or bytes for the files}) as (Generation, ImageInputs):
    `image` (the image to change, or Kontext's reference), optional `mask` (alpha: transparent = edit; none:
    white = edit), `strength`; the rest as /v1/images/generations takes them (numbers as form text). The size
    defaults to the image's. BadRequest naming the field otherwise."""
    from .core.image_inputs import load_image, load_upload_mask
    from .core.workflows import ImageInputs
    from .errors import WorkflowError

    for key in form:
        if key not in EDIT_FIELDS:
            raise BadRequest(unknown_field(key, EDIT_FIELDS))
    for key in ("image", "mask"):
        if key in form and not isinstance(form[key], bytes):
            raise BadRequest(f"\"{key}\" must be an uploaded file (multipart), a PNG or JPEG")
    if "image" not in form:
        raise BadRequest("\"image\" is required: the image to edit, uploaded as a file")
    data = {}
    for key, value in form.items():
        if key in ("image", "mask"):
            continue
        if not isinstance(value, str):
            raise BadRequest(f"\"{key}\" must be a form field (text), not a file")
        if key in ("n", "steps", "seed"):
            value = _form_number(key, value, int)
        elif key in ("guidance", "cache_threshold", "strength"):
            value = _form_number(key, value, float)
        elif key == "lora" and value.lstrip().startswith(("[", "{")):
            value = parse_json_field(key, value)
        data[key] = value
    strength = data.pop("strength", None)
    if strength is not None and not 0 < strength <= 1:
        raise BadRequest(f"\"strength\" must be in (0, 1], got {strength}")
    try:
        image = load_image(form["image"], "image")
        mask = load_upload_mask(form["mask"]) if "mask" in form else None
    except WorkflowError as e:
        raise BadRequest(str(e)) from None
    size = data.get("size") or f"{image.width}x{image.height}"
    req = generation({**data, "size": size}, default_size, None, default_cache_threshold, fields=EDIT_FIELDS,
                     default_guidance=None)  # the workflow's steps and guidance, as `fluxtrt run`
    return req, ImageInputs(image=image, mask=mask, strength=strength)


def _form_number(key: str, value: str, kind):
    try:
        return kind(value.strip())
    except ValueError:
        raise BadRequest(f"\"{key}\" must be {'an integer' if kind is int else 'a number'}, got {value[:40]!r}") \
            from None


def parse_json_field(key: str, value: str):
    if len(value) > 4096 or _depth(value.encode()) > MAX_JSON_DEPTH:
        raise BadRequest(f"\"{key}\" is too long or nests too deeply; send a short JSON value")
    try:
        return json.loads(value)
    except ValueError:
        raise BadRequest(f"\"{key}\" is not valid JSON; send a name or a JSON list") from None


def parse_lora(value) -> tuple:
    """A request's "lora": a name, or a list of names / {"name": str, "scale": number} (stacked, at most
    MAX_STACK), as ((name, scale), ...); BadRequest naming the field otherwise. The names are resolved against
    the server's --lora-dir when the request is queued."""
    from .runtime.lora import MAX_SCALE, MAX_STACK

    if value is None:
        return ()
    items = [value] if isinstance(value, (str, dict)) else value
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_STACK:
        raise BadRequest(f"\"lora\" must be a name or a list of 1 to {MAX_STACK} names or {{\"name\", \"scale\"}} "
                         "objects")
    out = []
    for item in items:
        item = {"name": item} if isinstance(item, str) else item
        if not isinstance(item, dict) or set(item) - {"name", "scale"} or not isinstance(item.get("name"), str):
            raise BadRequest("\"lora\" entries are names or {\"name\": str, \"scale\": number} objects")
        scale = item.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or abs(scale) > MAX_SCALE:
            raise BadRequest(f"\"lora\" scale must be a number within +-{MAX_SCALE:g}, got {scale!r}")
        out.append((item["name"], float(scale)))
    if len({n for n, _ in out}) < len(out):
        raise BadRequest("\"lora\" names a LoRA twice; give it once with its scale")
    return tuple(out)


def unknown_field(key: str, fields: tuple = FIELDS) -> str:
    """The line for a field the API does not take: the nearest known name, and the list."""
    import difflib

    near = difflib.get_close_matches(key.lower(), fields, n=1, cutoff=0.5)
    hint = f' (did you mean "{near[0]}"?)' if near else ""
    return f"unknown field {json.dumps(key[:40])}{hint}; the fields are {', '.join(fields)}"  # escaped: one line


def png_b64(image) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class Service:
    """One replica's state and request handling, independent of Ray (tests drive it directly)."""

    def __init__(self, options, max_batch: int | None, max_queue: int, *, metrics=None, cache_threshold: float = 0.0,
                 size: str | None = None, lora_dir=None, lora_cache_gb: float = 4.0):
        """`options`: runtime.options.PipelineOptions (what `fluxtrt run` opens: engines or model, backend, dtype,
        calibration, compile, ...)."""
        from .runtime.assembly import open_pipeline
        from .runtime.batching import ContinuousBatcher, allow_compiled_forms, batch_buckets, warm_up_batches

        check_servable(options.engines, options.model, options.backend)
        # LAZY kernel specialization: a server must not stall on the first request of a new shape
        self.pipe = open_pipeline(options=options, kernel_specialization="lazy")
        self.backend = self.pipe.backend_name
        self.metrics = metrics
        self.loras = self._lora_bank(lora_dir, lora_cache_gb) if lora_dir is not None else None
        self.batcher = ContinuousBatcher(self.pipe, max_batch, max_queue, on_step=self._record, loras=self.loras)
        opt = self.pipe.manifest.shape_range["opt"] if self.pipe.manifest is not None else [1, 1024, 1024]
        self.default_size = (opt[1], opt[2])  # (height, width)
        if size is not None:  # a request's default size, and the one --compile compiles for
            width, height = parse_size(size, "size")  # the name ServeArgs and the app use
            self.pipe.check_request(1, height, width, 1)
            self.default_size = (height, width)
        mixes = self.loras is not None and self.loras.mixes
        if mixes:  # the bank's buffers hold a row for every sample of the largest (padded) batch
            self.loras.rows = max(self.loras.rows, self.batcher.max_batch)
        if self.pipe.options.compile:  # every batch size the batcher can form, compiled before the first request
            buckets = batch_buckets(self.batcher.max_batch)
            if mixes:
                allow_compiled_forms(len(buckets) * self.loras.variants * 2)  # two sizes' worth of every form
            seconds = warm_up_batches(self.pipe, buckets, *self.default_size, loras=self.loras if mixes else None)
            log.info("compiled the transformer for batches %s at %dx%d in %.0f s", buckets, *self.default_size,
                     seconds)
        self.batcher.start()
        try:  # text-to-image's; Fill engines have none (their requests bring an image and name their workflow)
            self.default_steps = self.pipe.plan(*self.default_size)[0].default_steps(self.pipe.geo)
        except FluxtrtError:
            self.default_steps = None
        self.pipe.steps.step_cache(cache_threshold)  # refused now where the executor cannot run the cache's parts
        self.default_cache_threshold = cache_threshold

    def _lora_bank(self, lora_dir, cache_gb: float):
        """Per-request LoRAs of `lora_dir`: mixed in one call on the PyTorch transformer (runtime/lora.LoraBank),
        one stack per call on engines and ONNX, merged into --weights (runtime/lora.EngineAdapters)."""
        from .runtime.executors import PackageExecutor, TorchExecutor
        from .runtime.lora import EngineAdapters, LoraBank

        check_number("--lora-cache-gb", cache_gb, 0.0, 1024.0)
        ex = self.pipe.executors["transformer"]
        bank = LoraBank(lora_dir, int(cache_gb * 2**30))
        if isinstance(ex, TorchExecutor):
            slots = ex.serve_loras(bank)
            log.info("serving the LoRAs of %s: %d names, %d slots in GPU memory", lora_dir, len(bank.names()), slots)
            return bank
        weights = self.pipe.options.weights
        if isinstance(ex, PackageExecutor):  # each stack: the package's own weights with the LoRAs merged
            if ex.entry.precision == "fp8":
                raise FluxtrtError("--lora-dir on fp8 packages: their weights are E4M3 as the recipe quantized them; "
                                   "serve with --backend torch --model M --calibration CAL (LoRAs beside fp8 GEMMs)")
            size = ex.entry.constants["bytes"]
        elif weights is None:
            raise FluxtrtError(f"--lora-dir on {ex.kind} engines merges each request's LoRAs into your checkpoint: add "
                               "--weights YOUR_FLUX_FOLDER (weight-free ONNX, or engines built --weightless), or serve "
                               "with --backend torch, which mixes LoRAs in one batch")
        else:
            from .models.source import resolve_model

            size = sum(f.stat().st_size for f in (resolve_model(weights).path / "transformer").glob("*.safetensors"))
        keep = max(1, int(cache_gb * 2**30) // max(size, 1))
        log.info("serving the LoRAs of %s on %s engines: one LoRA stack per transformer call, %d stack(s) kept",
                 lora_dir, ex.kind, keep)
        return EngineAdapters(bank, self.pipe.executors, self.pipe.with_loras, keep)

    def _record(self, stats) -> None:
        if self.metrics is not None:
            self.metrics(stats)

    def health(self) -> dict:
        s = self.batcher.stats
        return {"status": "ok", "backend": self.backend, "model": self.pipe.geo.model_class, "pid": os.getpid(),
                "queued": s.queued, "running_batch": s.running_batch, "steps_run": s.steps_run, "cancelled": s.cancelled,
                "max_batch": self.batcher.max_batch, "max_queue": self.batcher.max_queue,
                **({"lora": {**self.loras.health(), "calls": s.lora_calls, "mixed_calls": s.mixed_lora_calls}}
                   if self.loras is not None else {})}

    def lora_listing(self) -> tuple[int, dict]:
        """GET /v1/loras: (status, payload)."""
        if self.loras is None:
            return 200, {"data": [], "note": "this server serves no LoRAs (start it with --lora-dir DIR)"}
        return 200, {"data": self.loras.listing(), "slots": self.loras.slots}

    def metrics_text(self) -> str:
        """This replica's numbers in Prometheus' text format (Ray's exporter has them too, with Ray's own)."""
        s, pid = self.batcher.stats, os.getpid()
        lines = ["# TYPE fluxtrt_queue_depth gauge", f'fluxtrt_queue_depth{{replica="{pid}"}} {s.queued}',
                 "# TYPE fluxtrt_running_batch gauge", f'fluxtrt_running_batch{{replica="{pid}"}} {s.running_batch}',
                 "# TYPE fluxtrt_step_seconds gauge", f'fluxtrt_step_seconds{{replica="{pid}"}} {s.step_seconds:.6f}',
                 "# TYPE fluxtrt_steps_total counter", f'fluxtrt_steps_total{{replica="{pid}"}} {s.steps_run}',
                 "# TYPE fluxtrt_cancelled_total counter", f'fluxtrt_cancelled_total{{replica="{pid}"}} {s.cancelled}',
                 "# TYPE fluxtrt_batch_steps_total counter"]
        lines += [f'fluxtrt_batch_steps_total{{replica="{pid}",batch="{b}"}} {n}'
                  for b, n in sorted(s.batch_histogram.items())]
        return "\n".join(lines) + "\n"

    async def generate(self, body: bytes) -> tuple[int, dict, dict]:
        """(status, JSON payload, headers) for a POST body. Never raises for a client's mistake."""
        return await self._answer(lambda: (parse_request(body, self.default_size, self.default_steps,
                                                         self.default_cache_threshold), None))

    async def edit(self, form: dict) -> tuple[int, dict, dict]:
        """(status, JSON payload, headers) for POST /v1/images/edits' form ({field: text, or bytes for `image` and
        `mask`}): img2img, Fill (with a mask, on Fill engines) or Kontext, as the engines' model serves."""
        return await self._answer(lambda: parse_edit(form, self.default_size, self.default_cache_threshold))

    async def _answer(self, parse) -> tuple[int, dict, dict]:
        from .runtime.batching import QueueFull, ShuttingDown
        from .runtime.pipeline import RequestError

        t0 = time.perf_counter()
        try:
            req, inputs = parse()
            if req.steps is None or req.guidance is None:  # an edit that names none: its workflow's, as `run`
                wf = self.pipe.plan(req.height, req.width, inputs)[0]
                req.steps = wf.default_steps(self.pipe.geo) if req.steps is None else req.steps
                req.guidance = wf.guidance if req.guidance is None else req.guidance
            future = self.batcher.submit(req.prompt, req.height, req.width, req.steps, req.guidance, seed=req.seed, n=req.n,
                                         cache_threshold=req.cache_threshold, lora=req.lora, inputs=inputs)
        except QueueFull as e:
            return 503, _error(e), {"Retry-After": "2"}
        except ShuttingDown as e:
            return 503, _error(e), {"Retry-After": "5"}
        except BadRequest as e:
            return e.status, _error(e), {}
        except (RequestError, FluxtrtError) as e:  # a LoRA name outside --lora-dir, a workflow the model lacks, ...
            return 400, _error(e), {}
        try:
            done = await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the client went away (Ray Serve cancels the handler): stop its samples
            self.batcher.cancel(future)
            raise
        except ShuttingDown as e:
            return 503, _error(e), {"Retry-After": "5"}
        except FluxtrtError as e:
            return 500, _error(e), {}
        images = await asyncio.to_thread(lambda: [png_b64(img) for img in done.images])
        data = [{"b64_json": b64, "seed": req.seed + i, **({"cache": c} if c is not None else {})}
                for i, (b64, c) in enumerate(zip(images, done.caches))]
        timings = {"queue_s": round(done.queue_seconds, 4), "generate_s": round(done.seconds, 4),
                   "total_s": round(time.perf_counter() - t0, 4), "steps": req.steps}
        return 200, {"created": int(time.time()), "data": data, "timings": timings}, {"X-Fluxtrt-Replica": str(os.getpid())}

    def close(self) -> None:
        self.batcher.stop()
        self.pipe.close()  # a split transformer's followers (--parallel)


def _error(e: Exception) -> dict:
    return {"error": {"message": str(e).splitlines()[0] if str(e) else type(e).__name__}}


def _metrics_recorder():
    """Ray metrics (exported with Ray's own on its Prometheus endpoint) fed after every transformer step."""
    from ray.util import metrics

    queue = metrics.Gauge("fluxtrt_queue_depth", "images accepted and not yet returned")
    batch = metrics.Gauge("fluxtrt_running_batch", "samples in the last transformer call")
    step = metrics.Histogram("fluxtrt_step_seconds", "one transformer step of the running batch",
                             boundaries=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0])

    def record(stats):
        queue.set(stats.queued)
        batch.set(stats.running_batch)
        step.observe(stats.step_seconds)

    return record


@dataclass
class ServeArgs:
    """What one fluxtrt Ray Serve application serves: the application builder's arguments (`serve run
    fluxtrt.serving:app engines=DIR ...`, a Serve config's `args`, KubeRay's RayService) and what `fluxtrt serve`
    passes. `gpus_per_replica` None: 1 where the cluster has GPUs (0 for ONNX Runtime on the CPU)."""

    pipeline: PipelineOptions = field(default_factory=PipelineOptions)  # given by its fields' names: engines=...
    max_batch: int | None = None
    max_queue: int = 64
    replicas: int = 1
    gpus_per_replica: float | None = None
    cache_threshold: float = 0.0
    size: str | None = None  # "WIDTHxHEIGHT": requests' default size, the one `compile` compiles for
    lora_dir: str | None = None  # per-request LoRAs: the files of this folder, by stem (runtime/lora.LoraBank)
    lora_cache_gb: float = 4.0  # GPU memory for the adapters in use (least recently used evicted)

    @classmethod
    def keys(cls) -> list:
        """The arguments the app takes: these fields and the pipeline's (runtime.options.FIELDS)."""
        import dataclasses

        from .runtime.options import FIELDS

        return sorted({f.name for f in dataclasses.fields(cls)} - {"pipeline"} | set(FIELDS))

    @classmethod
    def of(cls, **flat) -> "ServeArgs":
        """ServeArgs from the flat names (the pipeline's fields go to `pipeline`)."""
        from .runtime.options import FIELDS

        return cls(pipeline=PipelineOptions(**{k: v for k, v in flat.items() if k in FIELDS}),
                   **{k: v for k, v in flat.items() if k not in FIELDS})

    @classmethod
    def parse(cls, args: dict) -> "ServeArgs":
        """From a builder's arguments (strings from `serve run k=v`, or YAML values), each checked in one line."""
        import typing

        if not isinstance(args, dict):
            raise FluxtrtError("the fluxtrt app takes key=value arguments (engines=DIR, backend=..., ...)")
        hints = typing.get_type_hints(PipelineOptions) | typing.get_type_hints(cls)
        fields = set(cls.keys())
        unknown = sorted(set(args) - fields)
        if unknown:
            raise FluxtrtError(f"unknown argument {', '.join(map(str, unknown))}; the fluxtrt app takes "
                               f"{', '.join(sorted(fields))}")
        out = {}
        for key, value in args.items():
            hint = hints[key]
            if hint is bool:
                words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
                if not isinstance(value, bool) and str(value).lower() not in words:
                    raise FluxtrtError(f"{key}={value!r}: expected true or false")
                out[key] = value if isinstance(value, bool) else words[str(value).lower()]
                continue
            if hint is tuple:  # fallback, lora: a list (YAML) or one string
                items = [value] if isinstance(value, (str, Path)) else value
                if not isinstance(items, (list, tuple)) or not all(isinstance(v, (str, Path)) for v in items):
                    raise FluxtrtError(f"{key}={value!r}: expected a string or a list of strings")
                out[key] = tuple(str(v) for v in items)
                continue
            kind = next((t for t in (int, float) if t in (hint, *typing.get_args(hint))), str)
            if value is None:
                out[key] = None
                continue
            try:
                if isinstance(value, bool) or (kind is str and not isinstance(value, (str, Path))):
                    raise TypeError
                out[key] = kind(value)
            except (TypeError, ValueError):
                what = {int: "an integer", float: "a number", str: "a string"}[kind]
                raise FluxtrtError(f"{key}={value!r}: expected {what}") from None
        return cls.of(**out).check()

    def check(self) -> "ServeArgs":
        for flag, value, lo, hi in (("replicas", self.replicas, 1, 1024), ("max_batch", self.max_batch, 1, 1024),
                                    ("max_queue", self.max_queue, 1, 100_000),
                                    ("gpus_per_replica", self.gpus_per_replica, 0, 8),
                                    ("cache_threshold", self.cache_threshold, 0.0, MAX_CACHE_THRESHOLD)):
            check_number(flag, value, lo, hi)
        check_number("lora_cache_gb", self.lora_cache_gb, 0.0, 1024.0)
        self.pipeline = self.pipeline.check()
        o = self.pipeline
        if self.lora_dir is not None and o.backend != "torch" and o.weights is None and not _packages(o.engines):
            raise FluxtrtError("--lora-dir on engines merges each request's LoRAs into your checkpoint: add --weights "
                               "YOUR_FLUX_FOLDER, or serve with --backend torch (LoRAs mixed in one batch)")
        if self.lora_dir is not None and not Path(self.lora_dir).is_dir():
            raise FluxtrtError(f"--lora-dir {self.lora_dir} is not a folder; pass the folder that holds the LoRA files")
        if o.parallel > 1:
            if o.backend != "torch":
                raise FluxtrtError("--parallel splits the PyTorch transformer: add --backend torch")
            if self.lora_dir is not None:
                raise FluxtrtError("--lora-dir with --parallel: per-request LoRAs are not yet on a split transformer; "
                                   "drop one of them")
            if self.gpus_per_replica not in (None, 0) and self.gpus_per_replica < o.parallel:
                raise FluxtrtError(f"--parallel {o.parallel} runs one rank per GPU: gpus_per_replica "
                                   f"{self.gpus_per_replica} is too few; give {o.parallel} (or leave it out)")
        if o.compile and o.backend != "torch":
            raise FluxtrtError("compile=true compiles the PyTorch transformer: use backend torch (engines are "
                               "compiled by `fluxtrt build`)")
        if self.size is not None:
            parse_size(self.size, "size")
        check_servable(o.engines, o.model, o.backend)
        if self.cache_threshold > 0 and o.backend not in ("torch", "auto"):
            raise FluxtrtError(f"cache_threshold runs the transformer as First-Block Cache's parts: the {o.backend} "
                               "backend needs engines built with `fluxtrt build --first-block-cache` (or backend torch)")
        return self

    def gpus(self) -> float:
        """GPUs per replica: gpus_per_replica, or one per rank where the cluster has GPUs (--parallel N: N)."""
        if self.gpus_per_replica is not None:
            return self.gpus_per_replica
        if self.pipeline.backend == "onnxruntime":
            return 0
        import ray

        if ray.is_initialized():
            return self.pipeline.parallel if ray.cluster_resources().get("GPU", 0) > 0 else 0
        import torch

        return self.pipeline.parallel if torch.cuda.is_available() else 0

    def placement(self) -> dict:
        """Ray Serve's options for where a replica runs: its GPUs (and CPU), and with --parallel N one placement
        group bundle that holds all N GPUs on one node (the ranks talk over NVLink / shared memory)."""
        gpus = self.gpus()
        options = {"ray_actor_options": {"num_gpus": gpus, "num_cpus": 1}}
        if self.pipeline.parallel > 1:
            options.update(placement_group_bundles=[{"CPU": 1, **({"GPU": gpus} if gpus else {})}],
                           placement_group_strategy="STRICT_PACK")
        return options


def _packages(engines) -> bool:
    """Whether `engines` is a folder of compiled PyTorch packages (their own weights take per-request LoRAs)."""
    from .records import ManifestError, read_manifest

    try:
        return engines is not None and read_manifest(Path(engines)).backend == "torch"
    except (ManifestError, OSError):
        return False  # check_servable says what is wrong with the folder


class FluxService:
    """The Ray Serve deployment: one `Service` per replica behind FastAPI (made a deployment by `app`)."""

    def __init__(self, args: ServeArgs):
        self.service = Service(args.pipeline, args.max_batch, args.max_queue, metrics=_metrics_recorder(),
                               cache_threshold=args.cache_threshold, size=args.size, lora_dir=args.lora_dir,
                               lora_cache_gb=args.lora_cache_gb)

    async def generations(self, request):
        from fastapi.responses import JSONResponse

        body = await bounded_body(request)
        if body is None:
            return JSONResponse(_error(too_large("more than")), status_code=413)
        status, payload, headers = await self.service.generate(body)
        return JSONResponse(payload, status_code=status, headers=headers)

    async def edits(self, request):
        from fastapi.responses import JSONResponse

        try:
            form = await read_form(request)
        except BadRequest as e:
            return JSONResponse(_error(e), status_code=e.status)
        status, payload, headers = await self.service.edit(form)
        return JSONResponse(payload, status_code=status, headers=headers)

    def health(self):
        return self.service.health()

    def loras(self):
        from fastapi.responses import JSONResponse

        status, payload = self.service.lora_listing()
        return JSONResponse(payload, status_code=status)

    def metrics(self):
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse(self.service.metrics_text(), media_type="text/plain; version=0.0.4")

    def check_health(self):  # Ray restarts a replica whose batcher thread died, or one of whose ranks ended
        from .runtime import parallel

        if not self.service.batcher.alive:
            raise RuntimeError("the batcher thread stopped")
        if parallel.failure():
            raise RuntimeError(parallel.failure())

    def __del__(self):
        if hasattr(self, "service"):
            self.service.close()


def app(args: dict | ServeArgs):
    """The Ray Serve application builder: `serve run fluxtrt.serving:app engines=engines/4090 backend=auto`, the
    `import_path` of a Serve config file (docs/serve-config.yaml) or of KubeRay's RayService
    (docs/kuberay-rayservice.yaml). `fluxtrt serve` runs the same application. The deployment is named
    FluxService (a config's `deployments:` entry overrides its replicas and resources)."""
    from fastapi import Request
    from ray import serve

    opts = args if isinstance(args, ServeArgs) else ServeArgs.parse(args)
    api = http_api()

    @serve.deployment(name="FluxService", num_replicas=opts.replicas,
                      max_ongoing_requests=opts.max_queue + max(opts.max_batch or 4, 1),
                      health_check_period_s=5, **opts.placement())
    @serve.ingress(api)
    class Deployment(FluxService):
        @api.post(ROUTE)
        async def generations(self, request: Request):
            return await FluxService.generations(self, request)

        @api.post(EDITS_ROUTE)
        async def edits(self, request: Request):
            return await FluxService.edits(self, request)

        @api.get("/health")
        def health(self):
            return FluxService.health(self)

        @api.get("/metrics")
        def metrics(self):
            return FluxService.metrics(self)

        @api.get("/v1/loras")
        def loras(self):
            return FluxService.loras(self)

    return Deployment.bind(opts)


def http_api():
    """The FastAPI app the deployment's routes are added to: every answer it gives itself (no such route, a method
    the route does not take, an over-long URL) is the API's JSON error shape, as the routes' own are."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    api = FastAPI(title="fluxtrt", docs_url=None, redoc_url=None, openapi_url=None)

    def answer(status: int, message: str, headers=None):
        return JSONResponse({"error": {"message": message}}, status_code=status, headers=headers)

    @api.exception_handler(HTTPException)
    async def http_error(request, exc):
        path = request.url.path[:80]
        if exc.status_code == 404:
            return answer(404, f"no route {path}; POST {ROUTE}, POST {EDITS_ROUTE}, GET /v1/loras, GET /health or "
                          "GET /metrics")
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            return answer(405, f"{request.method} {path} is not allowed; use {allowed or 'POST'}"
                          + (" with a JSON body" if path == ROUTE else ""), headers=exc.headers)
        return answer(exc.status_code, str(exc.detail).splitlines()[0] if exc.detail else "HTTP error")

    @api.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        return answer(400, "the request is not valid; send a JSON object with at least \"prompt\"")

    @api.middleware("http")
    async def url_limit(request, call_next):
        length = len(request.url.path) + len(request.url.query)
        if length > MAX_URL_CHARS:
            return answer(414, f"the URL has {length} characters, over the {MAX_URL_CHARS} limit; send settings in "
                          "the JSON body")
        return await call_next(request)

    return api


# the HTTP API: (method, path, FluxService method), as `app`'s Ray deployment declares its routes; `local_app`
# routes these
ROUTES = (("POST", ROUTE, "generations"), ("POST", EDITS_ROUTE, "edits"), ("GET", "/v1/loras", "loras"),
          ("GET", "/health", "health"), ("GET", "/metrics", "metrics"))


def local_app(service: "Service"):
    """The HTTP API (ROUTES) over one Service in this process, without Ray: an ASGI app for tests and tools."""
    from types import SimpleNamespace

    from fastapi import Request

    api, holder = http_api(), SimpleNamespace(service=service)

    def endpoint(name):
        handler = getattr(FluxService, name)
        if name in ("generations", "edits"):  # the ones that read the request
            async def call(request: Request):
                return await handler(holder, request)
        else:
            def call():
                return handler(holder)
        return call

    for method, path, name in ROUTES:
        api.add_api_route(path, endpoint(name), methods=[method])
    return api


async def read_form(request) -> dict:
    """POST /v1/images/edits' multipart body as {field: text, or bytes for a file}, read within MAX_EDIT_BYTES;
    BadRequest / TooLarge otherwise (one line)."""
    from starlette.formparsers import MultiPartException, MultiPartParser

    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadRequest("send the edit as multipart/form-data (OpenAI's images.edit): image, prompt, ...")
    body = await bounded_body(request, MAX_EDIT_BYTES)
    if body is None:
        raise TooLarge(f"the body is over the {MAX_EDIT_BYTES >> 20} MB limit for an edit; send smaller images")

    async def stream():
        yield body

    try:
        form = await MultiPartParser(request.headers, stream(), max_files=2, max_fields=32,
                                     max_part_size=MAX_EDIT_BYTES).parse()
    except MultiPartException as e:
        raise BadRequest(f"the multipart body is not valid ({str(e)[:80]}); send it as OpenAI's images.edit "
                         "does") from None
    out = {}
    for key, value in form.multi_items():
        key = key[:-2] if key.endswith("[]") else key  # OpenAI's clients send image[] for a list of images
        if key in out:
            raise BadRequest(f"\"{key[:40]}\" is given twice; one image (and one mask) per edit")
        out[key] = await value.read() if hasattr(value, "read") else value
    return out


async def bounded_body(request, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The request's body, or None once it passes `limit` (read no further: a 100 MB body is not taken)."""
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > limit:
        return None
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def check_serve_options(host: str, port: int, replicas: int, max_batch: int | None, max_queue: int,
                        *, address: str | None) -> None:
    """`fluxtrt serve`'s own options, and its port, checked before Ray starts (one line each)."""
    import socket

    for flag, value, hi in (("--port", port, 65535), ("--replicas", replicas, 1024), ("--max-batch", max_batch, 1024),
                            ("--max-queue", max_queue, 100_000)):
        check_number(flag, value, 1, hi)
    if address is not None:
        return  # Ray Serve's HTTP proxy runs on the cluster's nodes, not here
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError):
        raise FluxtrtError(f"--host {host!r} is not an address of this machine; use 127.0.0.1 or 0.0.0.0") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise FluxtrtError(f"cannot listen on {host}:{port} ({e.strerror}): another program (perhaps another "
                               "fluxtrt serve) uses it; pass another --port or stop that program") from None


def check_servable(engines: Path | None, model: str | None, backend: str) -> None:
    """What the replicas would refuse, said now in one line (before Ray starts)."""
    from .records import read_manifest

    if engines is None and model is None:
        raise FluxtrtError("pass --engines DIR (built by `fluxtrt build`), or --backend torch with --model")
    if engines is not None:
        manifest = read_manifest(Path(engines))
        model_class, workflows = manifest.model.model_class, manifest.workflows
    else:
        from .core.workflows import for_model
        from .models.source import resolve_model

        if backend != "torch":
            raise FluxtrtError("--model serves the PyTorch modules: add --backend torch (or pass --engines DIR)")
        geo = resolve_model(model).geometry
        model_class, workflows = geo.model_class, [w.name for w in for_model(geo)]
    if not {"txt2img", "fill", "kontext"} & set(workflows):
        raise FluxtrtError(f"fluxtrt serve runs text-to-image, img2img, Fill and Kontext; these are {model_class} "
                           f"engines ({', '.join(workflows)}): use `fluxtrt run` for them")


SERVE_SHUTDOWN_S = 15  # Ray Serve's own shutdown, at most; then Ray itself is stopped (its processes killed)
STOP_DEADLINE_S = 25  # from Ctrl-C to the process's end, whatever Ray does (its shutdown or exit hooks can hang)


def _bounded(fn, seconds: float, say) -> None:
    """fn() in a daemon thread, waited for at most `seconds` (Ray Serve's shutdown can hang for a minute after a
    replica was killed; Ctrl-C must still stop the server promptly)."""
    import threading

    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        say(f"Ray Serve did not stop within {seconds} s; stopping Ray")


def serve_forever(args: ServeArgs, host: str, port: int, address: str | None, say=print) -> None:
    """`fluxtrt serve`: check everything, start (or join) Ray, run `app(args)` (the same application `serve run
    fluxtrt.serving:app` runs), say the URL, block until Ctrl-C / SIGTERM, then shut down."""
    import dataclasses
    import signal

    try:
        import ray
        from ray import serve
    except ImportError:
        raise FluxtrtError("fluxtrt serve needs Ray Serve: pip install \"fluxtrt[serve]\"") from None

    check_serve_options(host, port, args.replicas, args.max_batch, args.max_queue, address=address)
    o = args.pipeline
    if o.calibration is not None and not Path(o.calibration).is_file():
        raise FluxtrtError(f"--calibration {o.calibration}: no such file; pass the file `fluxtrt calibrate` wrote")
    o = dataclasses.replace(o, engines=Path(o.engines).resolve() if o.engines else None,
                            calibration=Path(o.calibration).resolve() if o.calibration else None)
    args = dataclasses.replace(args, pipeline=o).check()
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 **({} if address else {"num_cpus": max(os.cpu_count() or 1, args.replicas + 1)}))
    # Ctrl-C even when started with SIGINT ignored (a shell's background job inherits that; so did this
    # project's own CI runs, where 'Ctrl-C took 60 s' was the server never seeing the signal), and SIGTERM
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    interrupted = False
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(app(args), name="fluxtrt", route_prefix="/")
        except RuntimeError as e:  # the replicas' own error is in Ray's logs
            raise FluxtrtError(f"the replicas did not start ({str(e).splitlines()[0]}); see Ray's logs in "
                               "/tmp/ray/session_latest/logs/serve/") from None
        say(f"fluxtrt serving on http://{host}:{port}{ROUTE} ({args.replicas} replica(s); Ctrl-C stops)")
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        say("stopping ...")
        interrupted = True
    finally:
        _exit_by(STOP_DEADLINE_S, say)
        try:
            _bounded(serve.shutdown, SERVE_SHUTDOWN_S, say)
        finally:
            if started_ray:
                ray.shutdown()
    if interrupted:
        raise KeyboardInterrupt  # the CLI exits 130, as a program stopped by Ctrl-C does


def _exit_by(seconds: float, say) -> None:
    """End the process `seconds` from now if it is still alive: should Ray's shutdown or its exit hooks hang,
    Ctrl-C must still stop the server."""
    import threading

    def hard_exit():
        say(f"Ray did not stop within {seconds} s; exiting")
        os._exit(130)

    timer = threading.Timer(seconds, hard_exit)
    timer.daemon = True
    timer.start()

