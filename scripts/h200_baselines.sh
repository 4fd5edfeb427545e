#!/usr/bin/env bash
# Full-size baselines on a CUDA machine (the lent H200) with the random-weight FLUX.1-dev architecture:
#   bash scripts/h200_baselines.sh OUTDIR eager     per step and end to end, 512² and 1024², batch 1 and 4
#   bash scripts/h200_baselines.sh OUTDIR compile   the same with torch.compile on both sides, 1024², batch 1
# Each row measures fluxtrt's pipeline (torch executor) and diffusers' FluxPipeline in the same process.
set -uo pipefail
OUTDIR=${1:-h200}; MODE=${2:-eager}
mkdir -p "$OUTDIR"
source "$(dirname "$0")/device_env.sh"
if [ "$MODE" = eager ]; then
  $FLUXTRT bench --backend torch --model random:flux.1-dev --sizes 512,1024 --batch 1,4 --steps 28 --runs 2 \
    --warmup 1 --baseline diffusers --json "$OUTDIR/bench_eager_sizes.json" 2>&1 | tail -30 | tee "$OUTDIR/bench_eager_sizes.txt"
else
  $FLUXTRT bench --backend torch --model random:flux.1-dev --sizes 1024 --batch 1 --steps 28 --runs 2 --warmup 1 \
    --compile --baseline diffusers --json "$OUTDIR/bench_compile.json" 2>&1 | tail -20 | tee "$OUTDIR/bench_compile.txt"
fi
