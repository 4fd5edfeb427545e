"""The transformer's step as the denoising loop calls it: eager, replayed from a CUDA graph captured once per
shape, or through First-Block Cache's parts (stepcache.py decides; the parts run on any executor). `generate` and
the continuous batcher both call it."""

from __future__ import annotations

from ..components import TRANSFORMER_PARTS, specs_for
from ..errors import FluxtrtError, RequestError
from .executors import PackageExecutor, TorchExecutor, wait_for_reads
from .tensorrt import TensorRTExecutor


class TransformerStep:
    """step(latents, timestep) functions over a pipeline's transformer executor (and its parts)."""

    def __init__(self, executors: dict, geo, cuda_graph: bool, stream):
        self.executors, self.geo, self.cuda_graph, self.stream = executors, geo, cuda_graph, stream
        self.graphs: dict[tuple, CudaGraphStep] = {}

    @property
    def device(self):
        return self.executors["transformer"].device

    def step_function(self, feeds: dict, refresh: bool = False, schedule=None):
        """step(latents, timestep) -> noise_pred: eager, or a CUDA graph captured once per shape. `refresh`: the
        graph is shared with another set of feeds of the same shapes (true CFG), so copy these in every call.
        `schedule`: the timesteps the calls will be made at, in order (a generation): the PyTorch transformer then
        computes every step's modulation up front (runtime/modulation.py); call `end` after the last step."""
        ex = self.executors["transformer"]
        if isinstance(ex, TensorRTExecutor) and not ex.active:
            ex.activate()  # whether TensorRT captures the graph itself is known once the context exists
        rows = self._rows(feeds, schedule)
        if self.cuda_graph and captures_step_itself(ex) and self.device.type == "cuda":
            key = (tuple((k, tuple(v.shape)) for k, v in sorted(feeds.items())), rows is not None)
            if key not in self.graphs:
                self.graphs[key] = CudaGraphStep(ex, feeds, self.stream)
            graph = self.graphs[key]
            if refresh:
                def replay(latents, timestep):
                    graph.set_call_inputs(feeds)
                    return graph(latents, timestep)

                return _scheduled(replay, rows)
            graph.set_call_inputs(feeds)
            return _scheduled(graph, rows)

        def eager(latents, timestep):
            feeds["hidden_states"], feeds["timestep"] = latents, timestep
            return ex.infer(feeds)["noise_pred"]

        return _scheduled(eager, rows)

    def _rows(self, feeds: dict, schedule):
        """The schedule's modulation rows (step 0 selected, so a graph captured next reads them), or None: the
        transformer computes its modulation in each call (and is told so)."""
        ex = self.executors["transformer"]
        rows = ex.schedule_rows(feeds, schedule) if schedule is not None and hasattr(ex, "schedule_rows") else None
        if rows is None:
            self.end()
        else:
            rows.select(0)
        return rows

    def end(self) -> None:
        """After a generation's last step: the transformer computes its modulation again (the batcher's calls)."""
        ex = self.executors["transformer"]
        if hasattr(ex, "modulation_off"):
            ex.modulation_off()

    def step_cache(self, threshold: float):
        """A fresh First-Block Cache for one generation, or None for threshold 0 (the uncached step, bit for
        bit); one line where the transformer's executor cannot run its parts."""
        from ..stepcache import FirstBlockCache

        if not threshold:
            return None
        ex = self.executors["transformer"]
        if not hasattr(ex, "infer_part") and not all(p in self.executors for p in TRANSFORMER_PARTS):
            raise RequestError("--cache-threshold runs the transformer as First-Block Cache's parts, which these "
                               "engines lack; rebuild with `fluxtrt build --first-block-cache` (or --backend torch)")
        return FirstBlockCache(threshold)

    def run_part(self, name: str, feeds: dict) -> dict:
        """One of the transformer's First-Block Cache parts: the PyTorch module's (TorchExecutor.infer_part) or
        its own engine / ONNX (`fluxtrt build --first-block-cache`)."""
        ex = self.executors["transformer"]
        if hasattr(ex, "infer_part"):
            from ..components import transformer_parts

            return ex.infer_part(transformer_parts(self.geo)[name], feeds)
        spec = specs_for(self.geo, [name])[name]
        return self.executors[name].infer({t.name: feeds[t.name] for t in spec.inputs})

    def cached_step(self, feeds: dict, cache, branch: str, schedule=None):
        """step(latents, timestep) -> noise_pred through the transformer's parts and `cache` (stepcache.py);
        `schedule` as step_function's."""
        rows = self._rows(feeds, schedule)

        def step(latents, timestep):
            feeds["hidden_states"], feeds["timestep"] = latents, timestep
            return self.cached_transformer(feeds, [(cache, slice(None))], branch)

        return _scheduled(step, rows)

    def cached_transformer(self, feeds: dict, groups: list, branch: str = "cond"):
        """noise_pred through First-Block Cache's parts for `groups` [(FirstBlockCache or None, row slice)]: each
        group decides on its own rows (a generation: one group over the batch, as diffusers; the batcher: one per
        sample). The tail runs for the whole batch when any group needs it; a group that skips takes its kept
        residual, and only groups that computed keep the tail's output. None: no cache (always computes)."""
        import torch

        head = self.run_part("transformer_head", feeds)
        decided = [(c, rows, c is None or c.must_compute(branch, head["head_residual"][rows])) for c, rows in groups]
        tail = None
        if any(compute for _, _, compute in decided):
            tail = self.run_part("transformer_tail", dict(head, img_ids=feeds["img_ids"],
                                                          txt_ids=feeds["txt_ids"]))["tail_hidden"]
        hidden = []
        for c, rows, compute in decided:
            if c is not None:
                c.record(branch, compute)
                if compute:
                    c.keep(branch, head["head_residual"][rows], head["head_hidden"][rows], tail[rows])
            hidden.append(tail[rows] if compute else c.cached(branch, head["head_hidden"][rows]))
        hidden = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        return self.run_part("transformer_out", {"hidden": hidden, "temb": head["temb"]})["noise_pred"]


def _scheduled(step, rows):
    """`step`, selecting the next step's modulation row before each call (rows None: `step` itself)."""
    if rows is None:
        return step
    calls = iter(range(rows.table.shape[0]))

    def scheduled(latents, timestep):
        rows.select(next(calls))
        return step(latents, timestep)

    return scheduled


def captures_step_itself(ex) -> bool:
    """--cuda-graph: the pipeline captures the transformer step (CudaGraphStep, after warm-up calls) for the
    PyTorch module, a compiled package and for full TensorRT, whose runtime config has no graph strategy;
    TensorRT-RTX captures the whole graph itself (cuda_graph_strategy = WHOLE_GRAPH_CAPTURE)."""
    if isinstance(ex, (TorchExecutor, PackageExecutor)):
        return True
    return isinstance(ex, TensorRTExecutor) and not ex.native_cuda_graph


class CudaGraphStep:
    """The transformer step captured as a CUDA graph for one set of shapes and replayed every step. Its
    static input buffers are allocated once per shape; a step only copies latents and timestep into them."""

    PER_STEP = ("hidden_states", "timestep")

    def __init__(self, executor, feeds: dict, stream):
        import torch

        self.static = {k: v.clone() for k, v in feeds.items()}
        wait_for_reads()  # no weights read onto the GPU from another thread while the graph is captured
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, lazy init)
                executor.infer(self.static)
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a CUDA call of another thread (a server's request handler) cannot spoil this capture
            with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
                self.out = executor.infer(self.static)["noise_pred"]
        except Exception as e:  # torch.AcceleratorError: an executor that waits on the host inside its call
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise FluxtrtError(f"--cuda-graph: the {executor.kind} transformer cannot be captured as a CUDA graph "
                               f"({first}); run without --cuda-graph") from None

    def set_call_inputs(self, feeds: dict) -> None:
        for k, v in feeds.items():
            if k not in self.PER_STEP:
                self.static[k].copy_(v)

    def __call__(self, latents, timestep):
        self.static["hidden_states"].copy_(latents)
        self.static["timestep"].copy_(timestep)
        self.graph.replay()
        return self.out
