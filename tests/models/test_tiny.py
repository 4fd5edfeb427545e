"""models/tiny.py: the embedded random-weight models and fluxtrt's cache folder (FLUXTRT_CACHE)."""

import pytest
from typer.testing import CliRunner

from fluxtrt.cli import app
from fluxtrt.errors import FluxtrtError
from fluxtrt.models.tiny import cache_root


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_cache_variable_means_the_default(monkeypatch, tmp_path, value):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLUXTRT_CACHE", value)
    assert cache_root() == tmp_path / "home" / ".cache" / "fluxtrt" and cache_root().is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name != "home"]  # nothing in the current folder


def test_a_tilde_in_the_cache_variable_is_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLUXTRT_CACHE", "~/x")
    assert cache_root() == tmp_path / "home" / "x" and not (tmp_path / "~").exists()


@pytest.mark.parametrize("value", ["/dev/null/x", "/proc/fluxtrt-cache"])
def test_an_unusable_cache_folder_names_the_variable(monkeypatch, tmp_path, value):
    monkeypatch.setenv("FLUXTRT_CACHE", value)
    with pytest.raises(FluxtrtError, match=f"FLUXTRT_CACHE={value}.*; set FLUXTRT_CACHE to a writable folder"):
        cache_root()
    res = CliRunner().invoke(app, ["run", "--model", "tiny", "--backend", "torch", "--prompt", "a fox",
                                   "--out", str(tmp_path / "x.png")])
    assert res.exit_code == 2 and "FLUXTRT_CACHE" in res.output and "--out" not in res.output, res.output
