"""kernels/flashinfer_fp8_attention.py without a GPU: the operands FlashInfer reads ([S, B*H, D] E4M3 codes, the
batch folded into the heads) and the output's way back to [B, S, H, D], with the kernel replaced by its arithmetic
(fp8_attention.kernel_arithmetic, blocks of 192 keys) computed on those folded operands."""

import numpy as np
import pytest
import torch

from fluxtrt import fp8
from fluxtrt.kernels import flashinfer_fp8_attention as fi
from fluxtrt.kernels import fp8_attention


def arithmetic_op(q8, k8, v8, qkv_scales):
    """The kernel faked by its arithmetic on its own [S, heads, D] operands (fp8_attention.on_codes with its walk, fp32)."""
    (sq, sk, sv), t = qkv_scales, (0, 1)
    return fp8_attention.on_codes(q8.transpose(*t), k8.transpose(*t), v8.transpose(*t), sq * sk, sv,
                                  **fi.WALK).transpose(*t)


def test_folded_operands_and_output_match_the_kernel_arithmetic(monkeypatch):
    """B 2 and 1, 3 heads, 300 tokens, d 128, fresh N(0, 1) q, k, v [B, S, H, D]: attention() through the folded
    layout equals kernel_arithmetic on the unfolded inputs within 1e-5 (fp32), and the codes are the recipe's."""
    seed = int(np.random.default_rng().integers(1 << 30))
    g = torch.Generator().manual_seed(seed)
    scales = (0.004, 0.005, 0.002, 0.006)

    monkeypatch.setattr(fi, "fa3_fp8_attention", arithmetic_op)
    for b in (2, 1):
        q, k, v = (torch.randn(b, 300, 3, 128, generator=g) for _ in range(3))
        q8, k8, v8 = fi.operands(q, k, v, scales)
        assert q8.dtype == torch.float8_e4m3fn and q8.shape == (300, b * 3, 128) and q8.is_contiguous()
        c = float(fp8.sdpa_root_scale(128))
        assert torch.equal(q8.float().view(300, b, 3, 128).transpose(0, 1) * scales[0],
                           fp8.fp8_fake_quant(q * c, scales[0])), seed
        got = fi.attention(q, k, v, scales)
        t = (1, 2)
        want = fp8_attention.kernel_arithmetic(q.transpose(*t), k.transpose(*t), v.transpose(*t), scales,
                                               **fi.WALK).transpose(*t)
        assert got.shape == q.shape and got.dtype == q.dtype
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-5, (b, err, seed)


WHY = fi.available()


def test_available_says_what_is_missing():
    """None exactly where a Hopper GPU and the flashinfer module are both here; else a line naming the missing one."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        assert WHY == "FlashInfer's FP8 attention (its FA3 template) needs a Hopper (sm90) GPU"
    else:
        try:
            import flashinfer  # noqa: F401

            assert WHY is None
        except Exception:
            assert WHY.startswith("the flashinfer module (pip flashinfer-python) does not import here")


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.parametrize("b,h,s,d", [(1, 2, 300, 128), (2, 3, 577, 128)])
def test_flashinfer_computes_the_kernels_arithmetic(b, h, s, d):
    """On the GPU: FlashInfer's output against kernel_arithmetic with its block of keys, mean relative error within
    1e-2 (its exp2, block order and bf16 output move values by rounding steps; a wrong scale or layout is O(1))."""
    from tests.kernels.test_fp8_attention import calibrated

    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    scales, _ = calibrated(q, k, v)
    t = (1, 2)
    got = fi.attention(*(x.transpose(*t).cuda().bfloat16() for x in (q, k, v)), scales).transpose(*t)
    want = fp8_attention.kernel_arithmetic(*(x.bfloat16().float() for x in (q, k, v)), scales, **fi.WALK)
    rel = float((got.float().cpu() - want).abs().mean() / want.abs().mean())
    assert rel <= 1e-2, rel


def test_the_custom_op_registers_and_traces_without_a_gpu():
    """The op torch.compile and CUDA graphs see: registered on import as fluxtrt::fa3_fp8_attention, its fake gives a bf16
    tensor of q's shape without running FlashInfer (what Inductor traces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q8 = torch.randn(64, 4, 128).to(torch.float8_e4m3fn)
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q8)
        out = torch.ops.fluxtrt.fa3_fp8_attention(fq, fq, fq, [0.5, 0.25, 2.0])
    assert out.shape == (64, 4, 128) and out.dtype == torch.bfloat16


def test_hopper_with_flashinfer_takes_it_in_the_transformer(monkeypatch, tiny_dev):
    """fp8_layers.quantize_attention on the tiny transformer (fp32, CPU), as on a Hopper GPU with flashinfer (FP8
    tensor cores and available() faked, the kernel replaced by its arithmetic; scales calibrated on the call): its
    note names FlashInfer, and one transformer call is closer to the recipe emulated (the two differ where P is
    rounded) than 0.6x the recipe's own distance from the unquantized call."""
    from fluxtrt import fp8_layers
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.quantize.calibration import recording_attention_ranges

    spec = specs_for(tiny_dev.geometry, ["transformer"])["transformer"]
    seed = int(np.random.default_rng().integers(1 << 30))
    feeds = spec.sample_inputs(ShapePoint(1, 256, 256), tiny_dev.geometry, seed)

    def call(module):
        args = [feeds[t.name] for t in spec.inputs if t.name in feeds]
        with torch.inference_mode():
            return spec.wrap(module)(*args).float()

    module = tiny_dev.load_component("transformer", torch.float32, "cpu").eval()
    ranges = recording_attention_ranges(module)  # the recipe's scales from this call, as calibration takes them
    plain = call(module)
    attention = [tuple(fp8.activation_scale(float(x)) for x in r) for r in ranges]
    fp8_layers.quantize_attention(module, attention, "cpu")
    emulated = call(module)

    monkeypatch.setattr(fp8_layers, "tensor_cores", lambda device: True)
    monkeypatch.setattr(fi, "available", lambda: None)
    monkeypatch.setattr(fi, "fa3_fp8_attention", arithmetic_op)
    module = tiny_dev.load_component("transformer", torch.float32, "cpu").eval()
    note = fp8_layers.quantize_attention(module, attention, "cpu")
    assert note == ("attention in E4M3 on FP8 tensor cores in 4 attentions (FlashInfer's FA3 FP8 kernel; q and k of 2 "
                    "single blocks normed, rotated and quantized in one Triton kernel each)"), note
    kernel = call(module)
    rel = lambda a, b: float((a - b).abs().mean() / b.abs().mean())  # noqa: E731
    # seen: kernel vs recipe 2.6e-4 to 3.1e-4, recipe vs unquantized 6.9e-4 to 8.2e-4 (ratio 0.38-0.39)
    assert 0 < rel(kernel, emulated) <= 0.6 * rel(emulated, plain), (seed, rel(kernel, emulated), rel(emulated, plain))


def test_the_transformer_on_flashinfer_compiles_without_graph_breaks(monkeypatch, tiny_dev):
    """torch.compile takes the tiny transformer with fp8-attn on FlashInfer (Hopper faked; the real custom op, given a
    CPU kernel: its arithmetic in bf16) as one graph (dynamo.explain; fullgraph=True let these breaks pass): a
    break (a Tensor.item() per attention, or the op registered inside the trace) left the H100's compiled step at
    201 ms against diffusers' 180, eager elementwise kernels between compiled pieces. The compiled call equals the
    eager one within 1e-3."""
    import torch._dynamo as dynamo

    from fluxtrt import fp8_layers
    from fluxtrt.components import ShapePoint, specs_for

    if "cpu" not in fi.fa3_fp8_attention._backend_fns:
        fi.fa3_fp8_attention.register_kernel("cpu")(lambda q8, k8, v8, s: arithmetic_op(q8, k8, v8, s).bfloat16().contiguous())
    monkeypatch.setattr(fp8_layers, "tensor_cores", lambda device: True)
    monkeypatch.setattr(fi, "available", lambda: None)
    spec = specs_for(tiny_dev.geometry, ["transformer"])["transformer"]
    seed = int(np.random.default_rng().integers(1 << 30))
    feeds = spec.sample_inputs(ShapePoint(1, 256, 256), tiny_dev.geometry, seed)
    args = [feeds[t.name] for t in spec.inputs if t.name in feeds]
    module = tiny_dev.load_component("transformer", torch.float32, "cpu").eval()
    scales = [tuple(float(x) for x in torch.empty(4).uniform_(0.002, 0.02)) for _ in range(4)]
    assert "FlashInfer" in fp8_layers.quantize_attention(module, scales, "cpu")
    wrapped = spec.wrap(module)
    with torch.inference_mode():
        eager = wrapped(*args).float()
        explained = dynamo.explain(wrapped)(*args)
        compiled = torch.compile(wrapped, backend="aot_eager")(*args).float()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]
    assert float((compiled - eager).abs().max() / eager.abs().max()) <= 1e-3, seed


def fake_flashinfer(monkeypatch, tmp_path, version="0.7.4"):
    """A stand-in for the flashinfer package's surface that ship_module and use_shipped reach (its JIT spec, the
    prebuilt-module folder, the module cache keyed on single_prefill's arguments): [args of each module load, with
    the prebuilt folder FlashInfer would look in at that moment], the jit env, and the module's bytes."""
    import sys
    import types

    so = np.random.default_rng().integers(0, 255, 4096).astype(np.uint8).tobytes()
    built = tmp_path / "jit-cache" / "single_prefill_fa3_e4m3" / "single_prefill_fa3_e4m3.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(so)
    env = types.SimpleNamespace(FLASHINFER_AOT_DIR=tmp_path / "package-data-aot")
    loads = []

    class Spec:
        name = "single_prefill_fa3_e4m3"

        def __init__(self, backend, *args):
            self.args = (backend, *args)

        def build_and_load(self):
            loads.append((self.args, None))

        def get_library_path(self):
            return built

    def get_single_prefill_module(backend, *args):
        loads.append(((backend, *args), env.FLASHINFER_AOT_DIR))

    top, jit, prefill = (types.ModuleType(n) for n in ("flashinfer", "flashinfer.jit", "flashinfer.prefill"))
    top.__version__, top.jit, top.prefill = version, jit, prefill
    jit.gen_single_prefill_module, jit.env = Spec, env
    prefill.get_single_prefill_module = get_single_prefill_module
    for module in (top, jit, prefill):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.env", env)
    return loads, env, so


def test_a_package_ships_flashinfers_module_and_the_runtime_loads_it_from_there(monkeypatch, tmp_path, caplog):
    """ship_module copies the compiled module into the engine folder as FlashInfer lays out prebuilt modules and
    records it (sha256, version, head dim); use_shipped points FlashInfer's prebuilt folder at it for exactly the
    load (restored after), with the op's arguments, once per process (later calls touch no file); another flashinfer
    version is one warning and no load; a changed file is one line. (flashinfer faked: the real one needs a Hopper
    GPU, the GPU test below.)"""
    import hashlib

    from fluxtrt.errors import ManifestError

    loads, env, so = fake_flashinfer(monkeypatch, tmp_path)
    folder, d = tmp_path / "h100-torch", int(np.random.default_rng().choice([64, 128]))
    record = fi.ship_module(folder, d)
    want_args = ("fa3", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, d, d, 0, False, False, False, False)
    assert loads == [(want_args, None)]
    assert record == {"file": "flashinfer/single_prefill_fa3_e4m3/single_prefill_fa3_e4m3.so",
                      "sha256": hashlib.sha256(so).hexdigest(), "flashinfer": "0.7.4", "head_dim": d}
    assert (folder / record["file"]).read_bytes() == so

    saved = env.FLASHINFER_AOT_DIR
    assert fi.use_shipped(folder, record, "transformer") is True
    assert loads[-1] == (want_args, folder / "flashinfer") and env.FLASHINFER_AOT_DIR == saved
    moved = (folder / record["file"]).rename(tmp_path / "moved.so")  # loaded: the next activation reads no file
    assert fi.use_shipped(folder, record, "transformer") is True and len(loads) == 2
    moved.rename(folder / record["file"])

    with caplog.at_level("WARNING", logger="fluxtrt"):
        assert fi.use_shipped(folder, {**record, "flashinfer": "0.6.0"}, "transformer") is False
    assert len(loads) == 2 and "compiled by flashinfer 0.6.0 and this machine has 0.7.4" in caplog.text

    monkeypatch.setattr(fi, "_LOADED", set())  # a fresh process
    (folder / record["file"]).write_bytes(so[:-1] + bytes([so[-1] ^ 1]))
    with pytest.raises(ManifestError, match=r"^transformer: flashinfer/.*\.so is not the FlashInfer kernel module "
                       r"the manifest records \(missing, or its sha256 differs\)"):
        fi.use_shipped(folder, record, "transformer")
    assert len(loads) == 2


SHIPPED_CHILD = """import pathlib, sys, json, torch
from fluxtrt.kernels import flashinfer_fp8_attention as fi
folder, record = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2])
assert fi.use_shipped(folder, record, "transformer")
q8, k8, v8 = (torch.randn(256, 2, 128, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
print(float(fi.fa3_fp8_attention(q8, k8, v8, [0.01, 0.01, 0.01]).float().abs().mean()))
"""


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_the_shipped_module_runs_in_a_fresh_process_without_compiling(tmp_path):
    """On Hopper with flashinfer: the module ship_module copied runs the op in a fresh process whose FlashInfer
    cache is empty and whose JIT is off (FLASHINFER_DISABLE_JIT: a module not found prebuilt is an error)."""
    import json
    import os
    import subprocess
    import sys

    record = fi.ship_module(tmp_path / "gpu", 128)
    env = {**os.environ, "FLASHINFER_DISABLE_JIT": "1", "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "empty")}
    res = subprocess.run([sys.executable, "-c", SHIPPED_CHILD, str(tmp_path / "gpu"), json.dumps(record)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout.strip().splitlines()[-1]) > 0


def test_single_stream_blocks_take_the_fused_norm_rope_quantize_with_the_same_arithmetic(monkeypatch, tiny_dev):
    """fp8-attn on FlashInfer (Hopper faked, the kernel replaced by its arithmetic), tiny in bf16 on fresh inputs: each
    single-stream block's q and k go through fluxtrt::norm_rope_quantize (one call each), double-stream blocks keep
    the processor's path, and the transformer's output equals the one with the single blocks on the processor's
    RMSNorm -> RoPE -> operands() path exactly (on a CPU the op computes that same arithmetic)."""
    from fluxtrt import fp8_layers
    from fluxtrt.components import ShapePoint, specs_for
    from fluxtrt.kernels import norm_rope_quantize as nrq

    monkeypatch.setattr(fp8_layers, "tensor_cores", lambda device: True)
    monkeypatch.setattr(fi, "available", lambda: None)
    monkeypatch.setattr(fi, "fa3_fp8_attention", lambda q8, k8, v8, s: arithmetic_op(q8, k8, v8, s).bfloat16())
    calls = []
    op = nrq.norm_rope_quantize
    monkeypatch.setattr(nrq, "norm_rope_quantize", lambda *a: calls.append(a[0].shape) or op(*a))
    spec = specs_for(tiny_dev.geometry, ["transformer"])["transformer"]
    seed = int(np.random.default_rng().integers(1 << 30))
    feeds = spec.sample_inputs(ShapePoint(2, 256, 256), tiny_dev.geometry, seed)
    args = [feeds[t.name].bfloat16() if feeds[t.name].is_floating_point() else feeds[t.name]
            for t in spec.inputs if t.name in feeds]
    scales = [tuple(float(x) for x in torch.empty(4).uniform_(0.01, 0.05)) for _ in range(4)]
    outs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(fp8_layers, "single_stream_fn", lambda fa3, scales: None)
        module = tiny_dev.load_component("transformer", torch.bfloat16, "cpu").eval()
        fp8_layers.quantize_attention(module, scales, "cpu")
        with torch.inference_mode():
            outs[fused] = spec.wrap(module)(*args).float()
        if fused:
            singles = len(module.single_transformer_blocks)
            assert len(calls) == 2 * singles and singles > 0, calls
    assert len(calls) == 2 * singles  # none with the processor's path
    assert torch.equal(outs[True], outs[False]) and outs[True].std() > 0, seed
