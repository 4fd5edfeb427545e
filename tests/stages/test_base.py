"""stages/base.py: the one stage runner (reuse, make, validate, record) and its one reuse rule."""

import os

import pytest

from fluxtrt.errors import ValidationError
from fluxtrt.fileio import sha256_file
from fluxtrt.stages import base
from fluxtrt.stages.base import Made, Step, run_step, unchanged


def test_unchanged_needs_the_same_bytes_and_the_same_inputs(tmp_path):
    out = tmp_path / "x.onnx"
    out.write_bytes(os.urandom(32))
    sha = sha256_file(out)
    assert unchanged(out, sha, {"a": 1, "b": 2}, {"a": 1})
    assert not unchanged(out, sha, {"a": 1}, {"a": 2}) and not unchanged(out, None, {}, {})
    out.write_bytes(os.urandom(32))
    assert not unchanged(out, sha, {"a": 1}, {"a": 1})
    out.unlink()
    assert not unchanged(out, sha, {}, {})


def test_the_runner_reuses_remakes_and_removes_what_fails_validation(tmp_path, monkeypatch):
    made = []

    def make():
        path = tmp_path / "c.onnx"
        path.write_bytes(os.urandom(16))
        made.append(path.read_bytes())
        return Made(path, detail="made")

    checks = []
    monkeypatch.setattr(base, "validate_against_pytorch", lambda *a, **k: checks.append(a[1]) or 1e-6)
    step = Step(stage="optimize", folder=tmp_path, inputs={"k": 1}, make=make, dtype="fp32", what="optimized",
                reused="same")
    path, entry, results = run_step(None, "c", step, force=False, on_phase=lambda _: None, validate=True)
    assert entry is None and results[0].status == "built" and "max rel err 1.0e-06" in results[0].detail
    path, entry, results = run_step(None, "c", step, force=False, on_phase=lambda _: None, validate=True)
    assert entry is not None and results is None and len(made) == 1 and checks == ["c"]  # reused: not remade
    step.inputs = {"k": 2}
    run_step(None, "c", step, force=False, on_phase=lambda _: None, validate=True)
    assert len(made) == 2  # an input changed: made again

    def fail(*a, **k):
        raise ValidationError("optimized c (fp32) disagrees with PyTorch")

    monkeypatch.setattr(base, "validate_against_pytorch", fail)
    with pytest.raises(ValidationError):
        run_step(None, "c", step, force=True, on_phase=lambda _: None, validate=True)
    assert not (tmp_path / "c.onnx").exists()  # never left for a later build to pick up
