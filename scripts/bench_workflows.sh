#!/usr/bin/env bash
# Each FLUX.1 workflow at full size (random weights, real architectures) on a CUDA GPU: fluxtrt's pipeline on
# the PyTorch executor against the diffusers pipeline of the same workflow, in the same process, 1024², 28 steps.
# Usage: scripts/bench_workflows.sh OUT_DIR [WORKFLOW ...]   (workflows: img2img fill control kontext)
set -euo pipefail
out=${1:?usage: scripts/bench_workflows.sh OUT_DIR [img2img fill control kontext]}
shift
mkdir -p "$out"
python3 - "$out" <<'PY'
import sys
import numpy as np
from PIL import Image
out = sys.argv[1]
rng = np.random.default_rng(0)
Image.fromarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8)).resize((1024, 768)).save(f"{out}/image.png")
mask = np.zeros((768, 1024), np.uint8)
mask[200:600, 300:700] = 255
Image.fromarray(mask).save(f"{out}/mask.png")
PY
declare -A model=([img2img]=random:flux.1-dev [fill]=random:flux.1-fill-dev [control]=random:flux.1-canny-dev
                  [kontext]=random:flux.1-kontext-dev)
declare -A flags=([img2img]="--image $out/image.png" [fill]="--image $out/image.png --mask $out/mask.png"
                  [control]="--control-image $out/image.png" [kontext]="--image $out/image.png")
for wf in "${@:-img2img fill control kontext}"; do
  for w in $wf; do
    # shellcheck disable=SC2086
    python3 -m fluxtrt.cli bench --backend torch --model "${model[$w]}" ${flags[$w]} --sizes 1024 --steps 28 \
      --runs 2 --warmup 1 --baseline diffusers --json "$out/$w.json"
  done
done
