"""dtypes.py: the one dtype table, and each conversion it offers agreeing with the libraries it names."""

import numpy as np
import pytest
import torch
from onnx import TensorProto

from fluxtrt.dtypes import BY_NAME, TABLE, cast, check_float, from_ort_type, np_dtype, onnx_enum, torch_dtype
from fluxtrt.errors import FluxtrtError


@pytest.mark.parametrize("row", TABLE, ids=lambda d: d.name)
def test_every_row_names_the_same_type_in_every_library(row):
    assert torch_dtype(row.name) == getattr(torch, row.numpy)
    assert np_dtype(row.numpy).itemsize == torch.empty(0, dtype=getattr(torch, row.numpy)).element_size()
    assert onnx_enum(row) == getattr(TensorProto, row.onnx)
    assert BY_NAME[row.name] is row


def test_cast_overflows_to_inf_as_onnx_cast_does():
    rng = np.random.default_rng()
    x = np.concatenate([rng.standard_normal(16).astype(np.float32), [np.float32(1e6)]])
    y = cast(x, "float16")
    assert y.dtype == np.float16 and np.isinf(y[-1]) and np.allclose(y[:-1], x[:-1], rtol=1e-3, atol=1e-3)
    b = cast(x, "bfloat16")
    assert np.allclose(b[:-1].astype(np.float32), x[:-1], rtol=1e-2, atol=1e-2)


def test_unknown_names_are_one_line():
    for call in (lambda: check_float("fp64"), lambda: torch_dtype("complex64"), lambda: from_ort_type("tensor(string)")):
        with pytest.raises(FluxtrtError) as e:
            call()
        assert "\n" not in str(e.value)
    assert from_ort_type("tensor(float)").name == "fp32" and from_ort_type("tensor(bfloat16)").name == "bf16"
