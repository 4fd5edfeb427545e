"""`manifest.json` beside the engines of one GPU: what each engine is, what built it, from what.
The runtime trusts an engine only if its sha256 matches the manifest entry."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import FluxtrtError

MANIFEST = "manifest.json"
SCHEMA = 1


class ManifestError(FluxtrtError):
    """A manifest is missing, unreadable or does not match its engines."""


def read_manifest(engine_dir: Path, required: bool = True) -> dict | None:
    path = Path(engine_dir) / MANIFEST
    if not path.exists():
        if required:
            raise ManifestError(f"no {MANIFEST} in {engine_dir}; build engines first with `fluxtrt build`")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        if required:
            raise ManifestError(f"{path} is unreadable ({e}); rebuild with `fluxtrt build --force`") from None
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("components"), dict):
        if required:
            raise ManifestError(f"{path} is not a fluxtrt manifest of schema {SCHEMA}; rebuild with `fluxtrt build`")
        return None
    return data


def component_entry(manifest: dict, component: str) -> dict:
    try:
        return manifest["components"][component]
    except KeyError:
        have = ", ".join(manifest.get("components", {})) or "none"
        raise ManifestError(f"the manifest has no {component} engine (it has {have}); "
                            f"build it with `fluxtrt build --components {component}`") from None
