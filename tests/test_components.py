"""Component specs: the one place shapes come from."""

import pytest

from fluxtrt.components import ALL, SYMBOLS, ShapePoint, ShapeRange, specs_for
from fluxtrt.errors import FluxtrtError


def test_every_symbol_is_known_and_every_component_has_an_export_test():
    for spec in ALL.values():
        for t in spec.inputs + spec.outputs:
            for d in t.dims:
                assert isinstance(d, int) or d in SYMBOLS or d.startswith("geo."), (spec.name, t.name, d)
    # meta-test: the export test is parametrised over exactly the registered components
    from tests.export.test_export import COMPONENTS_UNDER_TEST

    assert set(COMPONENTS_UNDER_TEST) == set(ALL)


def test_shapes_follow_flux_geometry(tiny_dev):
    geo = tiny_dev.geometry
    specs = specs_for(geo)
    p = ShapePoint(3, 1024, 768)
    tr = specs["transformer"].input_shapes(p, geo)
    assert tr["hidden_states"] == (3, 64 * 48, geo.in_channels)
    assert tr["img_ids"] == (64 * 48, 3)
    assert tr["encoder_hidden_states"] == (3, 512, geo.t5_hidden)
    assert tr["guidance"] == (3,)
    assert specs["vae_decoder"].input_shapes(p, geo)["latent"] == (3, geo.latent_channels, 128, 96)
    assert specs["vae_decoder"].output_shapes(p, geo)["image"] == (3, 3, 1024, 768)
    assert specs["clip"].input_shapes(p, geo)["input_ids"] == (3, 77)


def test_schnell_transformer_has_no_guidance(tiny_schnell):
    names = [t.name for t in specs_for(tiny_schnell.geometry)["transformer"].inputs]
    assert "guidance" not in names and names[0] == "hidden_states"


def test_profile_is_min_opt_max_of_the_same_spec(tiny_dev):
    geo = tiny_dev.geometry
    rng = ShapeRange(ShapePoint(1, 256, 256), ShapePoint(1, 1024, 1024), ShapePoint(4, 1536, 1536))
    prof = specs_for(geo)["transformer"].profile(rng, geo)
    assert prof["hidden_states"] == ((1, 256, 16), (1, 4096, 16), (4, 9216, 16))
    assert prof["txt_ids"] == ((512, 3),) * 3


def test_sample_inputs_are_fresh_and_nonzero(tiny_dev):
    geo = tiny_dev.geometry
    spec = specs_for(geo)["transformer"]
    a = spec.sample_inputs(ShapePoint(2, 64, 96), geo, seed=1)
    b = spec.sample_inputs(ShapePoint(2, 64, 96), geo, seed=2)
    for name in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"):
        assert a[name].abs().sum() > 0 and not (a[name] == b[name]).all(), name
    assert ((a["timestep"] > 0) & (a["timestep"] < 1)).all()


def test_unknown_component_is_a_clear_error(tiny_dev):
    with pytest.raises(FluxtrtError, match="unknown component.*choose from"):
        specs_for(tiny_dev.geometry, ["unet"])
