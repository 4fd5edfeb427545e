"""The library's policies, reached without the CLI: `-p` spreading, target resolution, run option checks, typed
records, engine-folder hints, unpack never deleting, lock files, one-line errors for unwritable or truncated
files. Fast: nothing here builds an engine."""

import errno
import json
import shutil

import numpy as np
import pytest

from fluxtrt import api
from fluxtrt.errors import ConfigError, FluxtrtError
from fluxtrt.precisions import CALIBRATED, FLOATS, RECIPES, REGISTRY, apply_overrides
from fluxtrt.records import CalibrationSettings, ComponentEntry, Manifest, ManifestError, ModelRef, read_manifest

CONFIG = {"clip": "fp16", "t5": "bf16", "transformer": "bf16", "vae_decoder": "fp32", "vae_encoder": "fp32"}


def test_recipe_alone_applies_where_it_exists_and_says_so():
    merged, notes = apply_overrides(CONFIG, ["fp8"])
    assert merged == dict(CONFIG, transformer="fp8")
    assert len(notes) == 1 and notes[0].startswith("fp8 applies to transformer") and "clip stays fp16" in notes[0]
    merged, notes = apply_overrides(CONFIG, ["int4-wo"], ["transformer"])
    assert merged["transformer"] == "int4-wo" and notes == []  # only the transformer was asked for: nothing to say
    merged, _ = apply_overrides(CONFIG, ["bf16"], ["clip", "t5"])
    assert merged == dict(CONFIG, clip="bf16")
    merged, _ = apply_overrides(CONFIG, ["transformer=fp8", "t5=fp32"])
    assert merged == dict(CONFIG, transformer="fp8", t5="fp32")
    with pytest.raises(ConfigError, match="none of the components built"):
        apply_overrides(CONFIG, ["fp8"], ["clip"])


def test_registry_is_the_one_list_of_recipes():
    from fluxtrt.quantize import qdq

    assert qdq.RECIPES is RECIPES and set(RECIPES) == {"fp8", "fp8-attn", "fp8-wo", "int8", "int8-wo", "int4-wo", "fp4"}
    assert set(CALIBRATED) == {"fp8", "fp8-attn", "int8", "fp4"} and set(FLOATS) == {"fp32", "fp16", "bf16"}
    assert REGISTRY["fp8"].min_cc == (8, 9) and REGISTRY["int8"].backends == ("tensorrt",)
    assert REGISTRY["fp4"].min_cc == (10, 0) and REGISTRY["fp4"].zero_copy_graph == "bf16"


def test_resolve_target_spreads_fp8_and_refuses_gpu_with_config(tmp_path):
    cfg, notes = api.resolve_target("4090", None, ["fp8"])
    assert cfg.precision["transformer"] == "fp8" and cfg.precision["clip"] == "fp16" and notes
    assert cfg.key == "4090-fp8" and any("4090/ keeps the config's" in n for n in notes)  # side by side
    assert api.resolve_target("4090", None, ["bf16"])[0].key == "4090-bf16"
    assert api.resolve_target("4090", None, ["transformer=fp8", "t5=fp32"])[0].key == "4090-t5-fp32-transformer-fp8"
    assert api.resolve_target("4090", None, ["transformer=bf16"])[0].key == "4090"  # the config's own: same folder
    with pytest.raises(ConfigError, match="quantizes the transformer's linear layers only.*-p transformer=fp8"):
        api.resolve_target("4090", None, ["clip=fp8"])
    with pytest.raises(ConfigError, match="fp8 needs compute capability 8.9"):
        api.resolve_target("3090", None, ["fp8"])
    custom = tmp_path / "mine.yaml"
    shutil.copy(api.__file__.replace("api.py", "data/configs/4090.yaml"), custom)
    with pytest.raises(FluxtrtError, match="pass --gpu or --config, not both"):
        api.resolve_target("4090", custom)
    assert api.resolve_target(None, custom)[0].key == "mine"


@pytest.mark.parametrize("change, message", [
    ({"height": 0}, "--height must be at least 1"),
    ({"width": -16}, "--width must be at least 1"),
    ({"steps": 100000}, "more than 1000"),
    ({"steps": 0}, "--steps must be at least 1"),
    ({"weight_streaming_budget": -5}, "at least 0"),
    ({"batch": 0}, "--batch must be at least 1"),
    ({"seed": -1}, "--seed must be in"),
    ({"torch_dtype": "fp64"}, "--torch-dtype"),
])
def test_run_options_refuse_what_would_be_silent(change, message):
    with pytest.raises(FluxtrtError, match=message):
        api.RunOptions.of(**change).check()
    api.RunOptions.of(height=256, width=512, steps=1000).check()  # the edges are accepted


def test_size_suggestions_stay_inside_the_engines_range():
    from fluxtrt.runtime.pipeline import nearest_multiples

    assert nearest_multiples(1000, 16) == "992 or 1008"
    assert nearest_multiples(1537, 16, 256, 1536) == "1536"
    assert nearest_multiples(250, 16, 256, 1536) == "256"
    assert nearest_multiples(1530, 16, 256, 1536) == "1520 or 1536"


def _manifest(**kw) -> Manifest:
    entry = ComponentEntry(engine="clip.engine", sha256="a" * 64, bytes=10, precision="fp16", onnx="onnx/x/clip.onnx",
                           onnx_sha256="b" * 64, build_key="c" * 64, layers=3, inputs=[{"name": "input_ids",
                           "dtype": "int64", "shape": [-1, 77]}], outputs=[], profile={})
    return Manifest(fluxtrt="0.1.0", backend="tensorrt-rtx", backend_version="1.7", gpu="4090", gpu_name="RTX 4090",
                    compute_capability="8.9", config_hash="d" * 64, vram_gb=24.0, model=ModelRef("tiny", "e" * 64, "dev"),
                    static_shape=False, shape_range={"min": [1, 256, 256], "opt": [1, 512, 512], "max": [4, 1024, 1024]},
                    pixel_multiple=16, components={"clip": entry}, **kw)


def test_manifest_round_trip_and_schema(tmp_path):
    m = _manifest()
    m.write(tmp_path)
    back = read_manifest(tmp_path)
    assert back == m and back.components["clip"].dtype_of("input_ids") == "int64" and back.sm == "sm89"
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["schema"] == 2 and data["components"]["clip"]["engine"] == "clip.engine"
    data["schema"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="written by another fluxtrt .* rebuild with `fluxtrt build`"):
        read_manifest(tmp_path)
    del data["components"]["clip"]["sha256"]
    data["schema"] = 2
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="rebuild"):
        read_manifest(tmp_path)
    with pytest.raises(ManifestError, match=r"has no t5 engine\(s\) \(it has clip\); build them with"):
        m.component("t5")


def test_build_root_given_as_engines_names_its_gpu_folders(tmp_path):
    _manifest().write(tmp_path / "4090")
    with pytest.raises(ManifestError, match=r"build root holding 4090.*--engines .*4090"):
        read_manifest(tmp_path)


def test_calibration_settings_defaults_and_checks(tmp_path):
    s = CalibrationSettings()
    assert (s.size, s.steps, s.alpha, s.opt_resolution) == (32, 4, 0.5, 1024) and s.prompts_path().is_file()
    with pytest.raises(FluxtrtError, match="calibration prompts .* not found"):
        CalibrationSettings(prompts_file=tmp_path / "missing.txt").check()
    with pytest.raises(FluxtrtError, match="at least 1"):
        CalibrationSettings(size=0).check()
    with pytest.raises(FluxtrtError, match="choose cpu or cuda"):
        CalibrationSettings(device="tpu").check()
    with pytest.raises(FluxtrtError, match="0..1"):
        CalibrationSettings(alpha=2.0).check()


def test_missing_prompts_are_one_line_when_hashed(tmp_path):
    from fluxtrt.stages.base import prompts_sha256

    with pytest.raises(FluxtrtError, match="cannot read the calibration prompts .*--calibration-prompts"):
        prompts_sha256(CalibrationSettings(prompts_file=tmp_path / "gone.txt"))


def test_lock_file_is_not_left_behind(tmp_path):
    from fluxtrt.fileio import exclusive_lock

    with exclusive_lock(tmp_path):
        assert (tmp_path / ".fluxtrt.lock").exists()
        with pytest.raises(FluxtrtError, match="another fluxtrt build"):
            with exclusive_lock(tmp_path):
                pass
    assert not (tmp_path / ".fluxtrt.lock").exists()
    with exclusive_lock(tmp_path):  # and it can be taken again
        pass


def test_truncated_safetensors_is_one_line(tmp_path, tiny_schnell):
    from fluxtrt.models.source import resolve_model

    copy = tmp_path / "model"
    shutil.copytree(tiny_schnell.path, copy)
    shard = next((copy / "transformer").glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(FluxtrtError, match=r"is truncated \(.* bytes, tensor .* ends at .*download or copy it again"):
        resolve_model(str(copy))


def test_unwritable_output_is_checked_before_any_work(tmp_path, monkeypatch):
    """`run` checks --out before generating; the CLI turns EACCES/EROFS anywhere into one line, exit 2."""
    import tempfile

    from typer.testing import CliRunner

    from fluxtrt.cli import app
    from fluxtrt.runtime.images import check_output_path

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FluxtrtError, match="cannot write .*pass --out in a writable folder"):
        check_output_path(blocker / "sub" / "img.png")  # a file where a folder should be

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(FluxtrtError, match="Read-only file system"):
        check_output_path(tmp_path / "img.png")

    def read_only(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "o" / "clip.onnx"))

    monkeypatch.setattr("fluxtrt.api.export", read_only)
    res = CliRunner().invoke(app, ["export", "--model", "tiny-schnell", "-c", "clip", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "cannot write" in res.output and "Permission denied" in res.output and "writable folder" in res.output


def test_png_carries_its_settings(tmp_path):
    import numpy as np
    from PIL import Image

    from fluxtrt.runtime.images import save_png

    img = np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    save_png(img, tmp_path / "a.png", {"prompt": "a fox", "seed": 7, "steps": 4})
    with Image.open(tmp_path / "a.png") as im:
        assert im.text == {"prompt": "a fox", "seed": "7", "steps": "4"} and im.size == (24, 16)
        assert (np.asarray(im) == img).all()
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]  # no temp file left


def test_memory_needed_from_the_builders_report():
    m = _manifest()
    base = m.components["clip"]
    assert m.memory_needed() is None  # no report (an older fluxtrt): unknown, not a guess
    sizes = {"clip": (100, 10), "t5": (900, 50), "transformer": (5000, 400), "vae_decoder": (200, 800)}
    m.components = {n: ComponentEntry(**{**base.to_json(), "memory": {"weights": w, "activations": a,
                                                                      "persistent": 1}})
                    for n, (w, a) in sizes.items()}
    assert m.memory_needed() == (100 + 900 + 5000 + 200 + 4) + 800  # all resident + one shared activation buffer
    assert m.memory_needed(low_vram=True) == (5000 + 1) + 800  # the largest stage (the transformer) + the buffer


@pytest.mark.parametrize("command", [
    ["export", "--model", "tiny-schnell", "-c", "clip", "--out", "{bad}"],
    ["build", "--gpu", "4090", "--model", "tiny-schnell", "-c", "clip", "--out", "{bad}"],
    ["artifacts", "--gpus", "4090", "--model", "tiny-schnell", "--engines", "{tmp}/e", "--out", "{bad}"],
    ["bench", "--engines", "{tmp}/none", "--json", "{bad}/b.json"],
    ["run", "--model", "tiny-schnell", "--backend", "torch", "--prompt", "x", "--out", "{bad}/x.png"],
], ids=["export", "build", "artifacts", "bench", "run"])
def test_unwritable_output_folder_is_one_line_everywhere(tmp_path, command):
    """An --out where no folder can be made (a file sits in the way): one line naming the fix, exit 2, no
    traceback, no half-written file."""
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    args = [a.format(bad=blocker / "sub", tmp=tmp_path) for a in command]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert "Traceback" not in res.output and len(errors) == 1, res.output
    text = " ".join(res.output.split())
    assert "cannot write" in text and "a-file" in text, text
    assert blocker.read_text() == "not a folder"


def test_stage_records_are_typed_and_versioned(tmp_path):
    from fluxtrt.records import StageInfo, StageRecord

    info = StageInfo({"model_hash": "abc", "dtype": "fp32"},
                     {"clip": StageRecord(sha256="0" * 64, max_rel_err=2e-7, file="clip.onnx", zero_copy=None)})
    info.write(tmp_path / "export.json")
    data = json.loads((tmp_path / "export.json").read_text())
    assert data["schema"] == 1 and data["model_hash"] == "abc" and data["components"]["clip"]["zero_copy"] is None
    back = StageInfo.read(tmp_path / "export.json")
    assert back == info and back.components["clip"].max_rel_err == 2e-7
    data["schema"] = 0  # written by an older fluxtrt: nothing of it is reused
    (tmp_path / "export.json").write_text(json.dumps(data))
    assert StageInfo.read(tmp_path / "export.json").components == {}
    (tmp_path / "export.json").write_text("{not json")
    assert StageInfo.read(tmp_path / "export.json") == StageInfo()


@pytest.mark.parametrize("n", [2, 4, 12])
def test_bench_plot_labels_do_not_overlap(n):
    """`bench --plot`: every row's label is drawn, and no two labels' boxes overlap (they did on the x axis)."""
    import itertools

    import matplotlib.pyplot as plt

    from fluxtrt.bench import Measure, Row, figure

    rng = np.random.default_rng()
    rows = []
    for i in range(n):
        lo, mid, hi = sorted(rng.uniform(0.05, 2.0, 3))
        m = Measure(mid, lo, hi)
        rows.append(Row("fluxtrt (onnxruntime)" if i % 2 == 0 else "diffusers", 256 * (1 + i // 2),
                        256 * (1 + i // 2), 1 + i % 3, 4, m, m, m, m, float(rng.uniform(0.1, 3)), 60.0, 0.5, None))
    fig = figure(rows)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in fig.axes[0].get_yticklabels() if t.get_text()]
    assert len(labels) == n
    for ax in fig.axes:
        for ticks in (ax.get_xticklabels(), labels):
            boxes = [t.get_window_extent(renderer) for t in ticks if t.get_text() and t.get_visible()]
            assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    plt.close(fig)


def test_build_without_model_says_it_built_tiny(monkeypatch, tmp_path):
    seen = {}

    def fake_build_gpu(source, cfg, out_root, *args, **kwargs):
        seen["model"] = source.id
        return _manifest(), []

    monkeypatch.setattr("fluxtrt.stages.build.build_gpu", fake_build_gpu)
    summary = api.build(gpu="4090", out_dir=tmp_path)
    assert seen["model"] == "tiny" and any("no --model given" in n for n in summary.notes)
    summary = api.build(gpu="4090", model="tiny", out_dir=tmp_path)
    assert not any("no --model" in n for n in summary.notes)


def test_cpu_build_log_keeps_out_expected_cuda_driver_errors():
    """An ahead-of-time build on a machine without a GPU: TensorRT-RTX's CUDA-driver complaints become one note
    in build.log and are not build errors; other errors are kept."""
    import io

    trt = pytest.importorskip("tensorrt_rtx")
    from fluxtrt.core.backends import TensorRTRTX

    logger = TensorRTRTX().logger
    log = io.StringIO()
    logger.file, logger.errors, logger.cpu_note = log, [], False
    try:
        for _ in range(3):
            logger.log(trt.ILogger.Severity.ERROR, "CUDA driver version is insufficient for CUDA runtime version")
        logger.log(trt.ILogger.Severity.ERROR, "a real problem")
        logger.log(trt.ILogger.Severity.INFO, "Total Activation Memory: 8551936 bytes")
    finally:
        logger.file = None
    text = log.getvalue()
    assert "insufficient" not in text and text.count("[NOTE] no usable CUDA driver") == 1
    assert logger.errors == ["a real problem"] and "[ERROR] a real problem" in text
    assert logger.memory["activations"] == 8551936
