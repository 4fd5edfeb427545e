"""runtime/parallel.py: context parallelism on CPU processes (gloo). The transformer split over 2 and 3 ranks
(token slices of unequal length) gives the single process's latents at every step within 1e-5 (fp32), for
text-to-image and Fill; a rank that dies ends the run in one line; bad rank counts are one line."""

import os
import signal
import time

import numpy as np
import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.runtime import parallel


def _latents(model: str, n: int, fill: bool) -> list:
    """Run in each rank (and once alone with n 1): the latents after every step of a 3-step 256x320 run."""
    from fluxtrt.core.workflows import ImageInputs
    from fluxtrt.runtime.assembly import open_pipeline
    from tests.core.test_workflows import random_image, random_mask

    rng = np.random.default_rng(5)
    inputs = ImageInputs(image=random_image(rng, 256, 320), mask=random_mask(rng, 256, 320)) if fill else None
    pipe = open_pipeline(model=model, backend="torch", torch_dtype="fp32", device="cpu", parallel=n)
    return pipe.generate(["a red fox in the snow"], 256, 320, 3, 3.5, seed=11, trace=True,
                         inputs=inputs).latents_per_step


def _die_on_rank_1() -> None:
    import torch
    import torch.distributed as dist

    if parallel.current().rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # rank 0 waits for the dead rank


@pytest.mark.slow
@pytest.mark.parametrize("model,n,fill", [("tiny", 2, False), ("tiny", 3, False), ("tiny-fill", 2, True)])
def test_split_transformer_gives_the_single_process_latents(model, n, fill):
    alone = _latents(model, 1, fill)
    split = parallel.launch(n, _latents, model, n, fill, device="cpu")
    assert len(split) == len(alone) == 3
    for i, (a, b) in enumerate(zip(split, alone)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= 1e-5, (i, err)


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_run_in_one_line():
    t0 = time.monotonic()
    with pytest.raises(FluxtrtError, match=r"^rank 1 of 2 ended \(killed by SIGKILL\); the run stopped"):
        parallel.launch(2, _die_on_rank_1, device="cpu")
    assert time.monotonic() - t0 < 30


def test_rank_counts_are_one_line():
    for n in (0, 9):
        with pytest.raises(FluxtrtError, match=f"--parallel takes 1 to 8 ranks, got {n}"):
            parallel.backend_for(n, "cpu")
    assert parallel.backend_for(2, "cpu") == "gloo"
    from fluxtrt.runtime.assembly import open_pipeline

    with pytest.raises(FluxtrtError, match="opens its pipeline in each of its ranks"):
        open_pipeline(model="tiny", backend="torch", parallel=2)
