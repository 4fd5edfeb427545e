"""Engine builder: real TensorRT-RTX engines for the tiny models, ahead of time on this CPU-only machine."""

import json
import re
import sys
import types

import pytest
import yaml

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")

from fluxtrt.components import specs_for  # noqa: E402
from fluxtrt.core.backends import TensorRT, TensorRTRTX, get_backend  # noqa: E402
from fluxtrt.engine.build import BuildError, apply_profile  # noqa: E402
from fluxtrt.errors import BackendUnavailableError  # noqa: E402
from fluxtrt.fileio import sha256_file  # noqa: E402
from fluxtrt.gpus import configs_dir, load_config_file, load_gpu  # noqa: E402
from fluxtrt.models.source import resolve_model  # noqa: E402
from fluxtrt.records import read_manifest  # noqa: E402
from fluxtrt.stages.build import build_gpu  # noqa: E402

_BUILDS = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    roots = {}  # one build root per model: a GPU folder holds one model's engines (another's build is refused)

    def get(model, gpu):
        root = roots.setdefault(model, tmp_path_factory.mktemp(f"engines-{model}"))
        if (model, gpu) not in _BUILDS:
            src = resolve_model(model)
            _BUILDS[(model, gpu)] = (src, load_gpu(gpu), *build_gpu(src, load_gpu(gpu), root))
        return (root, *_BUILDS[(model, gpu)])

    return get


def check_manifest(root, src, cfg, manifest):
    geo = src.geometry
    gpu_dir = root / cfg.key
    assert read_manifest(gpu_dir) == manifest
    assert manifest.backend == "tensorrt-rtx" and manifest.backend_version == TensorRTRTX().version
    assert manifest.compute_capability == cfg.compute_capability
    assert vars(manifest.model) == {"id": src.id, "hash": src.content_hash, "variant": src.variant, "model_class": "FluxPipeline"}
    assert manifest.workflows == ["txt2img", "img2img"]
    assert manifest.config_hash == cfg.config_hash
    rng = cfg.shape_range()
    specs = specs_for(geo)
    assert set(manifest.components) == set(specs)
    for name, spec in specs.items():
        e = manifest.components[name]
        assert e.precision == cfg.precision[name]
        assert sha256_file(gpu_dir / e.engine) == e.sha256 and e.bytes > 10_000
        assert sha256_file(root / e.onnx) == e.onnx_sha256
        assert e.onnx.split("/")[1].endswith(f"-{cfg.precision[name]}-opt")  # built from the optimized graph
        assert [i["name"] for i in e.inputs] == [t.name for t in spec.inputs]
        assert [o["name"] for o in e.outputs] == [t.name for t in spec.outputs]
        # the profile TensorRT holds covers exactly the documented range (256..1536 px, batch 1..4)
        want = spec.profile(rng, geo)
        for inp, (lo, opt, hi) in want.items():
            assert e.profile[inp] == {"min": list(lo), "opt": list(opt), "max": list(hi)}, (name, inp)
        assert e.layers > 10 and e.build_seconds > 0 and e.peak_rss_mb > 100
        # footprint per stage: wall time, bytes written, peak RSS (as measured when the stage ran)
        assert set(e.stages) == {"export", "optimize", "build"}
        for st in e.stages.values():
            if st["status"] == "built":
                assert st["seconds"] > 0 and st["bytes_written"] > 0 and st["peak_rss_mb"] > 100
        assert e.stages["build"]["bytes_written"] in (0, e.bytes)
        assert e.weight_streaming == (name in cfg.weight_streaming)
        dtypes = {i["name"]: i["dtype"] for i in e.inputs}
        float_in = [t.name for t in spec.inputs if t.is_float]
        expect = {"fp32": "float", "fp16": "half", "bf16": "bf16"}[cfg.precision[name]]
        assert all(dtypes[n] == expect for n in float_in), (name, dtypes)


@pytest.mark.parametrize("model", ["tiny", "tiny-schnell"])
def test_build_sm89(built, model):
    root, src, cfg, manifest, results = built(model, "4090")
    check_manifest(root, src, cfg, manifest)
    assert {r.status for r in results if r.stage == "build"} == {"built"}
    tr = manifest.components["transformer"]
    assert ("guidance" in [i["name"] for i in tr.inputs]) == (model == "tiny")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "tiny-schnell"])
def test_build_sm86_reuses_exports(built, model):
    built(model, "4090")
    root, src, cfg, manifest, results = built(model, "3090")
    check_manifest(root, src, cfg, manifest)
    assert all(r.status == "reused" for r in results if r.stage in ("export", "optimize"))  # ONNX shared across GPUs
    assert manifest.compute_capability == "8.6"


def test_second_build_is_a_noop(built):
    root, src, cfg, manifest, _ = built("tiny-schnell", "4090")
    mtimes = {p.name: p.stat().st_mtime_ns for p in (root / "4090").glob("*.engine")}
    manifest2, results = build_gpu(src, cfg, root)
    assert results and all(r.status == "reused" for r in results)
    assert {p.name: p.stat().st_mtime_ns for p in (root / "4090").glob("*.engine")} == mtimes
    assert manifest2.components == manifest.components


def test_changed_config_rebuilds_only_what_changed(built, tmp_path):
    root, src, cfg, manifest, _ = built("tiny-schnell", "4090")
    data = yaml.safe_load((configs_dir() / "4090.yaml").read_text())
    data["precision"]["vae_decoder"] = "fp16"
    custom = tmp_path / "4090.yaml"  # same key, so it updates the same engine folder
    custom.write_text(yaml.safe_dump(data))
    cfg2 = load_config_file(custom)
    manifest2, results = build_gpu(src, cfg2, root)
    status = {(r.component, r.stage): r.status for r in results}
    assert status.pop(("vae_decoder", "optimize")) == "built" and status.pop(("vae_decoder", "build")) == "built"
    assert set(status.values()) == {"reused"}
    assert manifest2.components["vae_decoder"].precision == "fp16"
    # restore, so other tests see the shipped config's engines (the fp32 export is reused)
    build_gpu(src, cfg, root)


def test_interrupted_engine_write_is_not_trusted(built):
    """An engine file that does not match its manifest entry (e.g. a crash mid-write) is rebuilt."""
    root, src, cfg, manifest, _ = built("tiny-schnell", "4090")
    engine = root / "4090" / "clip.engine"
    engine.write_bytes(engine.read_bytes()[:1000])
    _, results = build_gpu(src, cfg, root, components=["clip"])
    assert {(r.stage, r.status) for r in results} == {("export", "reused"), ("optimize", "reused"), ("build", "built")}
    assert sha256_file(engine) == read_manifest(root / "4090").components["clip"].sha256


def test_profile_names_are_checked_against_the_network(tiny_schnell, built):
    root, *_ = built("tiny-schnell", "4090")
    trt = TensorRTRTX().trt
    backend = TensorRTRTX()
    builder = trt.Builder(backend.logger)
    net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(net, backend.logger)
    onnx_file = root / read_manifest(root / "4090").components["clip"].onnx
    assert parser.parse_from_file(str(onnx_file))
    with pytest.raises(BuildError, match="profile inputs \\['ids'\\] not in the network.*network has input_ids"):
        apply_profile(net, builder.create_optimization_profile(), {"ids": ((1, 77),) * 3}, "clip")
    with pytest.raises(BuildError, match="static size 77 on axis 1"):
        apply_profile(net, builder.create_optimization_profile(), {"input_ids": ((1, 64), (1, 77), (1, 77))}, "clip")


def test_full_tensorrt_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails as if not installed
    with pytest.raises(BackendUnavailableError, match="needs the 'tensorrt' package: pip install 'fluxtrt\\[trt\\]'"):
        get_backend("tensorrt").check_target("9.0")


def test_full_tensorrt_without_target_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.13"))
    monkeypatch.setattr("fluxtrt.core.backends.local_gpu_capabilities", lambda: [])
    with pytest.raises(BackendUnavailableError, match="builds only for the GPU it runs on.*sm90.*no CUDA GPU"):
        TensorRT().check_target("9.0")


def test_cli_build_h100_without_tensorrt_is_one_line(monkeypatch):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    res = CliRunner().invoke(app, ["build", "--gpu", "h100", "--model", "tiny"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "needs the 'tensorrt' package" in res.output and "fluxtrt[trt]" in res.output


@pytest.mark.slow
def test_cli_build_and_inspect(tmp_path):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    args = ["build", "--gpu", "4090", "--model", "tiny-schnell", "--out", str(tmp_path), "-c", "clip,vae_decoder"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    # not a terminal: every phase of every component is a plain line with the elapsed time, in order
    phases = re.findall(r"\[\s*(\d+\.\d)s\] (clip|vae_decoder): (\w+)", res.output)
    assert ("clip", "build") in [(c, p) for _, c, p in phases] and ("vae_decoder", "done") in [(c, p) for _, c, p in phases]
    assert [float(t) for t, _, _ in phases] == sorted(float(t) for t, _, _ in phases)
    assert "vae_decoder" in res.output and "built" in res.output
    from fluxtrt.models.source import resolve_model

    said = " ".join(res.output.split())  # where the embedded checkpoint lives, for --weights and LoRAs
    assert f"the embedded model tiny-schnell is a diffusers folder at {resolve_model('tiny-schnell').path}" in said
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0 and "Nothing to do" in res.output
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "4090")])
    assert res.exit_code == 0, res.output
    assert "tensorrt-rtx" in res.output and "clip" in res.output and "ok" in res.output
    assert re.search(r"device memory needed: [\d.]+ [KMG]B with every engine resident, [\d.]+ [KMG]B with --low-vram",
                     " ".join(res.output.split()))
    m = read_manifest(tmp_path / "4090")
    for e in m.components.values():  # the builder's own report, kept in the manifest
        assert e.memory["activations"] > 0 and e.memory["weights"] > 0
    assert m.memory_needed(low_vram=True) <= m.memory_needed()
    assert "WRONG SIZE" not in res.output and "MISMATCH" not in res.output
    assert not (tmp_path / "4090" / "timing.cache").exists()  # TensorRT-RTX: no timing cache (no effect there)
    assert not (tmp_path / ".fluxtrt.lock").exists()  # the build's lock is not left behind
    engine = tmp_path / "4090" / "clip.engine"
    data = engine.read_bytes()
    engine.write_bytes(data[: len(data) // 2])  # truncated: inspect says so without a GPU
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "4090")])
    assert res.exit_code == 2 and "WRONG SIZE" in res.output and "do not match the manifest" in res.output
    engine.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one flipped bit, same size
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "4090")])
    assert res.exit_code == 2 and "SHA256 MISMATCH" in res.output and "clip: SHA256 MISMATCH" in " ".join(res.output.split())


def test_plan_is_streamed_to_disk_and_a_failed_write_leaves_nothing(built, tmp_path, monkeypatch):
    """build_engine streams TensorRT's plan into a temp file (hashing it on the way) and renames it; the
    recorded sha256/bytes are the file's, a rebuild is byte-identical to the pipeline's engine, and a write
    error (disk full) is an OSError naming the engine (the CLI turns it into one line), no file left."""
    import contextlib
    import errno

    from fluxtrt import fileio
    from fluxtrt.engine.build import build_engine

    root, src, cfg, manifest, _ = built("tiny-schnell", "4090")
    entry = manifest.components["clip"]
    spec = specs_for(src.geometry, ["clip"])["clip"]
    backend = get_backend(cfg.backend)
    onnx_file = root / entry.onnx
    out = tmp_path / "clip.engine"
    engine = build_engine(backend, onnx_file, spec, src.geometry, cfg.shape_range(),
                          compute_capability=cfg.compute_capability, engine_path=out)
    assert engine.bytes == out.stat().st_size > 0 and engine.sha256 == sha256_file(out) == entry.sha256

    real = fileio.atomic_file

    @contextlib.contextmanager
    def disk_full(path):  # the real temp file, whose writes fail as on a full disk
        class Full:
            def write(self, data):
                raise OSError(errno.ENOSPC, "No space left on device")

        with real(path):
            yield Full()

    bad = tmp_path / "full" / "clip.engine"
    monkeypatch.setattr(fileio, "atomic_file", disk_full)
    with pytest.raises(OSError, match="No space left on device") as err:
        build_engine(backend, onnx_file, spec, src.geometry, cfg.shape_range(), compute_capability=cfg.compute_capability,
                     engine_path=bad)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(bad)  # the CLI names the engine
    assert list(bad.parent.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("path", ["zero-copy", "copying"])
def test_another_calibration_resolution_rebuilds_the_fp8_graph(path, tiny_bf16, tmp_path):
    """Both plans key a calibrated graph on the resolution it is calibrated at (stages.base.calibration_inputs,
    one stage runner): a config with another opt resolution rebuilds the fp8 graph; the same one reuses it."""
    from fluxtrt.records import CalibrationSettings
    from fluxtrt.stages.build import ensure_onnx

    def quantize_status(resolution):
        calib = CalibrationSettings(size=2, steps=1, opt_resolution=resolution)
        _, results = ensure_onnx(tiny_bf16, "transformer", "fp8", tmp_path, calib=calib,
                                 zero_copy=path == "zero-copy", validate=False)
        (q,) = [r for r in results if r.stage == "quantize"]
        assert (q.info or {}).get("path", "copying") == path
        return q.status

    assert [quantize_status(r) for r in (256, 256, 512, 512)] == ["built", "reused", "built", "reused"]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["zero-copy", "copying"])
def test_every_stage_of_both_plans_goes_through_the_one_runner(path, tiny_bf16, tmp_path, monkeypatch):
    """Export, graph passes and (fp8) quantization are Steps that stages.base.run_step reuses, makes and records:
    a second ensure_onnx reuses every one of them, a forced one rebuilds every one."""
    from fluxtrt.records import CalibrationSettings
    from fluxtrt.stages import base, fp32_plan, zerocopy_plan
    from fluxtrt.stages.build import ensure_onnx

    seen = []
    real = base.run_step

    def spy(source, component, step, **kw):
        out = real(source, component, step, **kw)
        seen.append((step.stage, "reused" if out[1] else "built"))
        return out

    for module in (fp32_plan, zerocopy_plan):
        monkeypatch.setattr(module, "run_step", spy)
    calib = CalibrationSettings(size=1, steps=1, opt_resolution=256)

    def stages(force=False):
        seen.clear()
        ensure_onnx(tiny_bf16, "clip", "bf16", tmp_path, force, calib=calib, zero_copy=path == "zero-copy",
                    validate=False)
        return list(seen)

    assert stages() == [("export", "built"), ("optimize", "built")]
    assert stages() == [("export", "reused"), ("optimize", "reused")]
    assert stages(force=True) == [("export", "built"), ("optimize", "built")]
    info = json.loads(next(tmp_path.glob("onnx/*/export.json")).read_text())
    assert "clip" in info["components"]  # the export step's record is export.json, as before
