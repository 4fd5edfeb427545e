"""Shared fixtures: one tiny-model cache and one set of exported ONNX files per test session."""

import os
import warnings

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # as the CLI sets it (read when huggingface_hub loads)
warnings.filterwarnings("ignore")


@pytest.fixture(scope="session", autouse=True)
def fluxtrt_cache(tmp_path_factory):
    """Every test session builds the tiny models from scratch into its own cache."""
    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("FLUXTRT_CACHE")
    os.environ["FLUXTRT_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("FLUXTRT_CACHE", None)
    else:
        os.environ["FLUXTRT_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_dev():
    from fluxtrt.models.source import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_schnell():
    from fluxtrt.models.source import resolve_model

    return resolve_model("tiny-schnell")


@pytest.fixture(scope="session", params=["tiny", "tiny-schnell"])
def tiny_source(request):
    from fluxtrt.models.source import resolve_model

    return resolve_model(request.param)


_EXPORTS = {}


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(model_name) -> (source, onnx folder, results): each tiny model exported once per session."""
    from fluxtrt import api

    def get(name):
        if name not in _EXPORTS:
            out = tmp_path_factory.mktemp(f"onnx-{name}")
            done = api.export(name, out)
            _EXPORTS[name] = (done.source, out, done.results)
        return _EXPORTS[name]

    return get


def _reweighted_copy(src, dest, seed):
    """A copy of a tiny model folder with fresh random values in every stored tensor (same architecture)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from fluxtrt.models.source import resolve_model

    shutil.copytree(src.path, dest)
    g = torch.Generator().manual_seed(seed)
    for f in dest.rglob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: (torch.randn(v.shape, generator=g) * 0.05).to(v.dtype) if v.is_floating_point() else v
                   for k, v in tensors.items()}, f)
    return resolve_model(str(dest))


@pytest.fixture(scope="session")
def reweighted_copy():
    """reweighted_copy(source, dest, seed) -> a copy of a model folder with fresh random stored tensors."""
    return _reweighted_copy


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory):
    """A copy of `tiny` whose transformer and T5 are stored in bf16, as FLUX.1-dev's are: `fluxtrt build` takes
    the zero-copy path for them (CLIP and the VAE stay fp32, so they take the fp32 path)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from fluxtrt.models.source import resolve_model

    src = resolve_model("tiny")
    folder = tmp_path_factory.mktemp("tiny-bf16") / "model"
    shutil.copytree(src.path, folder)
    for sub in ("transformer", "text_encoder_2"):
        for f in (folder / sub).glob("*.safetensors"):
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(f).items()}, f)
    return resolve_model(str(folder))


@pytest.fixture(scope="session")
def fp8_build(tiny_bf16, tmp_path_factory):
    """fp8 transformer engine of the bf16 tiny copy for the 4090, on the zero-copy path (3 prompts, 2 steps of
    calibration): (source, config, build root, manifest, stage results, the shards' hashes before, calibration)."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    import hashlib

    from fluxtrt.gpus import load_gpu
    from fluxtrt.records import CalibrationSettings
    from fluxtrt.stages.build import build_gpu

    root = tmp_path_factory.mktemp("native-fp8")
    before = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
              for f in sorted((tiny_bf16.path / "transformer").glob("*.safetensors"))}
    cfg = load_gpu("4090").with_precision({"transformer": "fp8"})
    calib = CalibrationSettings(size=3, steps=2)
    manifest, results = build_gpu(tiny_bf16, cfg, root, components=["transformer"], calibration=calib)
    return tiny_bf16, cfg, root, manifest, results, before, calib


def shared_folder(tmp_path_factory, name: str, make):
    """A folder made once per test run by `make(folder)` and seen by every xdist worker (their common base temp),
    under a file lock: the second worker to ask waits for the first and reuses its folder. Tests copy it before
    changing anything in it."""
    from pathlib import Path

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    base = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = Path(base) / name, Path(base) / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            done.write_text("made\n")
    return folder


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    """engines(model) -> (source, GPU folder, manifest): every component of a tiny model built in fp32 for the
    4090 (sm89), with the transformer's First-Block Cache parts (but for tiny-control), once per test run (shared
    by the workers), so ONNX Runtime over the built ONNX can be compared with fp32 diffusers."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    from fluxtrt.gpus import load_gpu
    from fluxtrt.models.source import resolve_model
    from fluxtrt.records import read_manifest
    from fluxtrt.stages.build import build_gpu

    def get(model):
        src = resolve_model(model)
        cfg = load_gpu("4090")
        cfg = cfg.with_precision({c: "fp32" for c in cfg.precision})
        # First-Block Cache's parts where tests/test_stepcache.py runs them (not Control: its torch test covers it)
        root = shared_folder(tmp_path_factory, f"eng-{model}", lambda root: build_gpu(
            src, cfg, root, first_block_cache=model != "tiny-control"))
        return src, root / "4090", read_manifest(root / "4090")

    return get


@pytest.fixture(scope="session")
def packages(tmp_path_factory):
    """packages(model, components, first_block_cache) -> (source, GPU folder, manifest): compiled PyTorch engines
    (AOTInductor C++ packages) of a tiny model for this CPU (`fluxtrt build --gpu cpu`), fp32, once per test run
    (shared); with first_block_cache the transformer's parts too."""
    from fluxtrt.gpus import load_gpu
    from fluxtrt.models.source import resolve_model
    from fluxtrt.records import read_manifest
    from fluxtrt.stages.build import build_gpu

    def get(model, components=("clip", "t5", "transformer", "vae_decoder"), first_block_cache=False):
        src = resolve_model(model)
        key = f"pt2-{model}-{'-'.join(components)}{'-fbc' if first_block_cache else ''}"
        root = shared_folder(tmp_path_factory, key, lambda root: build_gpu(
            src, load_gpu("cpu"), root, components=list(components), first_block_cache=first_block_cache))
        return src, root / "cpu", read_manifest(root / "cpu")

    return get


@pytest.fixture(scope="session")
def fp8_attn_build(tmp_path_factory):
    """The fp8-attn transformer engine of tiny for the 4090 (the copying path: tiny is fp32; 3 prompts, 2 steps of
    calibration), once per test run (shared): (source, GPU folder, manifest)."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")
    from fluxtrt.gpus import load_gpu
    from fluxtrt.models.source import resolve_model
    from fluxtrt.records import CalibrationSettings, read_manifest
    from fluxtrt.stages.build import build_gpu

    src = resolve_model("tiny")
    cfg = load_gpu("4090").with_precision({"transformer": "fp8-attn"})
    root = shared_folder(tmp_path_factory, "fp8-attn", lambda root: build_gpu(
        src, cfg, root, components=["transformer"], calibration=CalibrationSettings(size=3, steps=2)))
    return src, root / "4090", read_manifest(root / "4090")


# Fixtures that export or build (tens of seconds to minutes each on 2 cores): a test using one is slow, so the
# fast set (`-m "not slow"`, under 5 minutes) never pays for them. CI runs everything.
EXPENSIVE_FIXTURES = {
    "exported", "fp8_build", "engines", "built", "fp4_zero_copy", "deep_tiny", "zero_copy_exports", "packed",
    "fp32_transformer", "bf16_transformer", "two_checkpoints", "tiny_fp32_engines", "packages", "fp8_attn_build",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if EXPENSIVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
