"""The TensorRT executor and refit against a strict stand-in of TensorRT's runtime (tests/fake_trt.py): one test
per point of the audit (issue #23). No GPU runs an engine here; the stand-in enforces the documented contracts,
and every name it provides exists in the real tensorrt_rtx API (first test)."""

import gc
import inspect

import numpy as np
import pytest
import torch

trt_real = pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")

from fluxtrt.errors import FluxtrtError  # noqa: E402
from fluxtrt.runtime.executors import ShapeError  # noqa: E402
from fluxtrt.runtime.tensorrt import SharedActivations, TensorRTExecutor  # noqa: E402
from tests import fake_trt  # noqa: E402
from tests.helpers import entry as make_entry  # noqa: E402

PROFILE = {"hidden_states": [[1, 4, 8], [1, 16, 8], [2, 64, 8]], "timestep": [[1], [1], [2]]}
INPUTS = [{"name": "hidden_states", "dtype": "float", "shape": [-1, -1, 8]},
          {"name": "timestep", "dtype": "float", "shape": [-1]}]
OUTPUTS = [{"name": "noise_pred", "dtype": "float", "shape": [-1, -1, 8], "like": "hidden_states"}]


@pytest.fixture(autouse=True)
def _reset_stats():
    fake_trt.STATS.update(deserialized=0, refits=0)


def make_executor(tmp_path, flavour="rtx", shared=True, weights=None, stripped=False, refit=None, refittable=None,
                  build_weights=None, pad=0, **kw):
    path = fake_trt.write_plan(tmp_path / "transformer.engine", INPUTS, OUTPUTS, PROFILE, refit=refit,
                               refittable=refittable, build_weights=build_weights, stripped=stripped, pad=pad)
    from fluxtrt.fileio import sha256_file

    e = make_entry(engine=path.name, sha256=sha256_file(path), bytes=path.stat().st_size, inputs=INPUTS,
                   outputs=[{k: v for k, v in o.items() if k != "like"} for o in OUTPUTS],
                   profile={k: {"min": v[0], "opt": v[1], "max": v[2]} for k, v in PROFILE.items()},
                   weightless=stripped)
    backend = fake_trt.Backend(flavour)
    streams = fake_trt.Streams()
    ex = TensorRTExecutor("transformer", e, path, backend, stream="s1",
                          shared_memory=SharedActivations("cpu") if shared else None, weights=weights,
                          streams=streams, **kw)
    return ex, backend, streams


def feeds(batch=1, tokens=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(batch, tokens, 8, generator=g), "timestep": torch.rand(batch, generator=g)}


def test_the_stand_in_uses_only_real_api_names():
    """Every public method or attribute a fake class defines exists on the real tensorrt_rtx class it mirrors,
    and what fluxtrt reads of a weights prototype (dtype, size) is on the real trt.Weights."""
    assert fake_trt.MIRRORS
    for fake, real in fake_trt.MIRRORS.items():
        names = {n for n, _ in inspect.getmembers(fake) if not n.startswith("_")}
        missing = sorted(n for n in names if not hasattr(real, n))
        assert not missing, f"{fake.__name__} defines {missing}, which {real.__name__} does not have"
    for attr in ("dtype", "size"):
        assert hasattr(trt_real.Weights, attr)
    for name in ("Runtime", "Refitter", "IStreamReaderV2", "SeekPosition", "TensorLocation", "DataType",
                 "ExecutionContextAllocationStrategy", "CudaGraphStrategy", "DynamicShapesKernelSpecializationStrategy"):
        assert hasattr(trt_real, name), name


def test_runs_and_copies_through_aligned_buffers(tmp_path):
    ex, backend, streams = make_executor(tmp_path)
    f = feeds()
    out = ex.infer(f)["noise_pred"]
    assert torch.equal(out, f["hidden_states"])  # the stand-in copies the input's bytes: data went through
    run = ex.context.executions[-1]
    assert all(addr % 256 == 0 for addr in run["addresses"].values())


# 1 -------------------------------------------------------------------------------------------------------
def test_weightless_engines_are_built_for_refit_with_other_weights(tmp_path):
    """REFIT, not REFIT_IDENTICAL: the stand-in refuses to refit a REFIT_IDENTICAL engine with other weights
    (the audit's point 1), and the flags fluxtrt builds weightless engines with allow it."""
    from fluxtrt.engine.build import builder_flags

    flags = builder_flags(trt_real, weight_streaming=True, weightless=True)
    assert trt_real.BuilderFlag.REFIT in flags and trt_real.BuilderFlag.STRIP_PLAN in flags
    assert trt_real.BuilderFlag.REFIT_IDENTICAL not in flags and trt_real.BuilderFlag.WEIGHT_STREAMING in flags
    assert builder_flags(trt_real, False, False) == []
    mode = "refit" if trt_real.BuilderFlag.REFIT in flags else "identical"
    weights = _source({"w": np.full(4, 2.0, np.float32)})
    for refit_mode, ok in ((mode, True), ("identical", False)):  # the old flags: refused with other weights
        ex, _, _ = make_executor(tmp_path, weights=weights, stripped=True, refit=refit_mode,
                                 refittable={"w": ["FLOAT", 4]}, build_weights={"w": [1.0] * 4})
        if ok:
            ex.activate()
            assert ex.engine.current["w"] == [2.0] * 4
        else:
            with pytest.raises(FluxtrtError, match="could not refit .*REFIT_IDENTICAL engine refitted with other"):
                ex.activate()


# 2 -------------------------------------------------------------------------------------------------------
def test_cuda_graph_on_full_tensorrt_is_captured_by_the_pipeline(tmp_path):
    """Full TensorRT's runtime config has no cuda_graph_strategy: no AttributeError, and the pipeline captures
    the step itself (CudaGraphStep); TensorRT-RTX is asked for whole-graph capture."""
    from fluxtrt.runtime.steps import captures_step_itself

    ex, _, _ = make_executor(tmp_path, flavour="trt", cuda_graph=True)
    ex.activate()
    assert not ex.native_cuda_graph and captures_step_itself(ex)
    ex.infer(feeds())
    ex, _, _ = make_executor(tmp_path, flavour="rtx", cuda_graph=True)
    ex.activate()
    assert ex.native_cuda_graph and not captures_step_itself(ex)
    assert ex.runtime_config.cuda_graph_strategy == trt_real.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE


# 3 -------------------------------------------------------------------------------------------------------
def test_misaligned_inputs_are_copied_not_bound(tmp_path):
    """Batch 1 with a timestep table: t_in[i].expand(1) is a stride-0 view 4*i bytes into the table. Bound as is,
    the stand-in refuses it (as setTensorAddress does); the executor binds an aligned copy."""
    ex, _, _ = make_executor(tmp_path)
    ex.activate()
    table = torch.rand(8)
    view = table[3].expand(1)
    assert view.data_ptr() % 256 != 0
    assert ex.context.set_tensor_address("timestep", view.data_ptr()) is False  # the contract, enforced
    f = {"hidden_states": torch.randn(1, 16, 8), "timestep": view}
    ex.infer(f)
    bound = ex.context.executions[-1]["addresses"]["timestep"]
    assert bound % 256 == 0 and bound != view.data_ptr()


# 4 -------------------------------------------------------------------------------------------------------
def test_refused_shapes_and_unresolved_outputs_are_errors(tmp_path):
    ex, backend, _ = make_executor(tmp_path)
    ex.activate()
    with pytest.raises(ShapeError, match="refused shape \\[1, 128, 8\\] for input hidden_states.*outside the profile"):
        ex.infer({"hidden_states": torch.randn(1, 128, 8), "timestep": torch.rand(1)})
    ex.infer(feeds())
    calls = [c for c, _ in ex.context.calls]
    assert calls.index("infer_shapes") < calls.index("get_tensor_shape")  # outputs sized after inference
    ex.context.inferred = False  # a context that never inferred reports -1 dims: refused, not allocated
    ex._outputs.clear()
    ex.context.infer_shapes = lambda: []
    with pytest.raises(FluxtrtError, match="unresolved shape"):
        ex.infer(feeds())


# 5 -------------------------------------------------------------------------------------------------------
def test_runtime_config_lives_as_long_as_the_context(tmp_path):
    ex, _, _ = make_executor(tmp_path)
    ex.activate()
    gc.collect()
    assert ex.runtime_config is not None
    ex.infer(feeds())  # the stand-in fails execution once the context's runtime config is gone
    ex.runtime_config = None
    gc.collect()
    ex._outputs.clear()
    with pytest.raises(FluxtrtError, match="IRuntimeConfig of this context was destroyed"):
        ex.infer(feeds())


# 6 -------------------------------------------------------------------------------------------------------
class _source:
    """A WeightSource stand-in: the weight map's arrays and the weight-free ONNX's constants."""

    def __init__(self, arrays, constants=None):
        self._arrays, self._constants, self.calls = arrays, constants or {}, 0

    def arrays(self):
        self.calls += 1
        return self._arrays

    def graph_constants(self):
        return self._constants


def test_refit_fills_missing_weights_and_converts_dtypes(tmp_path):
    """With STRIP_PLAN every refittable weight is stripped, graph constants and unnamed ones included: what the
    map lacks comes from the weight-free ONNX; dtypes follow get_weights_prototype; the rest is named."""
    refittable = {"w": ["BF16", 4], "rope_table": ["FLOAT", 2], "": ["FLOAT", 1]}
    src = _source({"w": np.arange(4, dtype=np.float32)}, {"rope_table": np.ones(2, np.float32), "": np.zeros(1)})
    ex, _, _ = make_executor(tmp_path, weights=src, stripped=True, refit="refit", refittable=refittable)
    ex.activate()
    assert ex.engine.refitted and set(ex.engine.current) == {"w", "rope_table", ""}
    src = _source({"w": np.arange(4, dtype=np.float32)}, {})
    ex, backend, _ = make_executor(tmp_path, weights=src, stripped=True, refit="refit", refittable=refittable)
    with pytest.raises(FluxtrtError, match="still needs weights .*rope_table, <unnamed>"):
        ex.activate()
    src = _source({"w": np.arange(5, dtype=np.float32)}, {"rope_table": np.ones(2), "": np.zeros(1)})
    ex, _, _ = make_executor(tmp_path, weights=src, stripped=True, refit="refit", refittable=refittable)
    with pytest.raises(FluxtrtError, match="w from your checkpoint has 5 values, the engine's 4"):
        ex.activate()


# 7 -------------------------------------------------------------------------------------------------------
def test_plan_is_verified_then_streamed_in_chunks(tmp_path, monkeypatch):
    import fluxtrt.runtime.tensorrt as rt

    monkeypatch.setattr(rt, "READ_CHUNK", 4096)
    ex, _, _ = make_executor(tmp_path, pad=50_000)  # a plan of ~50 KB
    ex.activate()
    reads = ex.runtime.reads
    assert len(reads) >= 12 and max(reads) <= 4096 and sum(reads) == ex.engine_path.stat().st_size
    ex2, _, _ = make_executor(tmp_path, pad=50_000)
    with open(ex2.engine_path, "r+b") as f:  # one flipped byte: refused before TensorRT reads anything
        f.seek(100)
        f.write(b"X")
    before = fake_trt.STATS["deserialized"]
    with pytest.raises(FluxtrtError, match="does not match the manifest's size and sha256"):
        ex2.activate()
    assert fake_trt.STATS["deserialized"] == before
    with open(ex2.engine_path, "ab") as f:
        f.write(b"more")
    with pytest.raises(FluxtrtError, match="size and sha256"):
        ex2.activate()


# 8 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", ["rtx", "trt"])
def test_low_vram_with_weights_does_not_read_the_checkpoint_again(tmp_path, flavour):
    """--low-vram --weights: TensorRT-RTX's weights manager saves, unloads and restores the refitted weights
    (deserialized and refitted once); without a manager the checkpoint's arrays are kept and refitted again."""
    refittable = {"w": ["FLOAT", 4]}
    src = _source({"w": np.ones(4, np.float32)})
    ex, _, streams = make_executor(tmp_path, flavour, weights=src, stripped=True, refit="refit",
                                   refittable=refittable, low_vram=True)
    for _ in range(3):
        ex.infer(feeds())
        ex.deactivate()
    assert src.calls == 1  # the checkpoint is read once either way
    if flavour == "rtx":
        assert fake_trt.STATS["deserialized"] == 1 and fake_trt.STATS["refits"] == 1
        assert [op for op, _ in ex._manager.log] == ["save", "unload", "restore"] * 2 + ["save", "unload"]
        assert all(s == "s1" for _, s in ex._manager.log) and ex.engine is not None  # the engine stayed
    else:
        assert fake_trt.STATS["deserialized"] == 3 and fake_trt.STATS["refits"] == 3


# 9 -------------------------------------------------------------------------------------------------------
def test_peak_memory_counts_what_tensorrt_allocates_outside_torch():
    from fluxtrt.runtime.pipeline import MemoryWatch

    state = {"free": 80 << 30, "torch": 1 << 30}
    watch = MemoryWatch(mem_get_info=lambda: (state["free"], 80 << 30), max_allocated=lambda: state["torch"],
                        reset=lambda: None, allocated=lambda: state["torch"])
    state["free"] -= 20 << 30  # an engine's weights: TensorRT's own allocation, invisible to torch
    watch.sample()
    state["free"] += 20 << 30  # --low-vram freed it again
    state["torch"] += 2 << 30
    assert watch.peak_gb() == pytest.approx(20.0)  # torch.cuda.max_memory_allocated alone would say 2


# 10 ------------------------------------------------------------------------------------------------------
def test_runtime_cache_failure_never_loses_the_run_and_kernels_are_eager(tmp_path, monkeypatch):
    ex, _, _ = make_executor(tmp_path)
    ex.activate()
    assert ex.runtime_config.dynamic_shapes_kernel_specialization_strategy == \
        trt_real.DynamicShapesKernelSpecializationStrategy.EAGER  # one-shot runs: specialized before step 1
    lazy, _, _ = make_executor(tmp_path, kernel_specialization="lazy")
    lazy.activate()
    assert lazy.runtime_config.dynamic_shapes_kernel_specialization_strategy == \
        trt_real.DynamicShapesKernelSpecializationStrategy.LAZY
    assert ex.save_runtime_cache() is None and ex.runtime_cache_path.read_bytes() == b"kernels"

    def read_only(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("fluxtrt.fileio.write_bytes_atomic", read_only)
    note = ex.deactivate()
    assert note and "could not save transformer.runtime.cache" in note and not ex.active


# 11 ------------------------------------------------------------------------------------------------------
def test_copies_and_execution_run_on_the_executors_stream(tmp_path):
    ex, _, streams = make_executor(tmp_path)
    ex.infer(feeds())  # called outside any stream scope: infer_impl enters its own
    assert streams.copies and {s for s, _ in streams.copies} == {"s1"}
    assert ex.context.executions[-1]["stream"] == "s1" and streams.current == "default"


# 12 ------------------------------------------------------------------------------------------------------
def test_low_vram_release_returns_torch_cached_memory(tmp_path):
    ex, _, streams = make_executor(tmp_path, low_vram=True)
    ex.infer(feeds())
    ex.deactivate()
    assert streams.released == 1 and ex.engine is None and ex.context is None
    plain, _, streams = make_executor(tmp_path)
    plain.infer(feeds())
    plain.deactivate()
    assert streams.released == 0


# 13 ------------------------------------------------------------------------------------------------------
def test_every_tensorrt_dtype_maps_or_is_refused_clearly():
    from fluxtrt.dtypes import torch_dtype_of_engine

    for member in trt_real.DataType.__members__.values():
        name = str(member).split(".")[-1].lower()
        if name in ("int4", "fp4", "e8m0"):  # no torch tensor type: one clear line
            with pytest.raises(FluxtrtError, match="no torch equivalent"):
                torch_dtype_of_engine(name)
            continue
        t = torch_dtype_of_engine(name)
        assert torch.empty((), dtype=t).element_size() == member.itemsize, name


# 14 ------------------------------------------------------------------------------------------------------
def test_inputs_are_bound_at_the_same_addresses_every_step(tmp_path):
    """Under TensorRT-RTX's whole-graph capture a new address would force a re-capture: every step binds the
    same persistent buffers, refilled by a copy; a new shape gets its own."""
    ex, _, _ = make_executor(tmp_path, cuda_graph=True)
    for step in range(3):
        ex.infer(feeds(seed=step))  # new tensors every step, as the Euler update makes
    addresses = [run["addresses"] for run in ex.context.executions]
    assert addresses[0] == addresses[1] == addresses[2]
    ex.infer(feeds(batch=2, tokens=32))
    assert ex.context.executions[-1]["addresses"]["hidden_states"] != addresses[0]["hidden_states"]
    assert len(ex._inputs) == 4


def test_user_managed_memory_is_aligned_and_large_enough(tmp_path):
    ex, _, _ = make_executor(tmp_path)
    ex.infer(feeds())
    assert ex.context.memory % 256 == 0 and ex.shared_memory.buffer.numel() >= ex.memory_size()


def test_timing_cache_is_not_used_with_tensorrt_rtx():
    from fluxtrt.core.backends import TensorRT, TensorRTRTX

    assert TensorRTRTX.uses_timing_cache is False and TensorRT.uses_timing_cache is True
