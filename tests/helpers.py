"""Small builders shared by tests."""

from pathlib import Path

from fluxtrt.records import ComponentEntry


def export_checked(source, spec, out_dir, dtype: str = "fp32", *, zero_copy: bool = False, **options):
    """One component exported as `fluxtrt export` and the build export it: through the stage runner, validated
    against PyTorch. Returns its ExportResult (max_rel_err set). `options`: export_component's own."""
    from fluxtrt.stages.base import export_step, run_step

    results: list = []
    step = export_step(source, spec.name, Path(out_dir), dtype, zero_copy=zero_copy, on_phase=lambda _: None,
                       exported=results, **options)
    run_step(source, spec.name, step, force=True, on_phase=lambda _: None, validate=True)
    return results[0]


def entry(**fields) -> ComponentEntry:
    """A manifest entry with placeholder values for what a test does not look at."""
    base = dict(engine="x.engine", sha256="", bytes=1, precision="fp32", onnx="onnx/x.onnx", onnx_sha256="",
                build_key="", layers=1, inputs=[], outputs=[], profile={})
    return ComponentEntry(**{**base, **fields})


def fake_engine_folder(model: str, folder, engine_files: bool = False) -> dict:
    """An engine folder whose manifest declares the 4090's profiles for `model` (tiny, tiny-schnell, ...) with its
    model assets, and no built engine (request and input checks need none): writes folder/manifest.json and
    returns the manifest. `engine_files`: each entry also gets a small random `.engine` file (its sha256 and size
    in the manifest) and an empty weight map."""
    import hashlib
    import json
    import os

    from fluxtrt.components import ShapePoint, ShapeRange, specs_for
    from fluxtrt.models.source import resolve_model
    from fluxtrt.stages.build import copy_model_assets

    src = resolve_model(model)
    folder.mkdir(parents=True, exist_ok=True)
    copy_model_assets(src, folder)
    rng = ShapeRange(ShapePoint(1, 256, 256), ShapePoint(1, 512, 512), ShapePoint(4, 1024, 1024))
    comps = {}
    for name, spec in specs_for(src.geometry, ["clip", "t5", "transformer", "vae_decoder"]).items():
        prof = {k: {"min": list(lo), "opt": list(opt), "max": list(hi)} for k, (lo, opt, hi) in
                spec.profile(rng, src.geometry).items()}
        comps[name] = {"engine": f"{name}.engine", "sha256": "0" * 64, "onnx": f"onnx/{name}.onnx",
                       "onnx_sha256": "0" * 64, "profile": prof, "inputs": [], "outputs": [], "precision": "fp32",
                       "bytes": 1, "build_key": "0" * 64, "layers": 1}
        if engine_files:
            data = os.urandom(64)
            (folder / f"{name}.engine").write_bytes(data)
            (folder / f"{name}.weights.json").write_text(json.dumps(
                {"component": name, "subfolder": spec.subfolder, "refittable": True, "reason": "", "weights": [],
                 "checkpoint_tensors": []}))
            comps[name].update(sha256=hashlib.sha256(data).hexdigest(), bytes=64, weight_map=f"{name}.weights.json")
    manifest = {"schema": 2, "fluxtrt": "0.1.0", "config_hash": "0" * 64, "vram_gb": 24.0, "static_shape": False,
                "pixel_multiple": 16, "backend": "tensorrt-rtx", "backend_version": "1.7.1.116", "gpu": "4090",
                "gpu_name": "NVIDIA GeForce RTX 4090", "compute_capability": "8.9",
                "model": {"id": model, "hash": src.content_hash, "variant": src.variant},
                "shape_range": {"min": [1, 256, 256], "opt": [1, 512, 512], "max": [4, 1024, 1024]},
                "components": comps}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest
