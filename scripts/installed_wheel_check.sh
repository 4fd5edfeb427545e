#!/usr/bin/env bash
# Build fluxtrt's wheel, install it (not editable) into a fresh virtual environment, and run the README's main job
# with `-p fp8` from a folder outside the checkout: proves the package works installed (GPU configs and calibration
# prompts ship inside it). Usage: bash scripts/installed_wheel_check.sh [WORKDIR]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
mkdir -p "$work"
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
pip install -q torch==2.13.0
pip wheel -q --no-deps --wheel-dir "$work/wheel" "$repo"
pip install -q "$(ls "$work"/wheel/fluxtrt-*.whl)[rtx,cpu]"
cd "$work"
test ! -e "$work/fluxtrt" && test ! -e "$work/configs"
python - <<'PY'
import fluxtrt, pathlib, sys
p = pathlib.Path(fluxtrt.__file__).resolve()
assert "site-packages" in p.parts, f"fluxtrt imported from {p}, not the installed wheel"
print("fluxtrt from", p.parent)
PY
fluxtrt build --gpu 4090 --model tiny -p fp8 --out engines
fluxtrt run --engines engines/4090-fp8 --prompt "a red fox in the snow" --steps 4 --height 512 --width 512 --out fox.png
python -c "from PIL import Image; im = Image.open('fox.png'); assert im.size == (512, 512), im.size; print('fox.png', im.size)"
