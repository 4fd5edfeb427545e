"""Context parallelism: one image's transformer split over N ranks on torch.distributed (one GPU each with NCCL,
or CPU processes with gloo), `fluxtrt run --parallel N` and `fluxtrt serve --parallel N`.

The process that opens the pipeline is rank 0, the leader: it runs everything a pipeline runs (text encoders, the
loop, the scheduler, the VAE, a server's batcher) and starts N - 1 followers (`Team`: torch.multiprocessing,
spawned; under Ray Serve inside the replica that owns N GPUs). A follower opens the same pipeline and runs only
what the leader sends it (`follow`): before each transformer call (the whole transformer, or one of First-Block
Cache's parts), the leader broadcasts the call's name and inputs (`lead`), so every rank computes the same call;
the cache's decision is the leader's alone, so the ranks never disagree on it.

In a call, the token sequence is cut into N contiguous slices, the image tokens and the text tokens each
(`shard`): every per-token layer of FLUX (projections, norms, modulation, RoPE from the slice's own ids) runs on
the rank's slice alone. Attention needs the whole sequence (attention.context_parallel): Ulysses (all-to-all from
token slices to head slices and back; where the heads divide by N) or every rank's keys and values gathered (any
N, any head count). The outputs' slices are gathered back (`gather`), so the leader holds the whole result.

A follower that dies or fails ends the run with one line naming it (`failure`); Ctrl-C and the end of the run end
every follower (`Team.close`)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from ..attention import ATTENTION, MAX_RANKS, attention_mode  # noqa: F401  (the modes, resolved per model)
from ..errors import FluxtrtError

# a collective waiting this long for a rank ends the run: long, since a rank's first call may load and compile
# its transformer (minutes at full size); a rank that dies is noticed at once (Team.failure, watch)
TIMEOUT_S = 1800


@dataclass(frozen=True)
class Rank:
    """This process's place in a context-parallel run."""

    rank: int
    size: int
    backend: str = "gloo"
    attention: str = "auto"  # --parallel-attention (attention_mode resolves auto per model)
    group: object = None  # the torch.distributed process group (None: the default group)

    @property
    def device(self):
        """Where the collectives' tensors live: the rank's GPU with NCCL, the CPU with gloo."""
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")


_CURRENT: Rank | None = None
_TEAM: "Team | None" = None


def current() -> Rank | None:
    """This process's Rank in a context-parallel run (the leader's once its Team started); None elsewhere."""
    return _CURRENT


def backend_for(n: int, device: str | None) -> str:
    """torch.distributed's backend for n ranks on `device` (None: CUDA where there is one): "nccl" (one GPU per
    rank, all of one kind) or "gloo" (CPU processes); one line for what cannot run."""
    import torch

    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_RANKS:
        raise FluxtrtError(f"--parallel takes 1 to {MAX_RANKS} ranks, got {n}")
    gpu = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    if not gpu:
        return "gloo"
    have = torch.cuda.device_count()
    if n > have:
        raise FluxtrtError(f"--parallel {n} needs {n} GPUs, this machine has {have}; ask for at most {have}")
    kinds = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    if len(kinds) > 1:
        raise FluxtrtError(f"--parallel splits one image over GPUs of one kind; these are {', '.join(kinds)}: set "
                           "CUDA_VISIBLE_DEVICES to GPUs of one kind")
    return "nccl"


class Team:
    """The leader's side of an n-rank run: the followers (spawned processes, each `_follower`), this process as
    rank 0 of the process group, and a watcher that notices a follower that ended."""

    def __init__(self, n: int, options, opener):
        """Start n - 1 followers, each opening `options` (runtime.options.PipelineOptions) with `opener`
        (assembly.open_pipeline); this process joins as rank 0. One line for what cannot run (backend_for)."""
        import datetime

        import torch.distributed as dist
        import torch.multiprocessing as mp

        global _CURRENT, _TEAM
        if _TEAM is not None:
            raise FluxtrtError("one context-parallel pipeline per process: close the other first")
        self.n, self.backend = n, backend_for(n, options.device)
        port = _free_port()
        self.errors = mp.get_context("spawn").SimpleQueue()
        self.context = mp.start_processes(_follower, args=((n, port, self.backend, options, opener, self.errors),),
                                          nprocs=n - 1, join=False, start_method="spawn")
        self.closed, self.line, self.lock = False, None, threading.Lock()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if self.backend == "nccl":
            import torch

            torch.cuda.set_device(0)
        try:
            dist.init_process_group(self.backend, rank=0, world_size=n,
                                    timeout=datetime.timedelta(seconds=TIMEOUT_S))
        except Exception:  # a follower that could not start (its line, where it said one)
            self.close()
            raise FluxtrtError(self.failure() or f"the {n} ranks of --parallel did not meet") from None
        _CURRENT, _TEAM = Rank(0, n, self.backend, options.parallel_attention), self
        watch(self)
        import atexit

        atexit.register(self.close, True)  # a leader that exits without closing does not wait on its followers

    def failure(self) -> str | None:
        """One line for a follower that failed or ended before the run's end (the first one seen), None while
        all run."""
        import signal

        with self.lock:  # the watcher thread asks too
            if self.line is None and not self.errors.empty():
                self.line = self.errors.get()
        for i, p in enumerate(self.context.processes):
            if self.line is None and p.exitcode is not None and not self.closed:
                how = (f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                       else f"exit status {p.exitcode}")
                self.line = f"rank {i + 1} of {self.n} ended ({how}); the run stopped (the other ranks were ended too)"
        return self.line

    def close(self, abort: bool = False) -> None:
        """End the run: the followers told to stop and joined, or (`abort`, or one ended) ended."""
        import torch.distributed as dist

        global _CURRENT, _TEAM
        if self.closed:
            return
        self.closed = True
        alive = not abort and all(p.exitcode is None for p in self.context.processes)
        if alive and dist.is_initialized():
            try:
                _send_header(current(), ("stop", []))
            except Exception:  # a follower went away meanwhile: it is ended below
                pass
        for p in self.context.processes:
            p.join(timeout=10 if alive else 0)
        for p in self.context.processes:
            if p.exitcode is None:
                p.terminate()
        for p in self.context.processes:
            p.join(timeout=2)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        _CURRENT, _TEAM = None, None


def start(options, opener) -> Team:
    """The leader's Team for `options.parallel` ranks, its followers opening their pipelines with `opener`
    (Assembly calls it when it opens a split pipeline, with open_pipeline)."""
    return Team(options.parallel, options, opener)


def stop(abort: bool = False) -> None:
    """End the leader's Team, if this process leads one (the end of `fluxtrt run`, a server's close); `abort`:
    without telling the followers (they may be inside a call)."""
    if _TEAM is not None and _CURRENT is not None and _CURRENT.rank == 0:
        _TEAM.close(abort)
        from ..attention import bind_context

        bind_context(None, 1, None)  # a split package's attention no longer has ranks to run on


def failure() -> str | None:
    """The line of a follower of this process's Team that ended, None while all run (or there is no Team)."""
    return _TEAM.failure() if _TEAM is not None else None


def failed(error: Exception) -> FluxtrtError:
    """A collective that raised in the leader, as one line: the follower that ended, where one did."""
    import time

    if _TEAM is not None:
        for _ in range(20):  # the follower's exit may trail the broken connection by a moment
            line = _TEAM.failure()
            if line:
                return FluxtrtError(line)
            time.sleep(0.1)
    return FluxtrtError(f"the --parallel run failed: {str(error).strip().splitlines()[0][:300]}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _follower(index: int, job: tuple) -> None:
    """Follower `index + 1`: its process group, the same pipeline, then `follow` until the leader stops; a
    FluxtrtError's line goes to the leader. `job`: (ranks, port, backend, options, opener, errors)."""
    import datetime
    import signal
    import sys

    import torch
    import torch.distributed as dist

    global _CURRENT
    n, port, backend, options, opener, errors = job
    rank = index + 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the leader's: it ends the followers (Team.close)
    _end_with(os.getppid())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=n, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    _CURRENT = Rank(rank, n, backend, options.parallel_attention)
    try:
        follow(opener(options=options))
    except FluxtrtError as e:
        errors.put(f"rank {rank} of {n}: {e}")
        sys.exit(2)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _end_with(leader: int, period_s: float = 1.0) -> None:
    """End this follower when its leader process is gone (killed outright: nothing told the followers)."""
    import time

    def run():
        while os.getppid() == leader:
            time.sleep(period_s)
        os._exit(1)

    threading.Thread(target=run, name="fluxtrt-follower-leader", daemon=True).start()


def follow(pipe) -> None:
    """A follower's loop: each call the leader sends (the transformer, or one of its parts) computed on this
    rank's slice, until the leader says stop."""
    while True:
        name, feeds = receive(current())
        if name == "stop":
            return
        if name == "transformer":
            pipe.executors["transformer"].infer(feeds)
        else:
            pipe.steps.run_part(name, feeds)


def split_call(rank: Rank, spec, feeds: dict, run) -> dict:
    """One call of `spec` (the transformer or one of its parts) over the ranks: the leader sends it to the
    followers (`lead`), each rank runs `run(feeds) -> {output: tensor}` on its slice (`shard`), and the outputs'
    slices are gathered (`gather`). A follower that ended (the broadcast, attention's collectives or the gather
    met it) is one line (`failed`)."""
    import torch

    try:
        lead(rank, spec.name, feeds)
        with torch.inference_mode():
            return gather(spec, run(shard(spec, feeds, rank)), rank)
    except RuntimeError as e:  # gloo says so at once; NCCL at its timeout, or `watch` ends the leader first
        raise failed(e) from None


def lead(rank: Rank, name: str, feeds: dict) -> None:
    """The leader's call `name` with `feeds` sent to every follower (no-op on a follower)."""
    import torch.distributed as dist

    if rank.rank != 0:
        return
    items = sorted((k, v) for k, v in feeds.items() if v is not None)
    _send_header(rank, (name, [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in items]))
    for _, v in items:
        dist.broadcast(v.to(rank.device).contiguous(), src=0, group=rank.group)


def _send_header(rank: Rank, header: tuple) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([header], src=0, group=rank.group, device=rank.device)


def receive(rank: Rank) -> tuple[str, dict]:
    """A follower's next call from the leader: (name, feeds)."""
    import torch
    import torch.distributed as dist

    box = [None]
    dist.broadcast_object_list(box, src=0, group=rank.group, device=rank.device)
    name, layout = box[0]
    feeds = {}
    for key, shape, dtype in layout:
        feeds[key] = torch.empty(shape, dtype=getattr(torch, dtype), device=rank.device)
        dist.broadcast(feeds[key], src=0, group=rank.group)
    return name, feeds


_CALL_SIZES: list = []  # every rank's attention sequence length in the call running now (`shard` sets it)


def call_sizes() -> list:
    """Every rank's attention sequence length (its text slice + its image slice) in the call running now."""
    return _CALL_SIZES


def split_sizes(length: int, n: int) -> list[int]:
    """The lengths torch.tensor_split(length, n) gives, rank by rank."""
    return [length // n + (1 if r < length % n else 0) for r in range(n)]


def _token_axes(tensors) -> dict:
    return {t.name: t.token_axis for t in tensors}


def shard(spec, feeds: dict, rank: Rank) -> dict:
    """This rank's slice of a call's inputs: the image tokens and the text tokens each cut into `rank.size`
    contiguous slices (torch.tensor_split: sizes differ by one at most); per-sample inputs whole."""
    import torch

    axes = _token_axes(spec.inputs)
    lengths = {}  # "image_tokens" / "geo.t5_length" -> the call's length
    for t in spec.inputs:
        if feeds.get(t.name) is not None and axes[t.name] is not None:
            lengths[t.dims[axes[t.name]]] = feeds[t.name].shape[axes[t.name]]
    _CALL_SIZES[:] = [sum(s) for s in zip(*(split_sizes(n, rank.size) for n in lengths.values()))]
    return {name: torch.tensor_split(v, rank.size, dim=axes[name])[rank.rank] if axes.get(name) is not None else v
            for name, v in feeds.items()}


def gather(spec, out: dict, rank: Rank) -> dict:
    """A call's output slices of every rank joined along their tokens (per-sample outputs are whole already)."""
    from ..attention import gather_sequence

    axes = _token_axes(spec.outputs)
    return {k: gather_sequence(v, rank.group, dim=axes[k]) if axes.get(k) is not None else v for k, v in out.items()}


def watch(team: Team, period_s: float = 0.5) -> threading.Thread:
    """A thread that ends this process in one line when a follower ended and the leader is stuck in a collective
    that NCCL would hold until its timeout (gloo raises at once; `failed` says the line then)."""
    import sys
    import time

    def run():
        since = None
        while not team.closed:
            if since is None and team.failure():
                since = time.monotonic()
            if since is not None and time.monotonic() - since > 10 and not team.closed:
                print(f"error: {team.failure()}", file=sys.stderr, flush=True)
                os._exit(2)
            time.sleep(period_s)

    thread = threading.Thread(target=run, name="fluxtrt-parallel-watch", daemon=True)
    thread.start()
    return thread
