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
    """The README's Python example, as written, builds fp8 engines for the 4090 and writes fox.png."""
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


def test_readme_is_a_short_guide():
    """At most 2,000 words, no paragraph (outside code blocks) over 120 words; details live in docs/."""
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(text.split()) <= 2000
    assert max(len(p.split()) for p in re.split(r"\n\s*\n", text)) <= 120
