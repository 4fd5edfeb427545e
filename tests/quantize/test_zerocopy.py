"""quantize/zerocopy.py: the fp8 recipe on a linked graph, one weight at a time from the checkpoint's bytes."""

import numpy as np
import pytest
import torch

from fluxtrt import fp8
from fluxtrt.errors import FluxtrtError
from fluxtrt.quantize.zerocopy import activation_amax, module_of, quantize_weight_fp8


def test_a_fused_weight_has_one_scale_and_the_recipes_bytes():
    """Two parts of a fused projection stored in bf16 as the graph holds them ([in, out]) -> E4M3 [in, out1 + out2]
    with one scale, max |w| / 448 over both, as fp8.py's arithmetic gives."""
    rng = np.random.default_rng()
    ws = [torch.from_numpy(rng.standard_normal((16, n)).astype(np.float32)).to(torch.bfloat16) for n in (8, 4)]
    parts = [(w.view(torch.int16).numpy().tobytes(), list(w.shape)) for w in ws]
    q, scale = quantize_weight_fp8(parts, transposed=False)
    assert scale == fp8.weight_scale([w.float() for w in ws])
    want = torch.cat([fp8.to_e4m3(w.float(), scale) for w in ws], 1).contiguous().view(torch.uint8).numpy()
    assert np.array_equal(q, want) and q.shape == (16, 12)


def test_activation_ranges_come_from_the_modules_the_weights_are_of():
    prov = {"w_qkv": {"op": "concat", "axis": 1, "of": [{"tensor": "a.to_q.weight"}, {"tensor": "a.to_k.weight"}]}}
    assert module_of("a.to_q.weight") == "a.to_q"
    assert activation_amax(["w_qkv"], prov, {"a.to_q": 2.0, "a.to_k": 3.5}) == 3.5
    with pytest.raises(FluxtrtError, match="no calibrated range for a.to_k"):
        activation_amax(["w_qkv"], prov, {"a.to_q": 2.0})
