"""Export stage: every component of both tiny models to ONNX, validated against PyTorch by ONNX Runtime."""

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from fluxtrt.compare import graph_io, validate_onnx
from fluxtrt.components import ShapePoint, specs_for
from tests.helpers import export_checked

COMPONENTS_UNDER_TEST = ("clip", "t5", "transformer", "vae_decoder", "vae_encoder")
FP32_BOUND = 1e-4  # max|onnx - torch| / max|torch|, fp32, on fresh random inputs


@pytest.mark.parametrize("model", ["tiny", "tiny-schnell"])
def test_export_all_components_validates(exported, model):
    src, out, results = exported(model)
    assert [r.component for r in results] == list(COMPONENTS_UNDER_TEST)
    for r in results:
        assert r.path.exists() and r.path.parent == out
        assert r.max_rel_err is not None and r.max_rel_err <= FP32_BOUND, (r.component, r.max_rel_err)
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]  # staging folders cleaned up
    assert (out / "export.json").exists()


@pytest.mark.parametrize("component", COMPONENTS_UNDER_TEST)
def test_revalidate_at_two_fresh_shapes(exported, component):
    """Re-run validation with new seeds at batch 1 square and batch 2 non-square (not the export shape)."""
    src, out, _ = exported("tiny")
    geo = src.geometry
    spec = specs_for(geo)[component]
    module = spec.wrap(src.load_component(spec.subfolder))
    m = geo.pixel_multiple
    points = [ShapePoint(1, 5 * m, 5 * m), ShapePoint(2, 4 * m, 7 * m)]
    report = validate_onnx(out / f"{component}.onnx", module, spec, geo, points=points,
                           seed=int.from_bytes(os.urandom(4), "little"))
    assert report.ok, report.failures()
    value_checks = [c for c in report.checks if c.rel_err is not None]
    assert len(value_checks) == 2 * len(spec.outputs)
    assert report.max_rel_err <= FP32_BOUND


def test_graph_io_names_and_symbolic_axes(exported):
    src, out, _ = exported("tiny")
    ins, outs = graph_io(out / "transformer.onnx")
    assert [n for n, _ in ins] == ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                                  "img_ids", "txt_ids", "guidance"]
    assert dict(ins)["hidden_states"] == ["batch", "image_tokens", 16]
    assert dict(ins)["txt_ids"] == [512, 3]
    assert outs == [("noise_pred", ["batch", "image_tokens", 16])]
    ins, outs = graph_io(out / "vae_decoder.onnx")
    assert ins == [("latent", ["batch", 4, "latent_height", "latent_width"])]
    assert outs == [("image", ["batch", 3, "image_height", "image_width"])]
    src_s, out_s, _ = exported("tiny-schnell")
    assert "guidance" not in [n for n, _ in graph_io(out_s / "transformer.onnx")[0]]
    assert graph_io(out_s / "t5.onnx")[1] == [("text_embeds", ["batch", 256, 32])]


def test_validation_catches_a_corrupted_graph(exported, tmp_path):
    """The comparison is sensitive: scaling one weight of the exported graph must fail validation."""
    src, out, _ = exported("tiny")
    model = onnx.load(str(out / "clip.onnx"))
    init = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    arr = onnx.numpy_helper.to_array(init) * 1.05
    init.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), init.name))
    onnx.save(model, str(tmp_path / "clip.onnx"))
    spec = specs_for(src.geometry)["clip"]
    report = validate_onnx(tmp_path / "clip.onnx", spec.wrap(src.load_component(spec.subfolder)), spec, src.geometry)
    assert not report.ok and report.max_rel_err > FP32_BOUND
    assert any("rel err" in f for f in report.failures())


@pytest.mark.slow
def test_external_data_path(tiny_dev, tmp_path):
    """Lower the threshold so the transformer's weights go to external data, as a >2 GB model's would."""
    spec = specs_for(tiny_dev.geometry)["transformer"]
    r = export_checked(tiny_dev, spec, tmp_path, external_data_bytes=1024)
    data = tmp_path / "transformer.onnx.data"
    assert r.external_data and data.exists()
    assert data.stat().st_size > 200_000  # the weights live there...
    assert (tmp_path / "transformer.onnx").stat().st_size < 200_000  # ...not in the graph file
    model = onnx.load(str(tmp_path / "transformer.onnx"), load_external_data=False)
    ext = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert ext and all(dict((e.key, e.value) for e in i.external_data)["location"] == data.name for i in ext)
    assert r.max_rel_err <= FP32_BOUND


@pytest.mark.slow
def test_cli_export_is_standard_onnx_by_default(tmp_path):
    """`fluxtrt export` writes standard ONNX (weights in the file); --zero-copy links the weights into the
    checkpoint where it stores the graph's dtype (tiny: fp32 safetensors), copies them where it does not (--dtype
    bf16 of an fp32 checkpoint, saying why) and says that only fluxtrt and TensorRT's parser read linked files."""
    import json

    from typer.testing import CliRunner

    from fluxtrt.cli import app

    res = CliRunner().invoke(app, ["export", "--model", "tiny-schnell", "--out", str(tmp_path / "a"), "-c", "clip"])
    assert res.exit_code == 0, res.output
    assert "clip.onnx" in res.output and "max rel err" in res.output and "zero-copy" not in res.output
    assert not (tmp_path / "a" / "clip.weights").exists()
    assert json.loads((tmp_path / "a" / "export.json").read_text())["components"]["clip"]["zero_copy"] is None
    res = CliRunner().invoke(app, ["export", "-m", "tiny-schnell", "-o", str(tmp_path / "z"), "-c", "clip",
                                   "--zero-copy"])
    assert res.exit_code == 0, res.output
    assert "only fluxtrt and TensorRT's parser" in " ".join(res.output.split())
    info = json.loads((tmp_path / "z" / "export.json").read_text())
    assert info["components"]["clip"]["zero_copy"]["linked_tensors"] > 0 and info["model_hash_kind"] == "layout"
    assert (tmp_path / "z" / "clip.weights").is_dir()
    res = CliRunner().invoke(app, ["export", "-m", "tiny-schnell", "-o", str(tmp_path / "b"), "-c", "clip",
                                   "--zero-copy", "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "b" / "clip.weights").exists()
    assert "clip is stored in fp32 (--dtype fp32 exports it zero-copy)" in " ".join(res.output.split())


@pytest.mark.slow
def test_default_export_opens_in_stock_tools(tmp_path):
    """What `fluxtrt export` writes by default opens in stock ONNX Runtime, onnx.load and polygraphy, each given
    only the path, and runs in ONNX Runtime on fresh random inputs."""
    import subprocess
    import sys

    import onnxruntime as ort
    from typer.testing import CliRunner

    from fluxtrt.cli import app
    from fluxtrt.models.source import resolve_model

    out = tmp_path / "onnx"
    res = CliRunner().invoke(app, ["export", "--model", "tiny", "--out", str(out), "-c", "clip,transformer"])
    assert res.exit_code == 0, res.output
    geo = resolve_model("tiny").geometry
    for name, spec in specs_for(geo, ["clip", "transformer"]).items():
        path = str(out / f"{name}.onnx")
        model = onnx.load(path)  # external data (if any) resolved from beside the file
        assert {i.name for i in model.graph.input} == {t.name for t in spec.inputs}
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        feeds = {k: v.numpy() for k, v in spec.sample_inputs(ShapePoint(1, 256, 256), geo, seed=7).items()}
        (y,) = session.run(None, feeds)
        assert np.isfinite(y).all() and float(np.abs(y).max()) > 0
        inspect = subprocess.run([str(Path(sys.executable).parent / "polygraphy"), "inspect", "model", path],
                                 capture_output=True, text=True)
        assert inspect.returncode == 0, inspect.stderr[-2000:]
        assert spec.outputs[0].name in inspect.stdout


def test_cli_hub_id_error_is_one_line():
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    res = CliRunner().invoke(app, ["export", "--model", "black-forest-labs/FLUX.1-dev"])
    assert res.exit_code == 2
    assert "never downloads" in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_fp16_export_within_its_bound(tiny_schnell, tmp_path):
    from fluxtrt.compare import RTOL_BY_DTYPE

    spec = specs_for(tiny_schnell.geometry)["vae_decoder"]
    r = export_checked(tiny_schnell, spec, tmp_path, "fp16")
    assert r.max_rel_err <= RTOL_BY_DTYPE["fp16"]
    model = onnx.load(str(r.path))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


@pytest.mark.slow
@pytest.mark.parametrize("component", ["t5", "transformer"])
def test_bf16_export_within_its_bound(tiny_dev, tmp_path, component):
    """bf16 graphs run in ONNX Runtime widened to fp32 (no bf16 CPU kernels): weights keep their bf16 rounding."""
    from fluxtrt.compare import RTOL_BY_DTYPE

    spec = specs_for(tiny_dev.geometry)[component]
    r = export_checked(tiny_dev, spec, tmp_path, "bf16")
    assert 1e-4 < r.max_rel_err <= RTOL_BY_DTYPE["bf16"]  # bf16 rounding is visible, and bounded
    model = onnx.load(str(r.path))
    assert any(t.data_type == onnx.TensorProto.BFLOAT16 for t in model.graph.initializer)
