"""fileio.py: atomic writes, untrusted paths, output folders, untrusted JSON, and what a killed run leaves."""

import json
import os

import pytest

from fluxtrt.errors import FluxtrtError
from fluxtrt.fileio import atomic_file, check_out_folder, inside, read_json, remove_stale_staging, write_json_atomic


def test_an_atomic_write_leaves_the_old_file_on_error(tmp_path):
    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write(os.urandom(64))
            raise RuntimeError("stop")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]
    data = os.urandom(64)
    with atomic_file(target) as f:
        f.write(data)
    assert target.read_bytes() == data


@pytest.mark.parametrize("rel", ["/etc/passwd", "../x", "a/../../x", "", None, 3, "a\x00b"])
def test_a_path_from_a_file_stays_inside_its_folder(tmp_path, rel):
    with pytest.raises(FluxtrtError, match="manifest"):
        inside(tmp_path, rel, "manifest field")


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    (tmp_path / "out").symlink_to("/etc")
    assert inside(tmp_path, "x.engine", "f") == tmp_path / "x.engine"
    with pytest.raises(FluxtrtError, match="leads outside"):
        inside(tmp_path, "out/passwd", "f")


def test_an_output_folder_is_never_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    check_out_folder(tmp_path / "new" / "deeper")
    with pytest.raises(FluxtrtError, match="is a file, not a folder"):
        check_out_folder(tmp_path / "f" / "sub")


@pytest.mark.parametrize("content,says", [(b"{", "unreadable"), (b"\xff\xfe", "unreadable"),
                                          (b"[" * 100_000, "unreadable")])
def test_untrusted_json_is_one_line(tmp_path, content, says):
    (tmp_path / "m.json").write_bytes(content)
    with pytest.raises(FluxtrtError, match=says):
        read_json(tmp_path / "m.json", "a manifest", "rebuild")
    write_json_atomic(tmp_path / "ok.json", {"a": [1, 2]})
    assert read_json(tmp_path / "ok.json", "x", "y") == json.loads((tmp_path / "ok.json").read_text())


def test_a_stale_temp_file_of_a_killed_build_is_removed_by_the_next(tmp_path):
    """SIGKILL leaves an engine's temp file (nothing can catch it); the next build, holding the lock, removes it."""
    gpu = tmp_path / "4090"
    gpu.mkdir()
    try:
        with atomic_file(gpu / "transformer.engine") as f:
            f.write(b"x" * 10)
            temp = next(gpu.glob(".tmp-transformer.engine-*"))  # the temp name remove_stale_staging knows
            os.link(temp, gpu / ".tmp-transformer.engine-killed")  # what a kill at this point leaves
            raise RuntimeError("stop")
    except RuntimeError:
        pass
    (gpu / ".tmp-model-x").mkdir()
    (gpu / "keep.engine").write_bytes(b"1")
    assert remove_stale_staging(tmp_path) == 2
    assert sorted(p.name for p in gpu.iterdir()) == ["keep.engine"]


def test_tree_sha256_is_the_sha256_of_its_pieces_digests(tmp_path):
    """tree_sha256 of a file of one 64 MiB piece and a partial one: sha256 of the two pieces' sha256 digests, the
    same on one thread or eight; a flipped byte in the last piece changes it."""
    import hashlib
    import os

    from fluxtrt.fileio import TREE_CHUNK, tree_sha256

    data = bytearray(os.urandom(TREE_CHUNK + 1234))
    (tmp_path / "w").write_bytes(data)
    want = hashlib.sha256(hashlib.sha256(data[:TREE_CHUNK]).digest()
                          + hashlib.sha256(data[TREE_CHUNK:]).digest()).hexdigest()
    assert tree_sha256(tmp_path / "w", workers=1) == tree_sha256(tmp_path / "w", workers=8) == want
    data[-1] ^= 1
    (tmp_path / "w").write_bytes(data)
    assert tree_sha256(tmp_path / "w") != want
