"""core/packages.py: what a compiled PyTorch package needs to run, and the one line when this machine differs."""

import pytest
import torch

from fluxtrt.core.packages import package_runtime, runtime_problem


def test_a_package_of_another_torch_cuda_or_device_is_named_with_both_sides():
    from fluxtrt.core.packages import loaded_libstdcxx

    here = package_runtime("cpu")
    assert here == {"torch": torch.__version__, "cuda": None, "target": "cpu", "libstdc++": loaded_libstdcxx()}
    assert runtime_problem(here, "cpu") is None
    assert loaded_libstdcxx() is not None  # torch's own libraries load one
    major, minor, patch = map(int, loaded_libstdcxx().split("."))
    newer, older = f"{major}.{minor}.{patch + 1}", f"{major}.{minor}.{max(patch - 1, 0)}"
    assert runtime_problem(dict(here, **{"libstdc++": newer}), "cpu") == (
        f"it was compiled against libstdc++ {newer}, this machine's torch runs on the older libstdc++ {here['libstdc++']}")
    assert runtime_problem(dict(here, **{"libstdc++": older}), "cpu") is None
    assert runtime_problem({k: v for k, v in here.items() if k != "libstdc++"}, "cpu") is None  # manifests before it
    other_torch = dict(here, torch="2.4.0")
    assert runtime_problem(other_torch, "cpu") == f"it was compiled for torch 2.4.0, this machine has torch {torch.__version__}"
    assert runtime_problem(dict(here, target="sm90", cuda="12.8"), "cpu") == (
        "it was compiled for device sm90, this machine has device cpu")


def test_the_build_compiles_with_a_compiler_of_the_libstdcxx_torch_runs_on(tmp_path):
    """engine/aoti.cxx_compiler: a $CXX that links libstdc++ statically (as the H200 image's /opt/gcc/bin/g++, whose
    packages all crashed on load) or links a newer one than this process runs on is passed over for a g++ that links
    this process's; where no compiler fits, the build stops in one line naming each and the fix."""
    import re

    import pytest

    from fluxtrt.core.packages import loaded_libstdcxx
    from fluxtrt.engine.aoti import _choose_compiler
    from fluxtrt.errors import BuildError

    here = loaded_libstdcxx()
    fakes = {}
    (tmp_path / "lib64").mkdir()
    for name, version in (("newer", "6.0.99"), ("older", "6.0.1"), ("same", here), ("static", None)):
        if version:  # what `g++ -print-file-name=libstdc++.so` answers: the shared library -lstdc++ links
            (tmp_path / "lib64" / f"libstdc++.so.{version}").write_bytes(b"")
        fakes[name] = tmp_path / f"g++-{name}"
        fakes[name].write_text(f"#!/bin/sh\necho {tmp_path}/lib64/libstdc++.so.{version}\n" if version else
                               "#!/bin/sh\necho libstdc++.so\n")
        fakes[name].chmod(0o755)
    newer, older, same, static = (str(fakes[k]) for k in ("newer", "older", "same", "static"))
    assert _choose_compiler((static, same)) == (same, here)
    assert _choose_compiler((newer, same)) == (same, here)
    assert _choose_compiler((newer, older)) == (older, "6.0.1")
    assert _choose_compiler((str(tmp_path / "absent"), same)) == (same, here)
    with pytest.raises(BuildError, match=re.escape(f"no C++ compiler here makes packages this torch can load: {newer} "
                                                   f"links libstdc++ 6.0.99, and this process runs on libstdc++ "
                                                   f"{here}")):
        _choose_compiler((newer,))
    with pytest.raises(BuildError, match=re.escape(f"{static} links libstdc++ statically, and this process")):
        _choose_compiler((static,))
    with pytest.raises(BuildError, match="install g\\+\\+ or set CXX"):
        _choose_compiler((str(tmp_path / "absent"),))


@pytest.mark.parametrize("piece", [64 << 20, 1000])
def test_constants_round_trip_in_their_dtypes_and_a_damaged_file_is_one_line(tmp_path, monkeypatch, piece):
    """A package's weights file: E4M3, bf16 and fp32 tensors (fresh random values) read back bit for bit, hashed
    as they are read (tree_sha256's pieces on several threads); a flipped byte or a truncated file is refused
    naming the file and the fix, nothing returned. With 1000-byte pieces (the record's 64 MiB made small) tensors
    straddle pieces and a piece holds several tensors."""
    import pytest

    from fluxtrt import fileio
    from fluxtrt.core.packages import read_constants, save_constants
    from fluxtrt.errors import FluxtrtError

    monkeypatch.setattr(fileio, "TREE_CHUNK", piece)
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    tensors = {"w8": (torch.randn(64, 32, generator=g) * 8).to(torch.float8_e4m3fn),
               "b16": torch.randn(17, generator=g).to(torch.bfloat16), "f32": torch.randn(3, 5, generator=g),
               "empty": torch.zeros(0), "big": torch.randn(1500, generator=g), "scalar": torch.randn((), generator=g)}
    rec = save_constants(tensors, tmp_path / "t.constants.safetensors")
    assert rec["file"] == "t.constants.safetensors" and rec["bytes"] == (tmp_path / rec["file"]).stat().st_size
    assert not list(tmp_path.glob(".tmp-*"))
    back = read_constants(tmp_path / rec["file"], rec, "cpu", "transformer")
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(
            back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
    data = bytearray((tmp_path / rec["file"]).read_bytes())
    data[-40] ^= 0x01
    (tmp_path / rec["file"]).write_bytes(bytes(data))
    with pytest.raises(FluxtrtError, match=r"^transformer: .* is not the file the manifest records \(tree_sha256 differs"):
        read_constants(tmp_path / rec["file"], rec, "cpu", "transformer")
    (tmp_path / rec["file"]).write_bytes(bytes(data[:-100]))
    with pytest.raises(FluxtrtError, match="missing or not the size the manifest records"):
        read_constants(tmp_path / rec["file"], rec, "cpu", "transformer")


def test_a_torch_that_crashes_loading_a_package_is_one_line_and_a_good_package_loads(packages, monkeypatch):
    """probe_load: the packages' kernels loaded in one child process. Real tiny packages load there; a child that
    dies of a signal (as every CUDA package's load did with torch 2.11.0+cu130 on the H200) is one line naming the
    package it died in, the torch and the JIT path, and this process lives on."""
    import re

    import pytest

    from fluxtrt.core import packages as pk
    from fluxtrt.errors import FluxtrtError

    _, folder, _ = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    both = {"transformer": folder / "transformer.pt2", "transformer_head": folder / "transformer_head.pt2"}
    pk.probe_load(both, "cpu")  # one child loads both
    monkeypatch.setattr(pk, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(FluxtrtError, match=rf"^transformer: this torch {re.escape(torch.__version__)} crashes loading "
                                           r"transformer\.pt2 \(SIGSEGV .*--backend torch --model MODEL --compile"):
        pk.probe_load(both, "cpu")
    # the child dies in the second package: the line names that one
    monkeypatch.setattr(pk, "_PROBE", "import os, signal; print(0); print(1, flush=True); os.kill(os.getpid(), 11)")
    with pytest.raises(FluxtrtError, match=r"^transformer_head: this torch .* crashes loading transformer_head\.pt2"):
        pk.probe_load(both, "cpu")
    monkeypatch.setattr(pk, "_PROBE", "raise SystemExit('bad archive')")
    with pytest.raises(FluxtrtError, match=r"is not a package this torch can load \(bad archive\)"):
        pk.probe_load(both, "cpu")


def test_a_package_whose_wrapper_links_libstdcxx_statically_is_told_from_one_that_links_it_shared(packages, tmp_path):
    """links_shared_libstdcxx reads the DT_NEEDED names of the package's libraries: fluxtrt's own packages name
    libstdc++.so.6; the same package with that name changed (as a statically linked wrapper has none), a package
    without libraries, a damaged library and a file that is not a zip are each False (the load probe runs)."""
    import zipfile

    from fluxtrt.core.packages import links_shared_libstdcxx, needed_libraries

    _, folder, _ = packages("tiny-schnell", ("transformer",), first_block_cache=True)
    good = folder / "transformer.pt2"
    assert links_shared_libstdcxx(good)
    with zipfile.ZipFile(good) as z:
        so = next(i for i in z.infolist() if i.filename.endswith(".so"))
        lib = z.read(so)
        members = [(i, z.read(i)) for i in z.infolist()]
    assert "libstdc++.so.6" in needed_libraries(lib) and "libc.so.6" in needed_libraries(lib)

    def repack(name, change):
        out = tmp_path / name
        with zipfile.ZipFile(out, "w") as z:
            for info, data in members:
                if info.filename.endswith(".so"):
                    data = change(data)
                    if data is None:
                        continue
                z.writestr(info, data)
        return out

    static = repack("static.pt2", lambda d: d.replace(b"libstdc++.so.6\0", b"libstdx++.so.6\0"))
    assert "libstdx++.so.6" in needed_libraries(zipfile.ZipFile(static).read(so.filename))
    assert not links_shared_libstdcxx(static)
    assert not links_shared_libstdcxx(repack("none.pt2", lambda d: None))
    cut = repack("cut.pt2", lambda d: d[:int(torch.randint(100, 2000, ()))])
    assert needed_libraries(zipfile.ZipFile(cut).read(so.filename)) is None and not links_shared_libstdcxx(cut)
    (tmp_path / "junk.pt2").write_bytes(torch.randint(0, 255, (4096,), dtype=torch.uint8).numpy().tobytes())
    assert not links_shared_libstdcxx(tmp_path / "junk.pt2")


BODY = "lambda q8, k8, v8, s: (q8.float() * s[0] + k8.float() * s[1] - v8.float() * s[2]).bfloat16()"


@pytest.mark.slow
def test_a_package_calling_flashinfers_op_reaches_it_through_load_package_alone(tmp_path):
    """An fp8-attn package built on Hopper calls fluxtrt::fa3_fp8_attention, a Python custom op that AOTInductor's
    runtime reaches through the dispatcher: in a fresh process, torch's bare loader refuses the package ("Could not
    find schema"), while load_package (its _open registers the op) loads it, and the call runs the op's kernel on
    the package's E4M3 operands (here a CPU kernel registered after the load): the eager arithmetic exactly."""
    import subprocess
    import sys

    from fluxtrt.kernels import flashinfer_fp8_attention  # noqa: F401  the op, for the export here

    scales = [float(x) for x in torch.empty(3).uniform_(0.005, 0.02)]

    class Calls(torch.nn.Module):
        def forward(self, q):
            q8 = (q / scales[0]).clamp(-448, 448).to(torch.float8_e4m3fn)
            return torch.ops.fluxtrt.fa3_fp8_attention(q8, q8, q8, scales).float() + 1

    q = torch.randn(64, 4, 128)
    path = tmp_path / "transformer.pt2"
    torch._inductor.aoti_compile_and_package(torch.export.export(Calls(), (q,)), package_path=str(path))
    torch.save(q, tmp_path / "q.pt")
    q8 = (q / scales[0]).clamp(-448, 448).to(torch.float8_e4m3fn)
    want = eval(BODY)(q8, q8, q8, scales).float() + 1

    def child(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    bare = child(f"import torch; torch._C._aoti.AOTIModelPackageLoader({str(path)!r}, 'model', True, 1, -1)")
    assert bare.returncode != 0 and "Could not find schema for fluxtrt::fa3_fp8_attention" in bare.stderr, bare.stderr
    ours = child(f"""import pathlib, torch
from fluxtrt.core.packages import load_package
m = load_package(pathlib.Path({str(path)!r}), "transformer", "cpu")
torch.library.register_kernel("fluxtrt::fa3_fp8_attention", "cpu", {BODY})
torch.save(m(torch.load({str(tmp_path / 'q.pt')!r})), {str(tmp_path / 'out.pt')!r})""")
    assert ours.returncode == 0, ours.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt")
    got = got[0] if isinstance(got, (list, tuple)) else got
    assert torch.equal(got, want) and want.std() > 0.1
