#!/usr/bin/env bash
# One call on a CUDA machine (the lent H200): GPU tests, `fluxtrt run --backend torch` on tiny, and
# `fluxtrt bench --backend torch --baseline diffusers` on the full-size random-weight FLUX.1-dev.
# Usage: bash scripts/gpu_check.sh OUTDIR   (wheels for missing packages in .whl/ are installed first)
set -uo pipefail
OUTDIR=${1:-gpu-check}
mkdir -p "$OUTDIR"
source "$(dirname "$0")/device_env.sh"
python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" | tee -a "$OUTDIR/gpu.txt"

echo "== GPU tests"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -s 2>&1 | tail -40 | tee "$OUTDIR/gpu_tests.txt"
echo "== our Triton kernels against their arithmetic"
python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -20 | tee -a "$OUTDIR/gpu_tests.txt"

echo "== fluxtrt run --backend torch on tiny"
$FLUXTRT run --backend torch --model tiny --prompt "a red fox in the snow" --steps 8 --height 512 --width 512 \
  --out "$OUTDIR/tiny.png" 2>&1 | tail -8 | tee "$OUTDIR/run_tiny.txt"

echo "== bench: random full-size FLUX.1-dev, 1024x1024, 28 steps, batch 1, eager, vs diffusers eager"
$FLUXTRT bench --backend torch --model random:flux.1-dev --sizes 1024 --batch 1 --steps 28 --runs 2 --warmup 1 \
  --baseline diffusers --json "$OUTDIR/bench_eager.json" 2>&1 | tail -20 | tee "$OUTDIR/bench_eager.txt"

echo "== bench: same, our transformer step CUDA-graphed (diffusers stays eager)"
$FLUXTRT bench --backend torch --model random:flux.1-dev --sizes 1024 --batch 1 --steps 28 --runs 2 --warmup 1 \
  --cuda-graph --baseline diffusers --json "$OUTDIR/bench_graph.json" 2>&1 | tail -20 | tee "$OUTDIR/bench_graph.txt"
