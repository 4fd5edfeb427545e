"""Engine archives: pack, checksum, safe unpack; tampered and malicious archives are refused."""

import io
import tarfile

import pytest

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")

from fluxtrt.artifacts import ArtifactError, pack, unpack  # noqa: E402
from fluxtrt.fileio import sha256_file  # noqa: E402
from fluxtrt.gpus import load_gpu  # noqa: E402
from fluxtrt.records import read_manifest  # noqa: E402
from fluxtrt.stages.build import build_gpu  # noqa: E402


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_schnell):
    root = tmp_path_factory.mktemp("art")
    build_gpu(tiny_schnell, load_gpu("4090"), root / "engines", components=["clip", "t5", "transformer", "vae_decoder"])
    archive, sha = pack(root / "engines" / "4090", root / "dist")
    return root, archive, sha


def test_pack_names_checksums_and_roundtrips(packed, tmp_path):
    root, archive, sha = packed
    assert archive.name == "fluxtrt-tiny-schnell-4090-sm89.tar.gz"
    assert sha.read_text() == f"{sha256_file(archive)}  {archive.name}\n"
    folder = unpack(archive, tmp_path)
    m = read_manifest(folder)
    assert folder == tmp_path / "4090" and m.compute_capability == "8.9"
    for e in m.components.values():
        assert sha256_file(folder / e.engine) == e.sha256
    assert (folder / "model" / "tokenizer").is_dir()  # `fluxtrt run` needs nothing else
    again, _ = pack(root / "engines" / "4090", tmp_path / "again")
    assert sha256_file(again) == sha256_file(archive)  # deterministic archives


def test_tampered_archive_is_refused(packed, tmp_path):
    root, archive, sha = packed
    bad = tmp_path / archive.name
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    (tmp_path / sha.name).write_text(sha.read_text())
    with pytest.raises(ArtifactError, match="does not match its checksum"):
        unpack(bad, tmp_path / "out")
    assert not (tmp_path / "out" / "4090").exists()
    with pytest.raises(ArtifactError, match="no checksum file"):
        unpack(archive, tmp_path / "out2", sha_file=tmp_path / "missing.sha256")


def _evil(tmp_path, build):
    import hashlib

    path = tmp_path / "evil.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        build(tar)
    (tmp_path / "evil.tar.gz.sha256").write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  evil.tar.gz\n")
    return path


def _add(tar, name, data=b"x", kind=tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname = (len(data) if kind == tarfile.REGTYPE else 0), kind, link
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


@pytest.mark.parametrize("build, message", [
    (lambda t: _add(t, "4090/../../escape.txt"), "unsafe path"),
    (lambda t: _add(t, "/etc/evil"), "unsafe path"),
    (lambda t: _add(t, "4090/link", kind=tarfile.SYMTYPE, link="/etc/passwd"), "is a link"),
    (lambda t: _add(t, "4090/hard", kind=tarfile.LNKTYPE, link="4090/x"), "is a link"),
    (lambda t: _add(t, "4090/dev", kind=tarfile.CHRTYPE), "not a plain file"),
    (lambda t: (_add(t, "4090/a"), _add(t, "other/b")), "must hold one folder"),
])
def test_malicious_archives_are_refused(tmp_path, build, message):
    archive = _evil(tmp_path, build)
    with pytest.raises(ArtifactError, match=message):
        unpack(archive, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists() and not list((tmp_path / "out").glob("*"))


def test_size_limit_and_manifest_check(tmp_path):
    archive = _evil(tmp_path, lambda t: _add(t, "4090/big", b"y" * 5000))
    with pytest.raises(ArtifactError, match="over the .* limit"):
        unpack(archive, tmp_path / "out", max_bytes=1000)
    with pytest.raises(Exception, match="no manifest.json"):  # plain files but no engines: refused
        unpack(archive, tmp_path / "out")
    assert not (tmp_path / "out" / "4090").exists()


def test_cli_unpack(packed, tmp_path):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    _, archive, _ = packed
    res = CliRunner().invoke(app, ["unpack", str(archive), "--out", str(tmp_path)])
    assert res.exit_code == 0 and "verified and unpacked" in res.output, res.output
    # into an existing folder: the user's own files and the old build are moved aside, never deleted
    (tmp_path / "4090" / "my-notes.txt").write_text("mine")
    res = CliRunner().invoke(app, ["unpack", str(archive), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "4090.previous" / "my-notes.txt").read_text() == "mine"
    assert "moved it to" in " ".join(res.output.split()) and not (tmp_path / "4090" / "my-notes.txt").exists()
    assert read_manifest(tmp_path / "4090") == read_manifest(tmp_path / "4090.previous")
    res = CliRunner().invoke(app, ["unpack", str(archive), "--out", str(tmp_path)])
    assert res.exit_code == 0 and (tmp_path / "4090.previous-2" / "manifest.json").is_file()


def test_unpack_into_an_unwritable_place_is_one_line(packed, tmp_path):
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    _, archive, _ = packed
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    res = CliRunner().invoke(app, ["unpack", str(archive), "--out", str(blocker / "engines")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "cannot write" in res.output and "writable folder" in " ".join(res.output.split())


def test_run_on_unpacked_archive_without_onnx_names_the_working_path(packed, tmp_path):
    """An unpacked archive carries no ONNX of the build machine: ONNX Runtime needs the user's weights, and the
    error says so instead of 'rebuild'."""
    from fluxtrt.errors import FluxtrtError
    from fluxtrt.runtime.assembly import open_pipeline

    _, archive, _ = packed
    folder = unpack(archive, tmp_path)
    with pytest.raises(FluxtrtError, match="--weights YOUR_FLUX_FOLDER"):
        open_pipeline(folder, backend="onnxruntime").generate(["a cat"], 256, 256, 1)


def test_unpacked_archive_runs_with_the_users_weights(packed, tmp_path, tiny_schnell):
    """What a user of a prebuilt archive does without a GPU: unpack, then run with their own checkpoint
    (ONNX Runtime fills the archive's weight-free ONNX through its weight maps; no ONNX of the build
    machine needed). Same image as the build machine's own ONNX."""
    import numpy as np

    from fluxtrt.runtime.assembly import open_pipeline

    root, archive, _ = packed
    folder = unpack(archive, tmp_path)
    for e in read_manifest(folder).components.values():
        assert (folder / e.weight_map).is_file() and (folder / e.weightfree_onnx).is_file()
    args = (["a lighthouse at dusk"], 256, 256, 2, 0.0)
    mine = open_pipeline(folder, backend="onnxruntime", weights=tiny_schnell.path).generate(*args, seed=4).images
    theirs = open_pipeline(root / "engines" / "4090", backend="onnxruntime").generate(*args, seed=4).images
    assert mine.std() > 1 and np.array_equal(mine, theirs)
