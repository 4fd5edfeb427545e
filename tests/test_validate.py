"""validate.py: `fluxtrt validate`'s rows: errors in float64, a row's ratio to the reference pair (the command
against built engines: tests/runtime/test_pipeline.py and tests/stages/test_zerocopy_plan.py)."""

import torch

from fluxtrt.validate import CrossCheckRow, relative_errors


def test_relative_errors_are_max_and_mean_in_float64():
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    b = torch.randn(64, 32, generator=g)
    a = b + torch.randn(64, 32, generator=g) * 1e-3
    mx, mean = relative_errors(a.float(), b.float())
    d = (a.double() - b.double()).abs()
    assert abs(mx - float(d.max() / b.double().abs().max())) < 1e-12
    assert abs(mean - float(d.mean() / b.double().abs().mean())) < 1e-12


def test_a_row_says_its_ratio_to_the_reference_pair():
    row = CrossCheckRow(component="clip", precision="fp32", torch_dtype="fp32", batch=1, height=256, width=256,
                        onnx_error=2e-6, onnx_mean_error=1e-7, reference=1e-6, reference_mean=1e-7, bound=1e-4, ok=True,
                        against="module")
    assert row.ratio == 2.0 and row.to_json()["ratio"] == 2.0 and row.to_json()["metric"] == "max"
