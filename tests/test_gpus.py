"""GPU configs: the shipped ones load, and bad ones get field-level errors."""

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxtrt.errors import ConfigError
from fluxtrt.gpus import configs_dir, known_gpus, load_config_file, load_gpu, parse_config

SHIPPED = ["3090", "4090", "5090", "a100", "l40s", "h100", "h200"]


def test_shipped_configs_load():
    assert set(SHIPPED) <= set(known_gpus())
    for key in SHIPPED:
        cfg = load_gpu(key)
        assert cfg.key == key and cfg.vram_gb > 0
        assert cfg.backend == ("tensorrt" if cfg.compute_capability == "9.0" else "tensorrt-rtx")
        rng = cfg.shape_range()
        assert (rng.min.batch, rng.opt.batch, rng.max.batch) == (1, 1, 4)
        assert (rng.min.height, rng.opt.height, rng.max.height) == (256, 1024, 1536)
    # 24 GB cards cannot hold a bf16 FLUX.1-dev transformer with activations: weight streaming
    for key in ("3090", "4090"):
        assert "transformer" in load_gpu(key).weight_streaming


def test_int8_w8a8_accepted_for_full_tensorrt_targets():
    assert load_gpu("h100").with_precision({"transformer": "int8"}).precision["transformer"] == "int8"


def test_compiled_pytorch_on_a_gpu_runs_the_vae_in_bf16_and_keeps_the_rest():
    """--backend torch: a GPU config's fp32 VAE becomes bf16 (diffusers' bf16 pipeline; its fp32 activations were
    3.1 GB of the H100 packages' peak), recorded in the config hash; the other components and the CPU target keep
    theirs."""
    for key in ("h100", "4090"):
        cfg = load_gpu(key)
        torch_cfg = cfg.for_backend("torch")
        assert cfg.precision["vae_decoder"] == "fp32" and torch_cfg.precision["vae_decoder"] == "bf16"
        assert torch_cfg.precision["vae_encoder"] == "bf16"
        assert {c: p for c, p in torch_cfg.precision.items() if not c.startswith("vae")} == {
            c: p for c, p in cfg.precision.items() if not c.startswith("vae")}
        assert torch_cfg.config_hash != cfg.for_backend("tensorrt-rtx" if key == "h100" else "tensorrt").config_hash
    cpu = load_gpu("cpu")
    assert cpu.for_backend("torch") is cpu and cpu.precision["vae_decoder"] == "fp32"


def test_unknown_gpu_lists_known():
    with pytest.raises(ConfigError, match="unknown GPU 'v100'; known: 3090, 4090"):
        load_gpu("v100")


def test_static_shape_pins_profile():
    rng = load_gpu("4090").shape_range(static=True)
    assert rng.min == rng.opt == rng.max


def _base():
    return yaml.safe_load((configs_dir() / "4090.yaml").read_text())


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("backend"), "missing field 'backend'"),
    (lambda d: d.update(backend="cuda"), "backend must be one of"),
    (lambda d: d.update(compute_capability="9.0"), "TensorRT-RTX cannot target compute capability 9.0"),
    (lambda d: d.update(compute_capability="89"), 'must look like "8.9"'),
    (lambda d: d["precision"].update(transformer="fp4"),
     "fp4 needs compute capability 10.0 or newer \\(Blackwell: --gpu 5090\\) \\(this target is 8.9\\); use fp8"),
    (lambda d: d["precision"].update(t5="fp8"), "quantizes the transformer's linear layers only"),
    (lambda d: d.update(compute_capability="8.6") or d["precision"].update(transformer="fp8"),
     "fp8 needs compute capability 8.9"),
    (lambda d: d["precision"].update(transformer="int3"), "not one of fp32, fp16, bf16, fp8"),
    (lambda d: d["precision"].update(transformer="int8"), "int8 \\(W8A8\\) needs the full TensorRT backend"),
    (lambda d: d.update(compute_capability="8.6") or d["precision"].update(transformer="fp8-attn"), "fp8 needs"),
    (lambda d: d["precision"].pop("t5"), "precision lacks t5"),
    (lambda d: d.update(profile={"batch": [4, 1, 1]}), "1 <= min <= opt <= max"),
    (lambda d: d.update(profile={"resolution": [250, 1024, 1536]}), "multiples of 16"),
    (lambda d: d.update(colour="red"), "unknown field"),
    (lambda d: d.update(vram_gb="lots"), "field 'vram_gb' has the wrong type"),
])
def test_field_level_errors(mutate, message):
    data = _base()
    mutate(data)
    with pytest.raises(ConfigError, match=message):
        parse_config(data, "x", "x.yaml")


def test_malformed_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config_file(bad)
    evil = tmp_path / "evil.yaml"
    evil.write_text("!!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(ConfigError):
        load_config_file(evil)  # safe loader: tags that construct objects are refused


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-5, 5000), min_size=0, max_size=4))
def test_resolution_triples_property(values):
    data = _base()
    data["profile"] = {"resolution": values}
    ok = len(values) == 3 and 1 <= values[0] <= values[1] <= values[2] and all(v % 16 == 0 for v in values)
    if ok:
        assert parse_config(data, "x", "x.yaml").resolution == tuple(values)
    else:
        with pytest.raises(ConfigError):
            parse_config(data, "x", "x.yaml")
