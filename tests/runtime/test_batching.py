"""runtime/batching.py: step-level continuous batching over one Pipeline: requests joining a running batch equal
their single runs, a full queue is refused, a cancelled request leaves at the next step boundary."""

import numpy as np
import pytest

from fluxtrt.models.source import resolve_model
from fluxtrt.runtime.assembly import open_pipeline
from fluxtrt.runtime.batching import ContinuousBatcher, QueueFull, batch_buckets
from fluxtrt.runtime.pipeline import RequestError

MAX_UINT8_DIFF = 2  # of 255: a batched sample vs the same request run alone
PROMPTS = ["a red fox in the snow", "a bowl of ramen", "a lighthouse at night", "an oil painting of a lake",
           "a cat on a sofa", "a mountain village"]


def diff(a, b) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def random_requests(rng, count, sizes=((256, 256), (256, 320))):
    return [(PROMPTS[int(rng.integers(len(PROMPTS)))], *sizes[int(rng.integers(len(sizes)))], int(rng.integers(1, 5)),
             float(rng.uniform(1.0, 6.0)), int(rng.integers(0, 2**31)), int(rng.integers(1, 3))) for _ in range(count)]


def check_batched_equals_single(pipe, make_batcher):
    """Requests of different sizes, step counts, guidance and seeds, half submitted while the first half is
    running: each image equals `generate` of the same request alone (seed s + i for image i)."""
    rng = np.random.default_rng()
    reqs = random_requests(rng, 6)
    batcher = make_batcher(pipe)
    futures = [batcher.submit(*r[:5], seed=r[5], n=r[6]) for r in reqs[:3]]
    batcher.step_once()
    batcher.step_once()
    futures += [batcher.submit(*r[:5], seed=r[5], n=r[6]) for r in reqs[3:]]  # join at a step boundary
    batcher.run_until_idle()
    assert max(batcher.stats.batch_histogram) > 1  # samples did share transformer calls
    for (prompt, h, w, steps, guidance, seed, n), fut in zip(reqs, futures):
        done = fut.result(timeout=0)
        assert len(done.images) == n and done.seconds >= done.queue_seconds >= 0
        for i, img in enumerate(done.images):
            alone = pipe.generate([prompt], h, w, steps, guidance, seed=seed + i).images[0]
            assert img.shape == (h, w, 3) and diff(img, alone) <= MAX_UINT8_DIFF


def test_batcher_matches_single_runs_torch():
    pipe = open_pipeline(None, backend="torch", model=resolve_model("tiny"), device="cpu", torch_dtype="fp32")
    check_batched_equals_single(pipe, lambda p: ContinuousBatcher(p, max_batch=3))


def test_batcher_refuses_bad_requests_and_a_full_queue():
    pipe = open_pipeline(None, backend="torch", model=resolve_model("tiny-schnell"), device="cpu", torch_dtype="fp32")
    batcher = ContinuousBatcher(pipe, max_batch=2, max_queue=3)
    with pytest.raises(RequestError, match="width 250 is not a positive multiple of 16"):
        batcher.submit("a cat", 256, 250, 2)
    with pytest.raises(RequestError, match="non-empty"):
        batcher.submit("  ", 256, 256, 2)
    batcher.submit("a cat", 256, 256, 2, n=2)
    with pytest.raises(QueueFull, match="2 images are queued \\(max 3\\)"):
        batcher.submit("a dog", 256, 256, 2, n=2)
    batcher.run_until_idle()
    batcher.submit("a dog", 256, 256, 2, n=2).cancel()  # accepted again once the queue drained
    with pytest.raises(RequestError, match="--max-batch must be at least 1"):
        ContinuousBatcher(pipe, max_batch=0)


def test_a_cancelled_request_leaves_at_the_next_step_and_the_counts_stay_true():
    """Two requests of 1000 steps x 8 images whose clients went away stop running at the next step boundary: the
    queue drops to what is left, a normal request behind them finishes after a handful of steps, not 1000."""
    pipe = open_pipeline(None, backend="torch", model=resolve_model("tiny-schnell"), device="cpu", torch_dtype="fp32")
    batcher = ContinuousBatcher(pipe, max_batch=4, max_queue=64)
    gone = [batcher.submit("a cat", 256, 256, 1000, seed=k, n=8) for k in range(2)]
    batcher.step_once()
    batcher.step_once()
    assert batcher.stats.queued == 16
    batcher.cancel(gone[0])
    batcher.step_once()
    assert batcher.stats.queued == 8 and batcher.stats.cancelled == 1
    normal = batcher.submit("a dog", 256, 256, 2, seed=3)
    batcher.cancel(gone[1])
    batcher.run_until_idle()
    assert batcher.stats.queued == 0 and batcher.stats.cancelled == 2 and batcher.stats.steps_run <= 6
    alone = pipe.generate(["a dog"], 256, 256, 2, 3.5, seed=3).images[0]
    assert diff(normal.result(timeout=0).images[0], alone) <= MAX_UINT8_DIFF
    assert all(f.cancelled() for f in gone)


def test_batch_buckets_are_powers_of_two_up_to_the_largest_batch():
    assert batch_buckets(1) == (1,) and batch_buckets(4) == (1, 2, 4) and batch_buckets(6) == (1, 2, 4, 6)
