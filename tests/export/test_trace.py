"""export/trace.py: the example each export traces at (dims that stay dynamic) and its dynamic axes."""

from fluxtrt.components import specs_for
from fluxtrt.export.trace import dynamic_shapes, example_point, has_safetensors
from fluxtrt.models.source import resolve_model


def test_the_example_keeps_batch_and_resolution_dynamic():
    """torch.export specialises a dim traced at size 0 or 1, and ties equal sizes: batch 2, a non-square image."""
    src = resolve_model("tiny")
    p = example_point(src.geometry)
    assert p.batch == 2 and p.height != p.width and p.height % src.geometry.pixel_multiple == 0


def test_shared_axes_share_one_dim():
    src = resolve_model("tiny")
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    shapes = dynamic_shapes(spec)
    batch_dims = {id(axes[0]) for axes in shapes if isinstance(axes, dict) and 0 in axes and axes[0].__name__ == "batch"}
    assert len(batch_dims) == 1  # every input's batch axis is the one Dim("batch")


def test_only_folders_with_weights_on_disk_have_safetensors():
    tiny, rand = resolve_model("tiny"), resolve_model("random:flux.1-schnell")
    spec = specs_for(tiny.geometry, ["clip"])["clip"]
    assert has_safetensors(tiny, spec) and not has_safetensors(rand, spec)
