"""Context parallelism: one image's transformer split over N processes on torch.distributed (one GPU each with
NCCL, or CPU processes with gloo), `fluxtrt run --parallel N`.

Every rank runs the same pipeline on the same seed (text encoders, scheduler and VAE are cheap and identical
everywhere); only the transformer is split. Its token sequence is cut into N contiguous slices, the image tokens
and the text tokens each (`shard`): every per-token layer of FLUX (projections, norms, modulation, RoPE from the
slice's own ids) runs on the rank's slice alone, and attention gathers every rank's keys and values
(attention.context_parallel), so each rank's queries see the whole sequence and the result is exact for any N up
to 8 and any head count. The output slices are gathered back (`gather`), so every rank holds the same latents;
rank 0 writes the images and returns its result to the launching process (`launch`).

Process handling is torch.multiprocessing's: a rank that raises or dies ends the others, and the launch says which
in one line; Ctrl-C reaches every rank (one process group)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import FluxtrtError

MAX_RANKS = 8
TIMEOUT_S = 60  # a collective waiting this long for a rank ends the run


@dataclass(frozen=True)
class Rank:
    """This process's place in a context-parallel run."""

    rank: int
    size: int
    group: object = None  # the torch.distributed process group (None: the default group)


_CURRENT: Rank | None = None


def current() -> Rank | None:
    """This process's Rank inside a `launch`ed run; None elsewhere."""
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


def launch(n: int, fn, *args, device: str | None = None):
    """fn(*args) on n ranks (spawned processes, `current()` set in each); rank 0's return value. A rank that
    raises a FluxtrtError ends the run with its line; one that dies (a signal, an exit) with a line naming it."""
    import signal

    import torch.multiprocessing as mp

    backend = backend_for(n, device)
    queue = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_entry, args=((n, _free_port(), backend, fn, args, queue),), nprocs=n, join=False,
                             start_method="spawn")
    answers = []
    try:
        while not ctx.join(timeout=0.2):
            while not queue.empty():
                answers.append(queue.get())
    except mp.ProcessExitedException as e:
        while not queue.empty():
            answers.append(queue.get())
        errors = [a[1] for a in answers if a[0] == "error"]
        if errors:
            raise FluxtrtError(errors[0]) from None
        how = (f"killed by {signal.Signals(-e.exit_code).name}" if e.exit_code and e.exit_code < 0
               else f"exit status {e.exit_code}")
        raise FluxtrtError(f"rank {e.error_index} of {n} ended ({how}); the run stopped (the other ranks were "
                           "ended too)") from None
    except mp.ProcessRaisedException as e:
        last = str(e).strip().splitlines()[-1][:300]
        raise FluxtrtError(f"a rank of the --parallel {n} run failed: {last}") from None
    while not queue.empty():
        answers.append(queue.get())
    import pickle

    return pickle.loads(next(a[1] for a in answers if a[0] == "result"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, job: tuple) -> None:
    """One rank: its process group, `current()`, fn(*args); rank 0's result (or any rank's one-line error) to
    the launching process. `job`: (ranks, port, backend, fn, args, queue)."""
    import datetime
    import pickle
    import sys

    import torch
    import torch.distributed as dist

    global _CURRENT
    n, port, backend, fn, args, queue = job
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=n, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    _CURRENT = Rank(rank, n)
    try:
        out = fn(*args)
        if rank == 0:  # pickled by value: torch's queue would share tensors with a process about to exit
            queue.put(("result", pickle.dumps(out)))
    except FluxtrtError as e:
        queue.put(("error", str(e)))
        sys.exit(2)
    finally:
        dist.destroy_process_group()


def shard(spec, feeds: dict, rank: Rank) -> dict:
    """This rank's slice of the transformer's inputs: the image tokens (hidden_states, img_ids) and the text
    tokens (encoder_hidden_states, txt_ids) each cut into `rank.size` contiguous slices (torch.tensor_split: sizes
    differ by one at most); per-sample inputs whole."""
    import torch

    axes = {t.name: [i for i, d in enumerate(t.dims) if d in ("image_tokens", "geo.t5_length")] for t in spec.inputs}
    out = {}
    for name, v in feeds.items():
        axis = axes.get(name, [])
        out[name] = torch.tensor_split(v, rank.size, dim=axis[0])[rank.rank] if axis else v
    return out


def gather(out, rank: Rank):
    """The transformer's output slices of every rank joined along the image tokens (dim 1), on every rank."""
    from ..attention import gather_sequence

    return gather_sequence(out, rank.group, dim=1)
