"""The README's set-up commands are the ones CI runs, and every fluxtrt command it shows exists."""

import re
from pathlib import Path

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
