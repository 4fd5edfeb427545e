"""quantize/calibration.py: the prompts and sizes calibration runs at, and the activation ranges it measures."""

import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.models.source import resolve_model
from fluxtrt.quantize.calibration import read_prompts, resolutions_for


def test_prompts_are_lines_and_a_bad_file_is_one_line(tmp_path):
    (tmp_path / "p.txt").write_text("a fox\n\n  a lake  \n")
    assert read_prompts(tmp_path / "p.txt") == ["a fox", "a lake"]
    (tmp_path / "e.txt").write_text("\n \n")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe\x00")
    for path, says in ((tmp_path / "e.txt", "holds no prompts"), (tmp_path / "b.txt", "not UTF-8"),
                       (tmp_path / "none.txt", "cannot read")):
        with pytest.raises(FluxtrtError, match=says):
            read_prompts(path)


@pytest.mark.parametrize("opt", [256, 512, 1024])
def test_two_sizes_the_opt_and_a_smaller_non_square_one(opt):
    geo = resolve_model("tiny").geometry
    (a, b), m = resolutions_for(geo, opt), geo.pixel_multiple
    assert a == (opt, opt) and b[0] < opt and b[0] != b[1] and all(v % m == 0 for v in (*a, *b))


@pytest.mark.slow
def test_attention_ranges_in_pytorch_are_the_graphs(fp8_attn_build):
    """fp8-attn's ranges measured on the PyTorch transformer (linear_input_ranges with attention: what `run
    --backend torch --calibration` computes the recipe from) are the ranges the build measured at the graph's
    attention MatMul inputs in ONNX Runtime (q c, k c, P, v per attention in forward order), within 1e-4
    relative, on the build's own prompts, sizes and steps (fp32 both)."""
    import json

    import onnx

    from fluxtrt.fp8 import read_qdq
    from fluxtrt.quantize.calibration import linear_input_ranges, read_prompts
    from fluxtrt.records import built_onnx

    src, folder, manifest = fp8_attn_build
    root = folder.parent
    cal = json.loads(next((root / "calibration").glob("calibration-*.json")).read_text())
    graph = onnx.load(str(built_onnx(folder, manifest.components["transformer"])), load_external_data=False)
    quantized = {n.name: n.input[0] for n in graph.graph.node if n.op_type == "QuantizeLinear"}  # Q node -> tensor
    from_graph = [[0.0] * 4 for _ in range(4)]
    for name, r in read_qdq(graph).items():
        if "attention" in r:  # the calibrated tensor each of the MatMul's two Q/DQ pairs reads
            for k in (0, 1):
                from_graph[r["attention"]][2 * r["matmul"] + k] = cal["amax"][quantized[f"{name}__in{k}__q"]]
    prompts = read_prompts(cal["prompts_file"])[: cal["prompts"]]
    _, _, ranges = linear_input_ranges(src, prompts, [tuple(s) for s in cal["sizes"]], cal["steps"], "fp32",
                                       device="cpu", attention=True)
    assert len(ranges) == len(from_graph) == 4
    for got, want in zip(ranges, from_graph):
        assert all(abs(g - w) <= 1e-4 * w for g, w in zip(got, want)), (got, want)
