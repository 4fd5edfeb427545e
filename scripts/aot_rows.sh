#!/usr/bin/env bash
# The issue's Hopper rows in one go (docs/bench/aot_engines.json): for each precision asked (fp8 then bf16), the
# packages built as `fluxtrt build --gpu <this GPU> --backend torch` does, the first package load profiled, each
# package loaded phase by phase, a fresh process timed to its first image, then diffusers eager bf16 against the
# packages with CUDA graphs in one process. A precision's folder is removed after its rows (the disk holds one).
#   OUTDIR=/tmp/rows bash scripts/aot_rows.sh "fp8 bf16"
# Rehearse:  OUTDIR=/tmp/rows GPU=cpu MODEL=tiny SIZE=1024 STEPS=2 bash scripts/aot_rows.sh fp8
set -uo pipefail
OUTDIR=${OUTDIR:?}; mkdir -p "$OUTDIR"
source "$(dirname "$0")/device_env.sh"
if [ -z "${GPU:-}" ]; then
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200 || echo h100)
fi
MODEL=${MODEL:-random:flux.1-dev}; SIZE=${SIZE:-1024}; STEPS=${STEPS:-28}
A="python3 scripts/aot_engines.py"
for P in ${1:-fp8 bf16}; do
  prec=(); [ "$P" = fp8 ] && prec=(--precision transformer=fp8)
  $A build --gpu "$GPU" --model "$MODEL" "${prec[@]}" --root /tmp/aot --out "$OUTDIR/build_$P.json" || continue
  DIR=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['gpu_dir'])" "$OUTDIR/build_$P.json")
  $A kernels --engines "$DIR" --out "$OUTDIR/kernels_$P.json"
  $A read --engines "$DIR" --out "$OUTDIR/read_$P.json"
  python3 -X faulthandler scripts/aot_engines.py load --engines "$DIR" --out "$OUTDIR/load_$P.json"
  $A first --engines "$DIR" --steps "$STEPS" --size "$SIZE" --out "$OUTDIR/first_$P.json"
  $A speed --engines "$DIR" --steps "$STEPS" --size "$SIZE" --variants diffusers,packages-graph \
    --out "$OUTDIR/speed_$P.json"
  rm -rf "$DIR"
done
echo "rows done"
