"""precisions.py: the precision and recipe registry, and `-p` spreading over a config's precision map."""

import pytest

from fluxtrt.errors import ConfigError
from fluxtrt.precisions import CALIBRATED, COMPONENTS, FLOATS, RECIPES, REGISTRY, apply_overrides, check


def test_the_registry_is_consistent():
    assert set(FLOATS) | set(RECIPES) == set(REGISTRY) and not set(FLOATS) & set(RECIPES)
    assert set(CALIBRATED) <= set(RECIPES)
    for p in REGISTRY.values():
        assert set(p.components) <= set(COMPONENTS) and (p.rest is not None) == p.recipe


def test_a_recipe_applies_where_it_exists_and_says_so():
    base = {c: "bf16" for c in COMPONENTS}
    merged, notes = apply_overrides(base, ["fp8"])
    assert merged["transformer"] == "fp8" and all(merged[c] == "bf16" for c in COMPONENTS if c != "transformer")
    assert notes and "fp8 applies to transformer" in notes[0]
    merged, _ = apply_overrides(base, ["fp32", "t5=bf16"])
    assert merged["t5"] == "bf16" and merged["clip"] == "fp32"


@pytest.mark.parametrize("call,says", [
    (lambda: apply_overrides({c: "bf16" for c in COMPONENTS}, ["fp8", "fp16"]), "given twice"),
    (lambda: apply_overrides({}, ["fp8"], components=["clip"]), "none of the components built"),
    (lambda: check("clip", "fp8", "-p"), "quantizes the transformer's linear layers only"),
    (lambda: check("transformer", "fp4", "-p", compute_capability="8.9"), "needs compute capability 10.0"),
    (lambda: check("transformer", "int8", "-p", backend="tensorrt-rtx"), "needs the full TensorRT backend"),
    (lambda: check("unet", "fp16", "-p"), "unknown component"),
    (lambda: check("t5", "fp8-wo", "-p", backend="tensorrt-rtx"), "fp8-wo is computed by compiled PyTorch engines"),
    (lambda: check("transformer", "fp8-wo", "-p"), "'fp8-wo' quantizes the t5's linear layers only"),
])
def test_what_cannot_be_built_is_one_line(call, says):
    with pytest.raises(ConfigError, match=says):
        call()
