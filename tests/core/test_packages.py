"""core/packages.py: what a compiled PyTorch package needs to run, and the one line when this machine differs."""

import torch

from fluxtrt.core.packages import package_runtime, runtime_problem


def test_a_package_of_another_torch_cuda_or_device_is_named_with_both_sides():
    here = package_runtime("cpu")
    assert here == {"torch": torch.__version__, "cuda": None, "target": "cpu"}
    assert runtime_problem(here, "cpu") is None
    other_torch = dict(here, torch="2.4.0")
    assert runtime_problem(other_torch, "cpu") == f"it was compiled for torch 2.4.0, this machine has torch {torch.__version__}"
    assert runtime_problem(dict(here, target="sm90", cuda="12.8"), "cpu") == (
        "it was compiled for device sm90, this machine has device cpu")
