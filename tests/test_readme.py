"""The README's set-up commands are the ones CI runs, and every fluxtrt command it shows exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _blocks():
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command():
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert len(ci_lines) == 1
    assert any(ci_lines[0].strip() == b.strip() for b in _blocks()), "README test command differs from .ci/run"


def test_readme_commands_exist_in_the_cli():
    from typer.main import get_command

    from fluxtrt.cli import app

    commands = set(get_command(app).commands)
    shown = {m for b in _blocks() for m in re.findall(r"fluxtrt ([a-z]+)", b)}
    assert shown and shown <= commands, shown - commands


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path, monkeypatch):
    """The README's Python example, as written, builds fp8 engines for the 4090 and writes fox.png. Only the fp8
    calibration is made small (4 prompts, 2 steps, where the default's 32 prompts cost CI two minutes; the default
    settings are tests/quantize's)."""
    from fluxtrt import api
    from fluxtrt.records import CalibrationSettings

    build = api.build
    monkeypatch.setattr(api, "build", lambda *a, **kw: build(*a, calibration=CalibrationSettings(size=4, steps=2),
                                                             **kw))
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (code,) = [b for b in blocks if "api.build" in b]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102
    built, done = scope["built"], scope["done"]
    assert built.manifest.components["transformer"].precision == "fp8"
    assert {e.precision for n, e in built.manifest.components.items() if n != "transformer"} <= {"fp16", "bf16", "fp32"}
    assert any("fp8 applies to transformer" in n for n in built.notes)
    assert done.paths == [Path("fox.png")] and (tmp_path / "fox.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_readme_fast_pytorch_path_runs_as_written_on_tiny(tmp_path, monkeypatch):
    """The README's two fast-path commands, as written, with the embedded model for ./FLUX.1-dev (stored in fp32,
    so the copying path's calibration) and the file `calibrate` printed for calibration-XXXX.json. Only a small
    calibration and one 256² step are added, to keep CI short: --compile and --cuda-graph stay, with torch.compile
    itself made the identity here (Inductor compiling four modules on 2 cores costs CI two minutes; its CPU path is
    tests/runtime/test_executors.py's)."""
    import shlex

    import torch

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: compiled.append(module) or module)

    from typer.testing import CliRunner

    from fluxtrt.cli import app

    (block,) = [b for b in _blocks() if "fluxtrt calibrate --model ./FLUX.1-dev --out work" in b]
    calibrate, run = (shlex.split(line.replace("./FLUX.1-dev", "tiny"), comments=True)[1:]
                      for line in block.strip().splitlines())
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, [*calibrate, "--calibration-size", "2", "--calibration-steps", "1",
                                   "--resolution", "256"])
    assert res.exit_code == 0, res.output
    printed = re.search(r"-> (\S+calibration-[0-9a-f]+\.json) \(for `fluxtrt build`, and `run --backend torch "
                        r"--calibration`\)", " ".join(res.output.split()))
    assert printed, res.output
    run = [printed[1] if a == "work/calibration/calibration-XXXX.json" else a for a in run]
    assert printed[1] in run and "--compile" in run and "--cuda-graph" in run
    res = CliRunner().invoke(app, [*run, "--steps", "1", "--height", "256", "--width", "256"])
    assert res.exit_code == 0, res.output
    assert "fp8 recipe emulated" in res.output and compiled  # --compile reached torch.compile
    assert (tmp_path / "fluxtrt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_is_a_short_guide():
    """At most 2,000 words, no paragraph (outside code blocks) over 120 words; details live in docs/."""
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(text.split()) <= 2000
    assert max(len(p.split()) for p in re.split(r"\n\s*\n", text)) <= 120
