"""Shared fixtures: one tiny-model cache and one set of exported ONNX files per test session."""

import os
import warnings

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
    from fluxtrt.export import export_model
    from fluxtrt.models.source import resolve_model

    def get(name):
        if name not in _EXPORTS:
            src = resolve_model(name)
            out = tmp_path_factory.mktemp(f"onnx-{name}")
            _EXPORTS[name] = (src, out, export_model(src, out))
        return _EXPORTS[name]

    return get
