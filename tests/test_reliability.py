"""Faults: concurrent builds, a build killed mid-way, a full disk. Nothing half-written may be trusted."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install -e '.[rtx]')")

from fluxtrt.errors import FluxtrtError  # noqa: E402
from fluxtrt.fileio import exclusive_lock, sha256_file, write_bytes_atomic  # noqa: E402
from fluxtrt.gpus import load_gpu  # noqa: E402
from fluxtrt.records import read_manifest  # noqa: E402
from fluxtrt.stages.build import build_gpu  # noqa: E402


def test_second_build_into_the_same_folder_fails_clearly(tiny_schnell, tmp_path):
    with exclusive_lock(tmp_path):
        with pytest.raises(FluxtrtError, match=f"another fluxtrt build \\(pid {os.getpid()}\\) is writing to"):
            build_gpu(tiny_schnell, load_gpu("4090"), tmp_path, components=["clip"])
    manifest, _ = build_gpu(tiny_schnell, load_gpu("4090"), tmp_path, components=["clip"])  # lock released
    assert "clip" in manifest.components


@pytest.mark.slow
def test_killed_build_resumes_with_only_the_missing_work(tiny_schnell, tmp_path):
    comps = "clip,vae_decoder,vae_encoder"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fluxtrt.cli", "build", "--gpu", "4090", "--model", "tiny-schnell",
                             "--out", str(tmp_path), "-c", comps], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    manifest_path = tmp_path / "4090" / "manifest.json"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        m = read_manifest(tmp_path / "4090", required=False) if manifest_path.exists() else None
        if m and m.components:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the build finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = set(read_manifest(tmp_path / "4090").components)
    assert done and done != set(comps.split(","))
    manifest, results = build_gpu(tiny_schnell, load_gpu("4090"), tmp_path, components=comps.split(","))
    status = {(r.component, r.stage): r.status for r in results}
    for c in comps.split(","):
        assert status[(c, "build")] == ("reused" if c in done else "built"), (c, status)
        e = manifest.components[c]
        assert sha256_file(tmp_path / "4090" / e.engine) == e.sha256
    assert not list(tmp_path.rglob(".tmp-*"))  # the killed run's staging folders were cleared


def test_disk_full_before_writing_names_the_need(tmp_path, monkeypatch):
    import shutil

    target = tmp_path / "x.engine"
    target.write_bytes(b"old engine")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("fluxtrt.fileio.shutil.disk_usage", lambda p: usage._replace(free=100))
    with pytest.raises(FluxtrtError, match=r"not enough disk space for .*x.engine: 0.0 MB needed, 0.0 MB free"):
        write_bytes_atomic(target, b"y" * 1000)
    assert target.read_bytes() == b"old engine" and [p.name for p in tmp_path.iterdir()] == ["x.engine"]


def test_write_error_leaves_no_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "x.engine"
    target.write_bytes(b"old engine")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    monkeypatch.setattr("fluxtrt.fileio.os.fsync", full)
    with pytest.raises(OSError):
        write_bytes_atomic(target, b"new engine bytes")
    assert target.read_bytes() == b"old engine" and [p.name for p in tmp_path.iterdir()] == ["x.engine"]


def test_cli_reports_disk_full_in_one_line(monkeypatch, tmp_path):
    import contextlib

    from typer.testing import CliRunner

    from fluxtrt import fileio
    from fluxtrt.cli import app

    real = fileio.atomic_file

    @contextlib.contextmanager
    def full(path):  # the engine's temp file fills the disk (its plan is streamed into it)
        class Full:
            def write(self, data):
                raise OSError(errno.ENOSPC, "No space left on device")

        with real(path) as f:
            yield Full() if str(path).endswith(".engine") else f

    monkeypatch.setattr(fileio, "atomic_file", full)
    res = CliRunner().invoke(app, ["build", "--gpu", "4090", "--model", "tiny-schnell", "--out", str(tmp_path),
                                   "-c", "clip"])
    assert res.exit_code == 2, res.output
    assert "no space left on the device while writing" in res.output and "clip.engine" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "4090" / "clip.engine").exists()
