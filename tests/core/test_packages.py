"""core/packages.py: what a compiled PyTorch package needs to run, and the one line when this machine differs."""

import torch

from fluxtrt.core.packages import package_runtime, runtime_problem


def test_a_package_of_another_torch_cuda_or_device_is_named_with_both_sides():
    here = package_runtime("cpu")
    assert here == {"torch": torch.__version__, "cuda": None, "target": "cpu"}
    assert runtime_problem(here, "cpu") is None
    other_torch = dict(here, torch="2.4.0")
    assert runtime_problem(other_torch, "cpu") == f"it was compiled for torch 2.4.0, this machine has torch {torch.__version__}"
    assert runtime_problem(dict(here, target="sm90", cuda="12.8"), "cpu") == (
        "it was compiled for device sm90, this machine has device cpu")


def test_constants_round_trip_in_their_dtypes_and_a_damaged_file_is_one_line(tmp_path):
    """A package's weights file: E4M3, bf16 and fp32 tensors (fresh random values) read back bit for bit, hashed
    on the way; a flipped byte or a truncated file is refused naming the file and the fix, nothing returned."""
    import pytest

    from fluxtrt.core.packages import read_constants, save_constants
    from fluxtrt.errors import FluxtrtError

    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    tensors = {"w8": (torch.randn(64, 32, generator=g) * 8).to(torch.float8_e4m3fn),
               "b16": torch.randn(17, generator=g).to(torch.bfloat16), "f32": torch.randn(3, 5, generator=g),
               "empty": torch.zeros(0)}
    rec = save_constants(tensors, tmp_path / "t.constants.safetensors")
    assert rec["file"] == "t.constants.safetensors" and rec["bytes"] == (tmp_path / rec["file"]).stat().st_size
    assert not list(tmp_path.glob(".tmp-*"))
    back = read_constants(tmp_path / rec["file"], rec, "cpu", "transformer")
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k].view(torch.uint8),
                                                                                    v.view(torch.uint8))
    data = bytearray((tmp_path / rec["file"]).read_bytes())
    data[-40] ^= 0x01
    (tmp_path / rec["file"]).write_bytes(bytes(data))
    with pytest.raises(FluxtrtError, match=r"^transformer: .* is not the file the manifest records \(sha256 differs"):
        read_constants(tmp_path / rec["file"], rec, "cpu", "transformer")
    (tmp_path / rec["file"]).write_bytes(bytes(data[:-100]))
    with pytest.raises(FluxtrtError, match="missing or not the size the manifest records"):
        read_constants(tmp_path / rec["file"], rec, "cpu", "transformer")


def test_a_torch_that_crashes_loading_a_package_is_one_line_and_a_good_package_loads(packages, monkeypatch):
    """probe_load: the package's kernels loaded in a child process. A real tiny package loads there; a child that
    dies of a signal (as every CUDA package's load did with torch 2.11.0+cu130 on the H200) is one line naming
    the torch and the JIT path, and this process lives on."""
    import re

    import pytest

    from fluxtrt.core import packages as pk
    from fluxtrt.errors import FluxtrtError

    _, folder, _ = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    pk.probe_load(folder / "transformer.pt2", "transformer", "cpu")
    monkeypatch.setattr(pk, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(FluxtrtError, match=rf"^transformer: this torch {re.escape(torch.__version__)} crashes loading "
                                           r"transformer\.pt2 \(SIGSEGV .*--backend torch --model MODEL --compile"):
        pk.probe_load(folder / "transformer.pt2", "transformer", "cpu")
    monkeypatch.setattr(pk, "_PROBE", "raise SystemExit('bad archive')")
    with pytest.raises(FluxtrtError, match=r"is not a package this torch can load \(bad archive\)"):
        pk.probe_load(folder / "transformer.pt2", "transformer", "cpu")
