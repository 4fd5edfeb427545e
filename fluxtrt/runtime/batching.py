"""Continuous batching over one `Pipeline`: requests join a running batch at step boundaries and leave when
their last step is done (then VAE-decode), so a long request never holds a short one back and the transformer
runs at the batch sizes its profile allows.

Every sample keeps its own state: packed latents, timesteps and step sizes (its own step count and resolution
shift), guidance, text embeddings and the CPU generator that drew its noise. The transformer takes per-sample
`timestep` and `guidance` ([B]) and text inputs ([B, ...]), so a batch may mix all of these; `img_ids` and
`txt_ids` are shared by the whole batch, so samples are batched only with others of the same bucket (workflow,
height, width, reference size). A sample's image is therefore independent of what it was batched with (up to
the executor's batch-size rounding; tests bound it at 2/255 against `fluxtrt run` with the same arguments).

A sample with seed s equals `fluxtrt run --seed s` (batch 1); a request for n images uses seeds s, s+1, ....
First-Block Cache (a request's `cache_threshold`, stepcache.py) decides per sample, as `fluxtrt run` batch 1
does: the head runs for the whole batch; when any sample's residual changed past its threshold the tail runs
for the whole batch, and only those samples take (and keep) its output; the others take their kept residual.
So a sample's image does not depend on its batch-mates' decisions.
A request whose future is cancelled (its HTTP client went away: `Service.generate` cancels it) leaves at the next
step boundary: its samples stop running and the queue no longer counts them.
The library is usable without Ray: `submit` returns a `concurrent.futures.Future`, one thread runs the loop."""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from .. import flux_math as fm
from ..components import ShapePoint
from ..core.workflows import ImageInputs
from ..errors import FluxtrtError, QueueFull, ShuttingDown  # noqa: F401 - defined in errors.py, raised here
from .executors import TorchExecutor
from .pipeline import Pipeline, RequestError

log = logging.getLogger("fluxtrt")


@dataclass
class Job:
    """One request: n images of one prompt; done when every sample is decoded."""

    prompt: str
    height: int
    width: int
    steps: int
    guidance: float
    seed: int
    n: int
    future: Future = field(default_factory=Future)
    images: dict = field(default_factory=dict)  # sample index -> uint8 [H, W, 3]
    caches: dict = field(default_factory=dict)  # sample index -> First-Block Cache summary (or None)
    created: float = field(default_factory=time.perf_counter)
    started: float | None = None  # first step
    cache_threshold: float = 0.0  # First-Block Cache, per sample (0: off)
    lora: tuple = ()  # ((name, scale), ...): the request's LoRAs (runtime/lora.LoraBank), stacked
    inputs: ImageInputs | None = None  # the image workflows' images and settings (None: text-to-image)
    slots: list | None = None  # [(bank slot, scale)] while its samples run
    settled: bool = False  # counted out of the queue (finished, failed or cancelled): exactly once


@dataclass
class Finished:
    """A request's result: its images (uint8 [H, W, 3], seeds s, s+1, ...) and where its time went."""

    images: list
    queue_seconds: float  # submitted -> first transformer step
    seconds: float  # submitted -> last image decoded
    caches: list = field(default_factory=list)  # per image: First-Block Cache's computed / skipped steps (or None)


@dataclass
class Sample:
    job: Job
    index: int
    key: tuple  # bucket: samples of one key share img_ids / txt_ids and may run in one batch
    latents: object  # [1, N, C] on the device
    prep: object  # workflows.Prepared (conditioning on the device)
    t_in: object  # [steps] sigmas on the device
    dts: object  # [steps]
    guidance: object | None  # [1]
    pooled: object
    text: object
    img_ids: object
    step: int = 0
    order: int = 0  # admission order (oldest first)
    cache: object = None  # stepcache.FirstBlockCache of this sample (None: off)

    @property
    def done(self) -> bool:
        return self.step >= len(self.t_in)


@dataclass
class Stats:
    queued: int = 0  # samples admitted or waiting, not yet decoded
    running_batch: int = 0  # size of the last transformer call
    step_seconds: float = 0.0  # duration of the last transformer call (+ Euler update)
    steps_run: int = 0
    cancelled: int = 0  # requests whose client went away before they finished (their samples dropped)
    batch_histogram: dict = field(default_factory=lambda: collections.Counter())
    lora_calls: int = 0  # transformer calls with at least one sample's LoRA
    mixed_lora_calls: int = 0  # ... whose samples had different LoRAs (the base GEMMs ran once for all)


class ContinuousBatcher:
    """The scheduling loop over one pipeline. `max_batch`: largest transformer batch (default and limit: the
    engines' profile maximum; PyTorch modules have no profile: 4 unless asked); `max_queue`: samples accepted but
    not finished before `submit` refuses with QueueFull."""

    def __init__(self, pipe: Pipeline, max_batch: int | None = None, max_queue: int = 64, on_step=None, loras=None):
        profile_max = pipe.manifest.shape_range["max"][0] if pipe.manifest is not None else max_batch or 4
        if max_batch is not None and max_batch < 1:
            raise RequestError(f"--max-batch must be at least 1, got {max_batch}")
        if max_queue < 1:
            raise RequestError(f"--max-queue must be at least 1, got {max_queue}")
        self.pipe, self.max_batch, self.max_queue = pipe, min(max_batch or profile_max, profile_max), max_queue
        self.on_step = on_step  # callback(Stats) after every transformer call (metrics)
        self.loras = loras  # runtime/lora.LoraBank: per-request LoRAs (None: none served)
        self.stats = Stats()
        self._incoming: collections.deque = collections.deque()
        self._active: list[Sample] = []
        self._pending = 0  # samples submitted and not finished
        self._order = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the API ------------------------------------------------------------------------------------------------
    def submit(self, prompt: str, height: int, width: int, steps: int, guidance: float = 3.5, *, seed: int = 0,
               n: int = 1, cache_threshold: float = 0.0, lora=(), inputs: ImageInputs | None = None) -> Future:
        """Queue a request; the future's result is a `Finished` with n uint8 [H, W, 3] images. Checks the request now
        (one-line RequestError) and refuses with QueueFull when `max_queue` samples are already pending."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError("prompt must be a non-empty string")
        if n < 1:
            raise RequestError(f"n must be at least 1, got {n}")
        _, out_h, out_w, reference = self.pipe.plan(height, width, inputs)  # the model and inputs pick the workflow
        self.pipe.check_request(1, out_h, out_w, steps, reference)
        self.pipe.steps.step_cache(cache_threshold)  # one line where the executor cannot run the cache's parts
        lora = tuple(lora)
        if lora:
            if self.loras is None:
                raise RequestError("this server serves no LoRAs: start it with --lora-dir DIR")
            for name, _ in lora:
                self.loras.check(name)  # read and checked now: a bad file is this request's error, not the batch's
        if self._stop.is_set():
            raise ShuttingDown("the server is shutting down")
        job = Job(prompt=prompt, height=height, width=width, steps=steps, guidance=guidance, seed=seed, n=n,
                  cache_threshold=cache_threshold, lora=lora, inputs=inputs)
        with self._lock:
            if self._pending + n > self.max_queue:
                raise QueueFull(f"{self._pending} images are queued (max {self.max_queue}); retry shortly")
            self._pending += n
            self.stats.queued = self._pending
            self._incoming.append(job)
        self._wake.set()
        return job.future

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "ContinuousBatcher":
        self._thread = threading.Thread(target=self._loop, name="fluxtrt-batcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            jobs = list(self._incoming) + list({id(s.job): s.job for s in self._active}.values())
            self._incoming.clear()
            self._active.clear()
        for job in jobs:
            self._finish(job, exception=ShuttingDown("the server stopped before this request finished"))

    def cancel(self, future: Future) -> None:
        """Drop the request of `future` at the next step boundary (its client went away); the loop wakes for it."""
        future.cancel()
        self._wake.set()

    def run_until_idle(self) -> None:
        """Run the loop in this thread until every submitted request is done (tests, batch jobs)."""
        while self._incoming or self._active:
            self.step_once()

    # -- the loop -----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._incoming and not self._active:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.step_once()
            except Exception as e:  # noqa: BLE001 - never let the loop die: fail the samples, keep serving
                log.error("batcher step failed: %s", e)
                self._fail(self._active, e)

    def step_once(self) -> None:
        """Admit waiting requests, run one transformer step for the oldest bucket's samples (up to max_batch),
        decode the samples that finished. Requests cancelled since the last step leave first."""
        self._drop_cancelled()
        self._admit()
        if not self._active:
            return
        oldest = min(self._active, key=lambda s: s.order)
        batch = sorted((s for s in self._active if s.key == oldest.key), key=lambda s: s.order)[: self.max_batch]
        try:
            self._step(batch)
        except Exception as e:  # noqa: BLE001 - a failing batch fails its requests only
            self._fail(batch, e)
            return
        finished = [s for s in batch if s.done]
        if finished:
            self._active = [s for s in self._active if not s.done]
            try:
                self._decode(finished)
            except Exception as e:  # noqa: BLE001
                self._fail(finished, e)

    def _drop_cancelled(self) -> None:
        with self._lock:
            waiting = [job for job in self._incoming if job.future.cancelled()]
            for job in waiting:
                self._incoming.remove(job)
        running = {id(s.job): s.job for s in self._active if s.job.future.cancelled()}
        if running:
            self._active = [s for s in self._active if id(s.job) not in running]
        for job in [*waiting, *running.values()]:
            if self._finish(job):
                self.stats.cancelled += 1
                log.info("dropped a cancelled request of %d image(s): its client went away", job.n)

    def _admit(self) -> None:
        import torch

        while True:
            with self._lock:
                if not self._incoming:
                    return
                job = self._incoming[0]
                if job.lora:
                    job.slots = self.loras.acquire(job.lora)
                    if job.slots is None:  # every slot holds an adapter a running sample uses: wait for one
                        return
                self._incoming.popleft()
            try:
                with self.pipe.on_stream():
                    pooled, text = self.pipe.prompts.encode([job.prompt])
                    for i in range(job.n):
                        self._active.append(self._sample(job, i, pooled, text, torch))
            except Exception as e:  # noqa: BLE001 - e.g. NaN from a text encoder: this request fails
                self._active = [s for s in self._active if s.job is not job]
                self._finish(job, exception=e)

    def _sample(self, job: Job, index: int, pooled, text, torch) -> Sample:
        pipe, dev = self.pipe, self.pipe.device
        inputs = job.inputs or ImageInputs()
        wf, height, width, reference = pipe.plan(job.height, job.width, inputs)
        prep = pipe.prepare(wf, 1, height, width, job.steps, seed=job.seed + index, inputs=inputs)
        cond = prep.to(dev)
        guidance = torch.full([1], job.guidance, dtype=torch.float32).to(dev) if pipe.geo.guidance else None
        self._order += 1
        # a call holds one shape; on engines, which cannot mix LoRAs, one LoRA stack too
        stack = (job.lora,) if self.loras is not None and not self.loras.mixes else ()
        return Sample(job=job, index=index, key=(wf.name, height, width, reference, *stack), latents=cond.latents,
                      prep=cond,
                      t_in=(prep.timesteps / 1000).to(dev), dts=(prep.sigmas[1:] - prep.sigmas[:-1]).to(dev),
                      guidance=guidance, pooled=pooled.to(dev), text=text.to(dev), img_ids=cond.img_ids,
                      order=self._order, cache=pipe.steps.step_cache(job.cache_threshold))

    def _step(self, batch: list[Sample]) -> None:
        import torch

        pipe, dev = self.pipe, self.pipe.device
        t0 = time.perf_counter()
        first = batch[0]
        for s in batch:
            if s.job.started is None:
                s.job.started = t0
        with pipe.on_stream():
            feeds = pipe.step_inputs(torch.cat([s.prep.model_input(s.latents) for s in batch]),
                                     torch.cat([s.text for s in batch]), torch.cat([s.pooled for s in batch]),
                                     torch.stack([s.t_in[s.step] for s in batch]), first.img_ids,
                                     guidance=torch.cat([s.guidance for s in batch]) if pipe.geo.guidance else None)
            adapters = [s.job.slots or [] for s in batch]
            if self.loras is not None:
                self.loras.use(adapters, dev)
                if any(adapters):
                    self.stats.lora_calls += 1
                    self.stats.mixed_lora_calls += len({tuple(a) for a in adapters}) > 1
            try:
                if any(s.cache is not None for s in batch):  # each sample decides for itself (module doc)
                    out = pipe.steps.cached_transformer(feeds, [(s.cache, slice(i, i + 1)) for i, s in enumerate(batch)])
                else:
                    out = pipe.executors["transformer"].infer(feeds)["noise_pred"]
            finally:
                if self.loras is not None:
                    self.loras.use(None)
            tokens = first.latents.shape[1]
            for i, s in enumerate(batch):  # each sample's own Euler step (its own dt)
                s.latents = fm.euler_step(s.latents, out[i:i + 1, :tokens].float(), s.dts[s.step])
                s.step += 1
        if dev.type == "cuda":
            pipe.stream.synchronize()
        self.stats.running_batch = len(batch)
        self.stats.step_seconds = time.perf_counter() - t0
        self.stats.steps_run += 1
        self.stats.batch_histogram[len(batch)] += 1
        if self.on_step is not None:
            self.on_step(self.stats)

    def _decode(self, finished: list[Sample]) -> None:
        import torch

        pipe = self.pipe
        by_key: dict = collections.defaultdict(list)
        for s in finished:
            by_key[s.key].append(s)
        for (_, height, width, *_), group in by_key.items():
            for k in range(0, len(group), self.max_batch):
                chunk = group[k:k + self.max_batch]
                images, finite = pipe.decode(torch.cat([s.latents for s in chunk]), height, width)
                for s, img in zip(chunk, images):
                    if not finite:
                        self._finish(s.job, exception=RequestError("the VAE decoder produced NaN/Inf"))
                        continue
                    s.job.images[s.index] = img
                    s.job.caches[s.index] = s.cache.summary() if s.cache is not None else None
                    if len(s.job.images) == s.job.n:
                        self._finish(s.job)

    def _finish(self, job: Job, exception: Exception | None = None) -> bool:
        """Count the job out of the queue (once) and settle its future unless its client cancelled it; False when
        it was already counted out."""
        with self._lock:
            if job.settled:
                return False
            job.settled = True
            self._pending -= job.n
            if job.slots:
                self.loras.release(job.slots)
            self.stats.queued = self._pending
        if job.future.cancelled():  # its client went away: nobody waits for the result
            return True
        try:
            if exception is not None:
                job.future.set_exception(exception)
            else:
                now = time.perf_counter()
                job.future.set_result(Finished(images=[job.images[i] for i in range(job.n)],
                                               queue_seconds=(job.started or now) - job.created,
                                               seconds=now - job.created, caches=[job.caches.get(i) for i in range(job.n)]))
        except InvalidStateError:  # cancelled by its client meanwhile: nobody waits for the result
            pass
        return True

    def _fail(self, samples: list[Sample], e: Exception) -> None:
        jobs = {id(s.job): s.job for s in samples}
        self._active = [s for s in self._active if id(s.job) not in jobs]
        for job in jobs.values():
            self._finish(job, exception=e if isinstance(e, RequestError) else RequestError(f"generation failed: {e}"))


def batch_buckets(max_batch: int) -> tuple:
    """The batch sizes a compiled server transformer is compiled for: powers of two below `max_batch`, and it."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


def allow_compiled_forms(count: int) -> None:
    """Let torch.compile keep `count` forms of one function (dynamo's recompile limit, 8 by default): past the
    limit it runs the function eagerly, silently ten times slower. A server with per-request LoRAs compiles each
    batch size with and without them."""
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), int(count)))


def warm_up_batches(pipe, batches, height: int, width: int, loras=None) -> float:
    """A server's compiled PyTorch transformer: batches padded to the smallest of `batches` that holds them
    (TorchExecutor.padded), and each of those sizes compiled now, at (height, width), rather than on a
    client's request; with `loras` (a LoraBank) each size also with one adapter per sample (slot 0: zeros; a
    stack compiles on its first call). Returns the seconds it took."""

    ex = pipe.executors["transformer"]
    if not isinstance(ex, TorchExecutor):
        raise FluxtrtError("only the PyTorch transformer is compiled (backend torch)")
    t0 = time.perf_counter()
    ex.batch_buckets = tuple(sorted(batches))
    for batch in ex.batch_buckets:
        feeds = ex.spec.sample_inputs(ShapePoint(batch, height, width), pipe.geo, batch)
        for assignment in (None, [[(0, 1.0)]] * batch) if loras is not None else (None,):
            with pipe.on_stream():
                if loras is not None:
                    loras.use(assignment, pipe.device)
                try:
                    ex.infer(feeds)
                finally:
                    if loras is not None:
                        loras.use(None)
    if pipe.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter() - t0
