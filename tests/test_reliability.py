"""Faults: concurrent builds, a build stopped mid-way (SIGTERM), a full disk. Nothing half-written may be trusted."""

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
def test_sigterm_mid_build_cleans_up_then_inspect_run_and_the_rebuild_know(tiny_schnell, tmp_path):
    """SIGTERM (Kubernetes, CI) mid-build: one line, exit 143, no lock, no temp file, a build.log that says where it
    stopped; `inspect` says incomplete (exit 2), `run` names the missing engines, and the next build does only the
    missing work. (SIGKILL's leftovers: tests/test_fileio.py.)"""
    from typer.testing import CliRunner

    from fluxtrt.cli import app

    comps = "clip,vae_decoder"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "fluxtrt.cli", "build", "--gpu", "4090", "--model", "tiny-schnell",
                             "--out", str(tmp_path), "-c", comps], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    manifest_path = tmp_path / "4090" / "manifest.json"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        m = read_manifest(tmp_path / "4090", required=False) if manifest_path.exists() else None
        if m and m.components:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the build finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143 and "stopped by SIGTERM" in output and "Traceback" not in output, output
    leftovers = [p.name for p in tmp_path.rglob("*") if p.name.startswith((".tmp-", ".fluxtrt.lock"))]
    assert not leftovers, leftovers
    log = (tmp_path / "4090" / "build.log").read_text()
    assert "== stopped (KeyboardInterrupt" in log and "not built:" in log, log
    done = set(read_manifest(tmp_path / "4090").components)
    assert done and done != set(comps.split(","))

    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "4090")])
    assert res.exit_code == 2 and "incomplete: the build stopped before" in " ".join(res.output.split()), res.output
    res = CliRunner().invoke(app, ["run", "--engines", str(tmp_path / "4090"), "--prompt", "a fox", "--backend",
                                   "onnxruntime", "--out", str(tmp_path / "x.png")])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "is an unfinished build: it has no" in said and "run the same `fluxtrt build` again" \
        in said, res.output

    manifest, results = build_gpu(tiny_schnell, load_gpu("4090"), tmp_path, components=comps.split(","))
    status = {(r.component, r.stage): r.status for r in results}
    for c in comps.split(","):
        assert status[(c, "build")] == ("reused" if c in done else "built"), (c, status)
        e = manifest.components[c]
        assert sha256_file(tmp_path / "4090" / e.engine) == e.sha256
    assert manifest.pending == [] and read_manifest(tmp_path / "4090").pending == []


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
