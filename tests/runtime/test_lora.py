"""runtime/lora.py: a transformer LoRA read and checked as it loads; stacked LoRAs on the PyTorch transformer,
merged or beside its (joined, fp8) GEMMs, against merged weights (on engines against a pre-merged checkpoint:
tests/core/test_refit.py, where the engines are built)."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fluxtrt.errors import FluxtrtError
from fluxtrt.runtime.lora import Lora, LoraFile, LoraRef

MODULE = "transformer_blocks.0.attn.to_q"


def lora_file(path, rng, rank=2, out_f=12, in_f=8, alpha=4.0):
    tensors = {f"transformer.{MODULE}.lora_A.weight": torch.from_numpy(rng.standard_normal((rank, in_f), np.float32)),
               f"transformer.{MODULE}.lora_B.weight": torch.from_numpy(rng.standard_normal((out_f, rank), np.float32)),
               f"transformer.{MODULE}.alpha": torch.tensor(alpha)}
    save_file(tensors, path)
    return tensors


def test_the_delta_is_scale_alpha_over_rank_b_a(tmp_path):
    rng = np.random.default_rng()
    t = lora_file(tmp_path / "l.safetensors", rng)
    lora = Lora([LoraRef(tmp_path / "l.safetensors", 0.7)])
    want = 0.7 * (4.0 / 2) * (t[f"transformer.{MODULE}.lora_B.weight"] @ t[f"transformer.{MODULE}.lora_A.weight"])
    assert np.allclose(lora.deltas[f"{MODULE}.weight"], want.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("part", ["lora_A.weight", "lora_B.weight", "alpha"])
def test_a_non_finite_lora_is_named_when_it_loads(tmp_path, part):
    rng = np.random.default_rng()
    t = lora_file(tmp_path / "l.safetensors", rng)
    bad = t[f"transformer.{MODULE}.{part}"].clone().reshape(-1)
    bad[rng.integers(bad.numel())] = float("nan")
    t[f"transformer.{MODULE}.{part}"] = bad.reshape(t[f"transformer.{MODULE}.{part}"].shape)
    save_file(t, tmp_path / "nan.safetensors")
    with pytest.raises(FluxtrtError, match=f"nan.safetensors: tensor {MODULE}.{part} holds NaN or Inf"):
        Lora([LoraRef(tmp_path / "nan.safetensors")])


# layers of the tiny transformer a LoRA reaches through each kind of host once projections are joined: q/k of a
# double block's to_qkv, v of its to_added_qkv, v and the MLP input of a single block's proj_qkv_mlp, and layers
# that stay alone
STACKED = (("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.add_v_proj",
            "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp",
            "transformer_blocks.0.ff.net.0.proj"),
           ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_out", "proj_out"))


def random_loras(raw, folder, std=0.2):
    """Two LoRAs (ranks 2 and 3, fresh random factors) over STACKED's layers of `raw`, both on one layer; with
    scales 0.8 and -0.5 as LoraRefs."""
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    refs = []
    for i, (modules, rank, scale) in enumerate(zip(STACKED, (2, 3), (0.8, -0.5))):
        tensors = {}
        for m in modules:
            lin = raw.get_submodule(m)
            tensors[f"transformer.{m}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) * std
            tensors[f"transformer.{m}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * std
            tensors[f"transformer.{m}.alpha"] = torch.tensor(float(rank + 1))
        save_file(tensors, folder / f"l{i}.safetensors")
        refs.append(LoraRef(folder / f"l{i}.safetensors", scale))
    return refs


def test_stacked_loras_beside_joined_and_fp8_gemms_equal_merged_weights(tiny_bf16, tmp_path):
    """fp32, fresh inputs: the low-rank terms beside the joined GEMMs (their rows found from what
    fuse_projections recorded) compute what the merged weights compute; on the fp8 recipe, the terms beside the
    E4M3 GEMMs (torch._scaled_mm, joined) equal them beside the emulated recipe (unjoined), and move the output
    as much as the LoRAs do in fp32."""
    from fluxtrt import fp8, fp8_layers
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.runtime import lora

    src = tiny_bf16
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    feeds = spec.sample_inputs(ShapePoint(2, 128, 192), src.geometry, int(np.random.default_rng().integers(1 << 30)))
    args = [feeds[t.name] for t in spec.inputs if t.name in feeds]
    load = lambda: src.load_component("transformer", torch.float32, "cpu").eval()  # noqa: E731
    raw = load()
    loras = lora.read_loras(random_loras(raw, tmp_path))

    def run(module):
        with torch.inference_mode():
            return spec.wrap(module)(*args).float()

    plain = run(raw)
    assert lora.merge_into(raw, loras) == 8
    merged = run(raw)
    raw = load()
    plan = lora.side_path_plan(raw, loras)
    assert fp8_layers.fuse_projections(raw) == 2 * raw.config.num_layers + raw.config.num_single_layers
    assert lora.add_side_paths(raw, plan, torch.float32) == 6  # to_qkv, to_added_qkv, proj_qkv_mlp, 3 alone
    beside = run(raw)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    assert rel(merged, plain) > 0.01, rel(merged, plain)  # the LoRAs matter (1000x the bound below)
    assert rel(beside, merged) <= 1e-5, rel(beside, merged)
    groups = fp8.linear_groups(spec.wrap(load()), args, root=load())
    amax = {m: float(np.random.default_rng().uniform(2.0, 8.0)) for group in groups for m in group}
    scales = fp8.scales_from_calibration(load(), amax, groups)
    outs = {}
    for mode in ("emulated", "scaled_mm", "base"):
        raw = load()
        plan = lora.side_path_plan(raw, loras)
        fp8_layers.quantize_module(raw, scales, "cpu", scaled_mm=mode == "scaled_mm")
        if mode != "base":
            lora.add_side_paths(raw, plan, torch.float32)
        outs[mode] = run(raw)
    assert rel(outs["scaled_mm"], outs["emulated"]) <= 1e-4, rel(outs["scaled_mm"], outs["emulated"])
    assert rel(outs["emulated"], outs["base"]) > 0.5 * rel(merged, plain)


def test_a_lora_for_other_layers_or_shapes_is_one_line(tiny_bf16, tmp_path):
    from fluxtrt.runtime import lora

    raw = tiny_bf16.load_component("transformer", torch.float32, "cpu")
    for name, a, b in (("transformer_blocks.0.attn.nothing", (2, 8), (12, 2)),
                       ("transformer_blocks.0.attn.to_q", (2, 7), (5, 2))):
        save_file({f"transformer.{name}.lora_A.weight": torch.randn(*a), f"transformer.{name}.lora_B.weight": torch.randn(*b)},
                  tmp_path / "x.safetensors")
        loras = lora.read_loras([LoraRef(tmp_path / "x.safetensors")])
        for apply in (lora.merge_into, lora.side_path_plan):
            with pytest.raises(FluxtrtError, match="does not have as a linear layer|the LoRA is for another model"):
                apply(raw, loras)


def test_stacked_loras_on_the_pytorch_transformer_equal_a_merged_checkpoint(tmp_path):
    """`run --backend torch --lora A:0.8 --lora B:-0.5` (fp32, CPU): the image equals the one from a model folder
    whose transformer has both LoRAs merged in beforehand within 2/255, and differs from the plain one."""
    import shutil

    from safetensors.torch import load_file

    from fluxtrt.models.source import resolve_model
    from fluxtrt.runtime.assembly import open_pipeline

    src = resolve_model("tiny")
    stored = {}
    for f in (src.path / "transformer").glob("*.safetensors"):
        stored.update(load_file(f))
    raw = src.load_component("transformer", torch.float32, "cpu")
    refs = random_loras(raw, tmp_path, std=0.3)
    for ref in refs:
        lf = load_file(ref.path)
        for key in lf:
            if key.endswith(".lora_A.weight"):
                m = key[len("transformer."):-len(".lora_A.weight")]
                a, b = lf[key], lf[f"transformer.{m}.lora_B.weight"]
                stored[f"{m}.weight"] = stored[f"{m}.weight"] + ref.scale * float(lf[f"transformer.{m}.alpha"]) / \
                    a.shape[0] * (b @ a)
    merged = tmp_path / "merged"
    shutil.copytree(src.path, merged)
    for f in (merged / "transformer").glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in stored.items()}, merged / "transformer" / "diffusion_pytorch_model.safetensors")

    def image(model, **options):
        pipe = open_pipeline(model=model, backend="torch", torch_dtype="fp32", device="cpu", **options)
        return pipe.generate(["a red fox in the snow"], 256, 256, 3, 3.5, seed=5).images.astype(int), pipe

    with_loras, pipe = image(src.path, lora=[f"{refs[0].path}:0.8", f"{refs[1].path}:-0.5"])
    premerged, _ = image(merged)
    plain, _ = image(src.path)
    assert np.abs(with_loras - premerged).max() <= 2
    assert np.abs(with_loras - plain).max() > 10
    assert pipe.executors["transformer"].lora_note == "LoRA merged into 8 linear layers"


def test_one_batch_mixes_adapters_on_joined_gemms_as_merged_weights_would(tiny_bf16, tmp_path):
    """LoraBank on the joined projections (fp32): a batch of three samples, one without LoRA, one with l0, one
    with l0 and l1 stacked (scales 0.8, -0.5), in one call: each sample's output equals its own merged module's
    within 1e-5; after the call the layers compute the base again."""
    from fluxtrt import fp8_layers
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.runtime import lora

    src = tiny_bf16
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    feeds = spec.sample_inputs(ShapePoint(3, 128, 128), src.geometry, int(np.random.default_rng().integers(1 << 30)))
    args = [feeds[t.name] for t in spec.inputs if t.name in feeds]
    load = lambda: src.load_component("transformer", torch.float32, "cpu").eval()  # noqa: E731
    refs = random_loras(load(), tmp_path)
    raw = load()
    fp8_layers.fuse_projections(raw)
    bank = lora.LoraBank(tmp_path, cache_bytes=1 << 30)
    assert bank.attach(raw, torch.float32) >= lora.MAX_STACK and len(bank.hosts) == 6
    # a joined host stores and adds only the columns its files touch: q, k of to_qkv; v of to_added_qkv; v and
    # the MLP of proj_qkv_mlp (the last part); every column of a layer that stays alone
    spans = {h: (m.lo, m.hi, m.out_features, m.up.shape[-1]) for h, m in bank.hosts.items()}
    d = src.geometry.transformer_dim
    assert spans["transformer_blocks.0.attn.to_qkv"] == (0, 2 * d, 3 * d, 2 * d), spans
    assert spans["transformer_blocks.0.attn.to_added_qkv"] == (2 * d, 3 * d, 3 * d, d), spans
    lo, hi, out, width = spans["single_transformer_blocks.0.proj_qkv_mlp"]
    assert (lo, hi, width) == (2 * d, out, out - 2 * d), spans
    for name in ("l0", "l1"):
        bank.check(name)
    stacks = [[], [("l0", 0.8)], [("l0", 0.8), ("l1", -0.5)]]
    bank.use([bank.acquire(s) if s else [] for s in stacks])
    with torch.inference_mode():
        mixed = spec.wrap(raw)(*args).float()
        bank.use(None)
        base = spec.wrap(raw)(*args).float()
    for i, stack in enumerate(stacks):
        own = load()
        lora.merge_into(own, lora.read_loras([LoraRef(refs[int(n[1])].path, s) for n, s in stack]))
        with torch.inference_mode():
            want = spec.wrap(own)(*[a[i:i + 1] if a.shape[0] == 3 else a for a in args]).float()
        got = mixed[i:i + 1]
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5, i
        if stack:
            assert float((got - base[i:i + 1]).abs().max() / want.abs().max()) > 0.01  # 1000x the bound
    assert float((base[0:1] - mixed[0:1]).abs().max()) == 0


def test_a_compiled_transformer_keeps_three_forms_per_batch_size_whatever_the_adapters(tiny_bf16, tmp_path):
    """torch.compile (static shapes, dynamo with a counting backend) over the tiny transformer serving a LoraBank
    (fp32): batches of 2 and 4 without LoRA, with one adapter per sample and with a stack compile 3 forms each;
    then other slots, scales, samples without LoRA and padding rows (fewer samples than the batch) compile nothing
    new (dynamo's default limit is 8 forms: past it a server ran eagerly, 0.36x on the H100), and every output
    equals the eager module's within 1e-5."""
    import torch._dynamo

    from fluxtrt import fp8_layers
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.runtime import lora

    src = tiny_bf16
    spec = specs_for(src.geometry, ["transformer"])["transformer"]
    random_loras(src.load_component("transformer", torch.float32, "cpu"), tmp_path)
    raw = src.load_component("transformer", torch.float32, "cpu").eval()
    fp8_layers.fuse_projections(raw)
    bank = lora.LoraBank(tmp_path, cache_bytes=1 << 30, rows=4)
    bank.attach(raw, torch.float32)
    for name in ("l0", "l1"):
        bank.check(name)
    module = spec.wrap(raw)
    forms = []

    def counting(gm, example_inputs):
        forms.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(module, backend=counting, dynamic=False)
    rng = np.random.default_rng()

    def call(n, stacks):
        feeds = spec.sample_inputs(ShapePoint(n, 128, 128), src.geometry, int(rng.integers(1 << 30)))
        args = [feeds[t.name] for t in spec.inputs if t.name in feeds]
        slots = [bank.acquire(s) if s else [] for s in stacks or ()]
        bank.use(slots if stacks is not None else None)
        try:
            with torch.inference_mode():
                got, want = fn(*args).float(), module(*args).float()
        finally:
            bank.use(None)
            bank.release([x for s in slots for x in s])
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5

    a, b = ("l0", float(rng.uniform(0.5, 1.5))), ("l1", float(rng.uniform(-1.5, -0.5)))
    for n in (2, 4):
        call(n, None)
        call(n, [[a]] * n)
        call(n, [[a, b]] + [[b]] * (n - 1))
    first = len(forms)
    for n in (2, 4):
        call(n, [[b], []] + [[a]] * (n - 2))  # other slots, a sample without LoRA
        call(n, [[b]])  # padding rows: one sample in a batch of n
        call(n, [[], [b, a]])
        call(n, [[]] * n)  # no sample has a LoRA: the base form
    assert len(forms) == first, (first, len(forms))
    assert 6 <= first <= 6 * 2  # 3 forms per batch size (a graph break may split a form in two)


def test_a_kohya_flux_lora_reads_as_the_diffusers_layers_it_holds(tmp_path):
    """kohya's FLUX format (BFL layer names; joined q/k/v and a single block's linear1 split by rows; the final
    modulation's halves swapped): each diffusers layer gets its rows of the up matrix and the shared down matrix,
    and the whole file merges into the tiny transformer."""
    from fluxtrt.models.source import resolve_model
    from fluxtrt.runtime import lora

    raw = resolve_model("tiny").load_component("transformer", torch.float32, "cpu")
    h = raw.config.num_attention_heads * raw.config.attention_head_dim
    mlp = raw.get_submodule("single_transformer_blocks.0.proj_mlp").out_features
    norm_out = raw.get_submodule("norm_out.linear").out_features
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    layers = {"double_blocks_0_img_attn_qkv": 3 * h, "double_blocks_0_txt_attn_proj": h,
              "single_blocks_0_linear1": 3 * h + mlp, "final_layer_adaLN_modulation_1": norm_out}
    in_of = {"double_blocks_0_img_attn_qkv": h, "double_blocks_0_txt_attn_proj": h, "single_blocks_0_linear1": h,
             "final_layer_adaLN_modulation_1": raw.get_submodule("norm_out.linear").in_features}
    tensors = {}
    for name, rows in layers.items():
        tensors[f"lora_unet_{name}.lora_down.weight"] = torch.randn(2, in_of[name], generator=g)
        tensors[f"lora_unet_{name}.lora_up.weight"] = torch.randn(rows, 2, generator=g)
        tensors[f"lora_unet_{name}.alpha"] = torch.tensor(1.0)
    save_file(tensors, tmp_path / "k.safetensors")
    f = lora.LoraFile(tmp_path / "k.safetensors")
    up = lambda name: tensors[f"lora_unet_{name}.lora_up.weight"].numpy()  # noqa: E731
    want = {"transformer_blocks.0.attn.to_k": up("double_blocks_0_img_attn_qkv")[h:2 * h],
            "transformer_blocks.0.attn.to_add_out": up("double_blocks_0_txt_attn_proj"),
            "single_transformer_blocks.0.attn.to_v": up("single_blocks_0_linear1")[2 * h:3 * h],
            "single_transformer_blocks.0.proj_mlp": up("single_blocks_0_linear1")[3 * h:],
            "norm_out.linear": np.concatenate([up("final_layer_adaLN_modulation_1")[norm_out // 2:],
                                               up("final_layer_adaLN_modulation_1")[:norm_out // 2]])}
    assert len(f.factors) == 3 + 1 + 4 + 1
    for layer, b in want.items():
        assert np.array_equal(f.factors[layer][1], b) and f.factors[layer][2] == 0.5, layer
    assert lora.merge_into(raw, [(f, 1.0)]) == 9
    save_file({"lora_unet_double_blocks_0_nothing.lora_down.weight": torch.randn(2, h),
               "lora_unet_double_blocks_0_nothing.lora_up.weight": torch.randn(h, 2)}, tmp_path / "bad.safetensors")
    with pytest.raises(FluxtrtError, match="lora_unet_double_blocks_0_nothing is not a FLUX transformer layer"):
        lora.LoraFile(tmp_path / "bad.safetensors")


def test_merging_into_a_packages_weights_refuses_e4m3(tmp_path):
    """A package's fp8 weights are as the recipe quantized them: merging a LoRA there is one line, not a silent
    requantization; an fp32 weight gets scale * alpha/r * B @ A."""
    from fluxtrt.runtime.lora import merge_into_constants

    rng = np.random.default_rng()
    lora_file(tmp_path / "x.safetensors", rng)
    lf = LoraFile(tmp_path / "x.safetensors")
    (name, (a, b, s)), = lf.factors.items()
    w = torch.randn(b.shape[0], a.shape[1])
    weights = {f"model.{name}.weight": w.clone()}
    assert merge_into_constants(weights, [(lf, 0.5)], "transformer") == 1
    want = w + 0.5 * s * torch.from_numpy(b) @ torch.from_numpy(a)
    assert torch.allclose(weights[f"model.{name}.weight"], want, atol=1e-6)
    with pytest.raises(FluxtrtError, match="--lora on transformer's fp8 package: its weights are E4M3"):
        merge_into_constants({f"model.{name}.weight": w.to(torch.float8_e4m3fn)}, [(lf, 1.0)], "transformer")
