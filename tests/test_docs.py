"""The docs stay true to the tree: every file they cite exists, the package's docstrings cite folders that exist,
and there is one troubleshooting table (README, architecture and internals link to it)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"(?<![\w/.~$-])((?:fluxtrt|scripts|docs|tests|configs|calibration|\.ci|\.github)/[\w./*<>{}-]*[\w/*>}])")
PLACEHOLDER = re.compile(r"<|>|XXXX|\*|\{")
ELSEWHERE = {"docs/performance/flux.md"}  # a file of another project's repo (xDiT), cited as a published anchor
LAYOUT = {"onnx", "model"}  # folders of an engine folder's layout (OUT/onnx/, OUT/<gpu>/model/), not of the repo


def test_every_file_the_docs_cite_exists():
    missing = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for path in CITED.findall(line):
                path = path.split("#")[0].rstrip(".")
                if not PLACEHOLDER.search(path) and path not in ELSEWHERE and not (ROOT / path).exists():
                    missing.append(f"{doc.relative_to(ROOT)}:{n} {path}")
    assert not missing, missing


def test_docstrings_cite_folders_that_exist():
    """A `name/` in the package's text is a package of fluxtrt or a folder of the repo (a stale `workflows/` was
    cited by four modules after that package became core/workflows.py)."""
    stale = []
    for path in (ROOT / "fluxtrt").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"(?<![\w/.-])([a-z_][\w-]*)/(?=[\s),:;.`'\"]|$)", line):
                if name not in LAYOUT and not (ROOT / "fluxtrt" / name).is_dir() and not (ROOT / name).is_dir():
                    stale.append(f"{path.relative_to(ROOT)}:{n} {name}/")
    assert not stale, stale


def test_one_troubleshooting_table():
    tables = [doc.name for doc in DOCS if re.search(r"^## Troubleshooting\n(?:.*\n)*?\| message \| fix \|",
                                                    doc.read_text(), re.M)]
    assert tables == ["reference.md"], tables
    for doc in DOCS:
        if doc.name != "reference.md" and "Troubleshooting" in doc.read_text():
            assert "reference.md#troubleshooting" in doc.read_text(), doc.name
