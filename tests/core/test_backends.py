"""core/backends.py: TensorRT-RTX and full TensorRT behind one Backend; what each can build is said in one line."""

import pytest

from fluxtrt.core.backends import BACKENDS, TensorRTRTX, get_backend, local_gpu_capabilities
from fluxtrt.errors import BackendUnavailableError


def test_each_backend_is_found_by_its_name():
    for name in BACKENDS:
        assert get_backend(name).name == name
    with pytest.raises(BackendUnavailableError, match="unknown backend 'trt'; choose tensorrt-rtx, tensorrt"):
        get_backend("trt")


def test_tensorrt_rtx_builds_ahead_of_time_for_its_architectures_only():
    pytest.importorskip("tensorrt_rtx")
    rtx = TensorRTRTX()
    for cc in rtx.capabilities:
        rtx.check_target(cc)
    with pytest.raises(BackendUnavailableError, match="cannot build for compute capability 9.0"):
        rtx.check_target("9.0")  # Hopper: full TensorRT on the target GPU


def test_full_tensorrt_builds_only_on_its_gpu(monkeypatch):
    """Nothing here installs full TensorRT: its absence is the install hint; present, a target other than the
    local GPU is refused (a stand-in module, since no builder library can be installed here)."""
    import sys
    import types

    trt = get_backend("tensorrt")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(BackendUnavailableError, match="needs the 'tensorrt' package: pip install 'fluxtrt\\[trt\\]'"):
        trt.check_target("9.0")
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.8"))
    trt = get_backend("tensorrt")
    if "9.0" not in local_gpu_capabilities():
        with pytest.raises(BackendUnavailableError, match="builds only for the GPU it runs on: the target is sm90"):
            trt.check_target("9.0")
