"""checkpoint.py: safetensors headers, reads and links, and the checks a user's checkpoint passes as it loads
(hostile headers are fuzzed in test_untrusted.py)."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fluxtrt.checkpoint import CheckpointReader, check_finite, read_header, read_stored
from fluxtrt.errors import FluxtrtError


def random_tensors(rng, dtype):
    return {f"blocks.{i}.weight": torch.from_numpy(rng.standard_normal((8, 16)).astype(np.float32)).to(dtype)
            for i in range(3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reads_equal_what_was_saved(tmp_path, dtype):
    rng = np.random.default_rng()
    tensors = random_tensors(rng, dtype)
    save_file(tensors, tmp_path / "m.safetensors")
    header = read_header(tmp_path / "m.safetensors")
    assert sorted(header) == sorted(tensors)
    for key, t in tensors.items():
        got = read_stored(header[key]).astype(np.float32)
        assert np.array_equal(got, t.float().numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_tensor_is_named_when_it_loads(tmp_path, dtype, bad):
    """NaN or Inf anywhere in a --weights checkpoint: one line naming the file and the tensor as it is read, not a
    'build it in bf16' hint after a whole run."""
    rng = np.random.default_rng()
    tensors = random_tensors(rng, dtype)
    key = f"blocks.{rng.integers(3)}.weight"
    flat = tensors[key].flatten()
    flat[rng.integers(flat.numel())] = bad
    tensors[key] = flat.reshape(8, 16)
    (tmp_path / "transformer").mkdir()
    save_file(tensors, tmp_path / "transformer" / "diffusion_pytorch_model.safetensors")
    read = CheckpointReader(tmp_path / "transformer")
    for other in set(tensors) - {key}:
        assert np.isfinite(read(other).astype(np.float32)).all()
    with pytest.raises(FluxtrtError, match=f"diffusion_pytorch_model.safetensors: tensor {key} holds NaN or Inf"):
        read(key)


def test_check_finite_passes_integers_and_finite_floats_through():
    rng = np.random.default_rng()
    ints = rng.integers(-5, 5, (4, 4))
    floats = rng.standard_normal((4, 4)).astype(np.float32)
    assert check_finite(ints, "f", "k") is ints and check_finite(floats, "f", "k") is floats
