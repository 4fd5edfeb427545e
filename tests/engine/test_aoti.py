"""engine/aoti.py: torch.export over the profile's ranges, AOTInductor into a .pt2 package, outputs equal to the
module's at sizes across the profile."""

import pytest
import torch

from fluxtrt.components import ShapePoint, ShapeRange, specs_for
from fluxtrt.engine.aoti import compile_package, dynamic_shapes, example_point
from fluxtrt.models.source import resolve_model

RANGE = ShapeRange(ShapePoint(1, 64, 64), ShapePoint(1, 128, 128), ShapePoint(4, 256, 256))


def test_dynamic_dims_are_the_profiles_ranges_shared_by_every_input_that_names_them(tiny_dev):
    geo = tiny_dev.geometry
    specs = specs_for(geo, ["transformer", "vae_encoder"])
    dyn = dynamic_shapes(specs["transformer"], geo, RANGE)
    names = [t.name for t in specs["transformer"].inputs]
    hidden, ids = dyn[names.index("hidden_states")], dyn[names.index("img_ids")]
    assert hidden[1] is ids[0]  # one `image_tokens` for both: export relates them
    assert (hidden[0].min, hidden[0].max, hidden[1].min, hidden[1].max) == (1, 4, 16, 256)
    assert dyn[names.index("txt_ids")] is None  # the text length is the model's, not the profile's
    (image,) = dynamic_shapes(specs["vae_encoder"], geo, RANGE)
    assert str(image[2]) == str(geo.vae_scale_factor * torch.export.Dim("image_height", min=8, max=32))
    static = ShapeRange(RANGE.opt, RANGE.opt, RANGE.opt)
    assert all(d is None for d in dynamic_shapes(specs["transformer"], geo, static))
    # a traced batch of 1 would be specialized: export traces at 2 where the profile allows it
    assert example_point(RANGE) == ShapePoint(2, 128, 128) and example_point(static) == RANGE.opt


@pytest.mark.slow
def test_a_clip_package_equals_its_module_across_the_profile(tmp_path):
    """CLIP of tiny compiled for this CPU (the smallest module: one C++ compile of ~15 s) equals the module at batch 1
    and 3, inputs fresh each time, within 1e-5 of the output's range."""
    from fluxtrt.core.packages import open_package

    src = resolve_model("tiny")
    spec = specs_for(src.geometry, ["clip"])["clip"]
    module = spec.wrap(src.load_component(spec.subfolder, torch.float32, "cpu")).eval()
    built = compile_package(module, spec, src.geometry, RANGE, device="cpu", dtype=torch.float32,
                            package_path=tmp_path / "clip.pt2")
    assert built.bytes == (tmp_path / "clip.pt2").stat().st_size and not list(tmp_path.glob(".tmp-*"))
    assert built.inputs == [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "geo.clip_length"]}]
    assert built.outputs[0]["dtype"] == "float" and built.profile["input_ids"]["max"][0] == 4
    assert built.constants["file"] == "clip.constants.safetensors"
    package, _weights = open_package(tmp_path / "clip.pt2", tmp_path / built.constants["file"], built.constants, "cpu",
                                     "clip")
    seed = int(torch.randint(0, 1000, ()))
    for batch in (1, 3):
        feeds = spec.sample_inputs(ShapePoint(batch, 64, 64), src.geometry, seed + batch)
        with torch.no_grad():
            want = module(feeds["input_ids"])
            got = package(feeds["input_ids"])  # as the module returns it: one tensor
        assert got.shape == want.shape and float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_constants_inductor_makes_go_to_the_weights_file_under_the_names_the_package_asks():
    """made_constants: a parameter Inductor holds under its flat name is the exported weight (not written twice);
    a constant Inductor made while lowering (`constantN`, no FQN: the H100's fp8 transformer asked for constant1235)
    is added under that name; the same made constant in two lowered graphs once."""
    from types import SimpleNamespace

    from fluxtrt.engine.aoti import made_constants

    weight, made = torch.randn(4, 3), torch.randn(3)
    graph = SimpleNamespace(constants={"blocks_0_weight": weight, "constant7": made},
                            dynamo_flat_name_to_original_fqn={"blocks_0_weight": "blocks.0.weight"},
                            allocated_constant_name={"blocks_0_weight": "blocks.0.weight", "constant7": "constant7"})
    const_graph = SimpleNamespace(constants={"constant7": made}, dynamo_flat_name_to_original_fqn={},
                                  allocated_constant_name={"constant7": "constant7"})
    out = made_constants([graph, const_graph], {"blocks.0.weight": weight})
    assert list(out) == ["constant7"] and torch.equal(out["constant7"], made)
    assert made_constants([graph], {"blocks.0.weight": weight, "constant7": made}) == {}
