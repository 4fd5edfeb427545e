"""runtime/parallel.py: context parallelism on CPU processes (gloo). The transformer split over 2, 3 and 4 ranks
(token slices of unequal length; Ulysses where tiny's 2 heads divide, gathered keys and values elsewhere) gives the
single process's latents at every step within 1e-5 (fp32), for text-to-image, Fill and First-Block Cache (the same
steps skipped); Ulysses' all-to-all equals whole-sequence attention on 4 and 8 ranks; a follower that dies ends the run
in one line; Ctrl-C ends every rank; bad rank counts are one line; a served request on a 2-rank replica equals the
single process's run."""

import base64
import io
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.runtime import parallel
from fluxtrt.runtime.assembly import open_pipeline

RUN = dict(prompts=["a red fox in the snow"], height=256, width=320, guidance=3.5, seed=11)


def _trace(pipe, steps: int, fill: bool = False, cache: float = 0.0, size=(RUN["height"], RUN["width"])):
    from fluxtrt.core.workflows import ImageInputs
    from tests.core.test_workflows import random_image, random_mask

    rng = np.random.default_rng(5)
    inputs = ImageInputs(image=random_image(rng, *size), mask=random_mask(rng, *size)) if fill else None
    return pipe.generate(RUN["prompts"], *size, steps, RUN["guidance"], seed=RUN["seed"], trace=True, inputs=inputs,
                         cache_threshold=cache)


def _open(model: str, n: int, attention: str = "auto"):
    return open_pipeline(model=model, backend="torch", torch_dtype="fp32", device="cpu", parallel=n,
                         parallel_attention=attention)


def _close_to(split, alone, bound: float = 1e-5):
    assert len(split) == len(alone)
    for i, (a, b) in enumerate(zip(split, alone)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= bound, (i, err)


@pytest.mark.slow
@pytest.mark.parametrize("model,n,fill,mode", [("tiny", 2, False, "ulysses"), ("tiny", 3, False, "gather"),
                                                ("tiny", 4, False, "gather"), ("tiny-fill", 2, True, "ulysses")])
def test_split_transformer_gives_the_single_process_latents(model, n, fill, mode):
    alone = _trace(_open(model, 1), 3, fill).latents_per_step
    pipe = _open(model, n)
    try:
        res = _trace(pipe, 3, fill)
        assert pipe.executors["transformer"].parallel_note == f"the transformer split over {n} ranks ({mode} attention)"
        _close_to(res.latents_per_step, alone)
    finally:
        pipe.close()
    assert parallel.current() is None


@pytest.mark.slow
def test_fp8_attn_recipe_split_gives_the_single_process_latents(fp8_attn_build):
    """The engines' fp8-attn recipe on the PyTorch transformer (fp8 GEMMs and E4M3 attention, emulated on the
    CPU) split over 2 ranks (Ulysses). Bound 1e-3 relative: an element whose fp32 input differs by rounding from
    the single process's may round to the neighbouring E4M3 value; a wrong head or token order is O(1)."""
    _, folder, _ = fp8_attn_build
    opened = [open_pipeline(folder, backend="torch", torch_dtype="fp32", device="cpu", parallel=n) for n in (1, 2)]
    try:
        alone, split = (_trace(p, 2) for p in opened)
        assert "fp8" in (opened[1].executors["transformer"].fp8_note or "")
    finally:
        opened[1].close()
    for i, (a, b) in enumerate(zip(split.latents_per_step, alone.latents_per_step, strict=True)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= 1e-3, (i, err)


@pytest.mark.slow
def test_first_block_cache_skips_the_same_steps_when_split():
    single = _open("tiny", 1)
    for threshold in (0.05, 0.1, 0.2, 0.3, 0.5, 0.8):
        alone = _trace(single, 8, cache=threshold)
        if 1 < alone.timings.cache["computed"] < 8:
            break
    else:
        pytest.fail("tiny skipped no step or all steps at every threshold")
    pipe = _open("tiny", 2, "gather")
    try:
        res = _trace(pipe, 8, cache=threshold)
    finally:
        pipe.close()
    assert res.timings.cache == alone.timings.cache
    _close_to(res.latents_per_step, alone.latents_per_step)


@pytest.fixture(scope="module")
def split_packages(tmp_path_factory):
    """tiny's transformer (and its First-Block Cache parts) compiled for this CPU split over 2 ranks: `fluxtrt build
    --gpu cpu --backend torch --static-shape --parallel 2 --first-block-cache --components transformer` (1024²,
    Ulysses; the text encoders and the VAE run as PyTorch modules of the manifest's model), once per test run
    (shared by the workers)."""
    from fluxtrt import api
    from tests.conftest import shared_folder

    root = shared_folder(tmp_path_factory, "pt2-split2", lambda root: api.build(
        gpu="cpu", backend="torch", model="tiny", out_dir=root, static_shape=True, parallel=2, first_block_cache=True,
        components=["transformer"]))
    return root / "cpu-parallel2"


@pytest.mark.slow
def test_split_packages_give_the_single_process_latents_with_and_without_first_block_cache(split_packages):
    """Packages compiled split over 2 ranks (each attention an op that runs Ulysses' all-to-all on the rank's
    group when the package is called) against the single process's PyTorch module (fp32), 1024² (the packages'
    static size): every step's latents within 1e-3 relative (Inductor's C++ kernels, vectorized reductions and
    fused pointwise work, round apart from eager: 1.8e-4 seen at step 2; a wrong slice or head order is O(1)), and
    First-Block Cache computes and skips the same steps."""
    from fluxtrt.records import read_manifest

    assert read_manifest(split_packages).components["transformer"].parallel == {"ranks": 2, "attention": "ulysses"}
    size = (1024, 1024)
    single = _open("tiny", 1)
    pipe = open_pipeline(split_packages, backend="torch", device="cpu", parallel=2)
    try:
        assert pipe.executors["transformer"].kind == "pt2" and pipe.executors["transformer_head"].context.size == 2
        _close_to(_trace(pipe, 3, size=size).latents_per_step, _trace(single, 3, size=size).latents_per_step, 1e-3)
        for threshold in (0.05, 0.1, 0.2, 0.3, 0.5, 0.8):
            alone = _trace(single, 6, cache=threshold, size=size)
            if 1 < alone.timings.cache["computed"] < 6:
                break
        else:
            pytest.fail("tiny skipped no step or all steps at every threshold")
        res = _trace(pipe, 6, cache=threshold, size=size)
    finally:
        pipe.close()
    assert res.timings.cache == alone.timings.cache
    _close_to(res.latents_per_step, alone.latents_per_step, 1e-3)
    assert parallel.current() is None


@pytest.mark.slow
def test_split_packages_run_only_as_they_were_compiled(split_packages, tmp_path):
    """Each mismatch is one line before any follower starts: split packages without --parallel or with another
    rank count, another attention mode, whole packages with --parallel, a damaged parallel record."""
    import json
    import shutil

    from typer.testing import CliRunner

    from fluxtrt.cli import app
    from fluxtrt.records import ManifestError

    shown = CliRunner().invoke(app, ["inspect", str(split_packages)])
    assert shown.exit_code == 0 and "split over 2 ranks (ulysses attention): run with --parallel 2" in \
        " ".join(shown.output.split()), shown.output
    for n, attention, says in ((1, "auto", r"compiled split over 2 ranks; run them with --parallel 2"),
                               (4, "auto", r"compiled split over 2 ranks; run them with --parallel 2"),
                               (2, "gather", r"compiled ulysses attention in; drop --parallel-attention")):
        with pytest.raises(FluxtrtError, match=says):
            open_pipeline(split_packages, backend="torch", device="cpu", parallel=n, parallel_attention=attention)
    folder = tmp_path / "cpu-parallel2"
    shutil.copytree(split_packages, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for record, error, says in ((None, FluxtrtError, r"compiled to run whole; run them without --parallel"),
                                ({"ranks": "2", "attention": "ulysses"}, ManifestError, "parallel record is damaged")):
        for name in ("transformer", "transformer_head", "transformer_tail", "transformer_out"):
            manifest["components"][name]["parallel"] = record
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(error, match=says):
            open_pipeline(folder, backend="torch", device="cpu", parallel=2)
    assert parallel.current() is None


def test_split_builds_are_refused_in_one_line_before_any_work(tmp_path):
    """`build --parallel`: ranks out of 2..8, TensorRT engines, a profile of several sizes, no transformer; tokens
    that do not divide over the ranks (rank_share); a split package's attention op outside its ranks."""
    import torch

    from fluxtrt import api
    from fluxtrt.attention import bind_context, context_attention_op
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.errors import BuildError
    from fluxtrt.models.source import resolve_model
    from fluxtrt.stages.package import rank_share

    for fields, says in (({"parallel": 9, "backend": "torch", "static_shape": True}, "takes 2 to 8 ranks, got 9"),
                         ({"parallel": 2, "gpu": "4090"}, "add --backend torch"),
                         ({"parallel": 2, "backend": "torch", "static_shape": False}, "add --static-shape"),
                         ({"parallel": 2, "backend": "torch", "static_shape": True, "components": ["clip"]},
                          r"build it too \(--components transformer")):
        with pytest.raises(FluxtrtError, match=says):
            api.build(**{"gpu": "cpu", "model": "tiny", "out_dir": tmp_path, **fields})
    assert not any(tmp_path.iterdir())
    geo = resolve_model("tiny").geometry
    spec = specs_for(geo, ["transformer"])["transformer"]
    feeds = spec.sample_inputs(ShapePoint(1, 1024, 1024), geo, int(np.random.default_rng().integers(1 << 30)))
    share = rank_share(spec, feeds, 4)
    assert share["hidden_states"].shape[1] == 1024 and share["txt_ids"].shape[0] == geo.t5_length // 4
    assert torch.equal(share["hidden_states"], feeds["hidden_states"][:, :1024])
    with pytest.raises(BuildError, match=r"^transformer: 4096 image_tokens of hidden_states do not divide over 3 "
                                         r"ranks: build --parallel with 2, 4 or 8 ranks"):
        rank_share(spec, feeds, 3)
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(RuntimeError, match="split over 2 ranks; this process runs 1"):
        context_attention_op()(q, q, q, 2, "ulysses")
    bind_context(object(), 2, lambda: [6, 6])  # a binding left over, but no process group: still one rank
    try:
        with pytest.raises(RuntimeError, match="split over 2 ranks; this process runs 1"):
            context_attention_op()(q, q, q, 2, "ulysses")
    finally:
        bind_context(None, 1, None)


def _ulysses_against_whole(rank: int, n: int, port: int, queue) -> None:
    """One of n gloo ranks: Ulysses' and the gathered attention of this rank's token slice (unequal slices, 24
    heads as FLUX.1's) against torch's SDPA over the whole sequence."""
    import datetime

    import torch
    import torch.distributed as dist

    from fluxtrt.attention import context_parallel_fn, sdpa

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=30))
    try:
        gen = torch.Generator().manual_seed(3)  # every rank draws the same whole sequence
        q, k, v = (torch.randn(2, 29, 24, 16, generator=gen) for _ in range(3))
        whole = sdpa(q, k, v)
        mine = [torch.tensor_split(t, n, dim=1)[rank] for t in (q, k, v)]
        expected = torch.tensor_split(whole, n, dim=1)[rank]
        errs = [float((context_parallel_fn(sdpa, None, mode)(*mine) - expected).abs().max())
                for mode in ("ulysses", "gather")]
        queue.put((rank, errs))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("n", [4, 8])
def test_ulysses_and_gathered_attention_equal_whole_sequence_attention(n):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_ulysses_against_whole, args=(n, parallel._free_port(), queue), nprocs=n, start_method="spawn")
    errs = dict(queue.get() for _ in range(n))
    assert sorted(errs) == list(range(n))
    assert max(max(e) for e in errs.values()) <= 1e-6, errs


@pytest.mark.slow
def test_a_follower_that_dies_ends_the_run_in_one_line():
    pipe = _open("tiny", 2)
    try:
        follower = parallel._TEAM.context.processes[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(FluxtrtError, match=r"^rank 1 of 2 ended \(killed by SIGKILL\); the run stopped"):
            _trace(pipe, 2)
        assert time.monotonic() - t0 < 30
    finally:
        pipe.close()
    assert parallel.current() is None


def _children(pid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_ctrl_c_or_a_killed_leader_ends_every_rank(tmp_path, how):
    """SIGINT to the leader alone (a terminal would send it to every rank): exit 130, followers gone, no image.
    SIGKILL to the leader (nothing can tell the followers): they notice and end within 15 s."""
    proc = subprocess.Popen([sys.executable, "-m", "fluxtrt.cli", "run", "--backend", "torch", "--model", "tiny",
                             "--torch-dtype", "fp32", "--parallel", "2", "--steps", "200", "--height", "512",
                             "--width", "512", "--prompt", "a fox", "--out", str(tmp_path / "x.png")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1"},
                            # as from a terminal: a child inherits an ignored SIGINT (a test before this one in the
                            # same worker may leave it ignored), and Python then installs no handler for Ctrl-C
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    followers = set()
    while time.monotonic() < deadline and not followers:
        time.sleep(0.5)
        followers = {p for p in _children(proc.pid) if "_follower" in _cmdline(p) or "spawn_main" in _cmdline(p)}
    assert followers, "no follower started"
    time.sleep(8)  # into the loop
    proc.send_signal(how)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread's stack on SIGABRT
        proc.send_signal(signal.SIGABRT)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the leader did not end 60 s after {how.name}; its output and stacks:\n{out[-8000:]}")
    assert proc.returncode == (130 if how == signal.SIGINT else -signal.SIGKILL), out
    t0 = time.monotonic()
    while time.monotonic() - t0 < 15 and any(os.path.exists(f"/proc/{p}") and _alive(p) for p in followers):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in followers)
    assert not (tmp_path / "x.png").exists()
    assert "Traceback" not in out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_served_request_on_a_2_rank_replica_equals_the_run():
    """`fluxtrt serve --parallel 2` (Ray Serve; the replica leads one follower) answers with the images a single
    process makes, within 2/255; /health answers after it; Ctrl-C stops it all."""
    from PIL import Image

    from tests.test_serving import Server

    server = Server(None, "--model", "tiny-schnell", "--backend", "torch", "--torch-dtype", "fp32", "--parallel", "2")
    try:
        status, payload, _ = server.post({"prompt": "a cat", "size": "320x256", "n": 2, "steps": 2, "seed": 7})
        assert status == 200, payload
        served = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in payload["data"]]
        assert server.health()["status"] == "ok"
    finally:
        server.stop()
    alone = _open("tiny-schnell", 1)
    for seed, img in zip((7, 8), served):
        ref = alone.generate(["a cat"], 256, 320, 2, 3.5, seed=seed).images[0]
        assert int(np.abs(img.astype(int) - ref.astype(int)).max()) <= 2


def test_gpu_counts_and_kinds_are_one_line(monkeypatch):
    import torch

    names = ["NVIDIA H200", "NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    assert parallel.backend_for(2, None) == "nccl"
    assert parallel.backend_for(4, "cpu") == "gloo"  # CPU processes need no GPU
    with pytest.raises(FluxtrtError, match=r"^--parallel 4 needs 4 GPUs, this machine has 3; ask for at most 3$"):
        parallel.backend_for(4, "cuda")
    with pytest.raises(FluxtrtError, match=r"^--parallel splits one image over GPUs of one kind; these are NVIDIA "
                                           r"H100 80GB HBM3, NVIDIA H200: set CUDA_VISIBLE_DEVICES"):
        parallel.backend_for(3, None)


def test_rank_counts_and_attention_modes_are_one_line():
    for n in (0, 9):
        with pytest.raises(FluxtrtError, match=f"--parallel takes 1 to 8 ranks, got {n}"):
            parallel.backend_for(n, "cpu")
    assert parallel.backend_for(2, "cpu") == "gloo"
    assert [parallel.attention_mode("auto", 24, n) for n in (1, 2, 3, 4, 5, 6, 7, 8)] == \
        ["gather", "ulysses", "ulysses", "ulysses", "gather", "ulysses", "gather", "ulysses"]
    with pytest.raises(FluxtrtError, match="--parallel-attention ulysses splits the 24 attention heads over the ranks: "
                                           "5 does not divide 24; use --parallel-attention gather"):
        parallel.attention_mode("ulysses", 24, 5)
    with pytest.raises(FluxtrtError, match="--parallel-attention takes auto, ulysses, gather, got 'ring'"):
        open_pipeline(model="tiny", backend="torch", parallel=2, parallel_attention="ring")
    with pytest.raises(FluxtrtError, match="--parallel: --cuda-graph and --low-vram are not yet"):
        open_pipeline(model="tiny", backend="torch", parallel=2, cuda_graph=True)
    assert parallel.current() is None
