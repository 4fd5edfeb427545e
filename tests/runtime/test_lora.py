"""runtime/lora.py: a transformer LoRA read and checked as it loads (merged results against a pre-merged
checkpoint: tests/core/test_refit.py, where the engines are built)."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fluxtrt.errors import FluxtrtError
from fluxtrt.runtime.lora import Lora

MODULE = "transformer_blocks.0.attn.to_q"


def lora_file(path, rng, rank=2, out_f=12, in_f=8, alpha=4.0):
    tensors = {f"transformer.{MODULE}.lora_A.weight": torch.from_numpy(rng.standard_normal((rank, in_f), np.float32)),
               f"transformer.{MODULE}.lora_B.weight": torch.from_numpy(rng.standard_normal((out_f, rank), np.float32)),
               f"transformer.{MODULE}.alpha": torch.tensor(alpha)}
    save_file(tensors, path)
    return tensors


def test_the_delta_is_scale_alpha_over_rank_b_a(tmp_path):
    rng = np.random.default_rng()
    t = lora_file(tmp_path / "l.safetensors", rng)
    lora = Lora(tmp_path / "l.safetensors", scale=0.7)
    want = 0.7 * (4.0 / 2) * (t[f"transformer.{MODULE}.lora_B.weight"] @ t[f"transformer.{MODULE}.lora_A.weight"])
    assert np.allclose(lora.deltas[f"{MODULE}.weight"], want.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("part", ["lora_A.weight", "lora_B.weight", "alpha"])
def test_a_non_finite_lora_is_named_when_it_loads(tmp_path, part):
    rng = np.random.default_rng()
    t = lora_file(tmp_path / "l.safetensors", rng)
    bad = t[f"transformer.{MODULE}.{part}"].clone().reshape(-1)
    bad[rng.integers(bad.numel())] = float("nan")
    t[f"transformer.{MODULE}.{part}"] = bad.reshape(t[f"transformer.{MODULE}.{part}"].shape)
    save_file(t, tmp_path / "nan.safetensors")
    with pytest.raises(FluxtrtError, match=f"nan.safetensors: tensor {MODULE}.{part} holds NaN or Inf"):
        Lora(tmp_path / "nan.safetensors")
