"""export/modes.py: which way a component is exported: zero-copy (links into the checkpoint), replicated blocks
traced on meta, or a plain copying trace."""

import torch

from fluxtrt.components import specs_for
from fluxtrt.export.modes import Copying, Replicated, ZeroCopy, mode_for, stored_bytes
from fluxtrt.models.source import resolve_model


def test_each_request_gets_its_mode():
    src = resolve_model("tiny")
    specs = specs_for(src.geometry, ["transformer", "clip"])
    assert isinstance(mode_for(src, specs["transformer"], "fp32", True, True, external_threshold=1 << 30), ZeroCopy)
    assert isinstance(mode_for(src, specs["clip"], "fp32", False, False, external_threshold=1 << 30), Copying)
    assert isinstance(mode_for(src, specs["transformer"], "fp32", False, True, external_threshold=1 << 30),
                      (Replicated, Copying))


def test_stored_bytes_count_the_elements_at_the_dtype():
    class T:
        def __init__(self, shape):
            self.shape = shape

    index = {"a": T((4, 8)), "b": T((3,))}
    assert stored_bytes(index, "fp32") == 35 * 4 and stored_bytes(index, "bf16") == 35 * 2
    assert torch.empty((), dtype=torch.bfloat16).element_size() == 2
