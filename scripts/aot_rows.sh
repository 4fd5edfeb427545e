#!/usr/bin/env bash
# The issue's Hopper rows in one go (docs/bench/aot_engines.json): for each precision asked (fp8 then bf16), the
# packages built as `fluxtrt build --gpu <this GPU> --backend torch` does, the weights read, each package loaded
# phase by phase, a fresh process timed to its first image (then once more under cProfile), then diffusers eager
# bf16 against the packages with CUDA graphs in one process. A precision's folder is removed after its rows (the
# disk holds one).
#   OUTDIR=/tmp/rows bash scripts/aot_rows.sh "fp8 bf16"      (SPEED=0: without the fp8 speed row)
#   OUTDIR=/tmp/rows BRIEF=1 bash scripts/aot_rows.sh fp8-attn  (BRIEF=1: build, first image and speed only)
# Rehearse:  OUTDIR=/tmp/rows GPU=cpu MODEL=tiny SIZE=1024 STEPS=2 bash scripts/aot_rows.sh fp8
set -uo pipefail
OUTDIR=${OUTDIR:?}; mkdir -p "$OUTDIR"
source "$(dirname "$0")/device_env.sh"
if [ -z "${GPU:-}" ]; then
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200 || echo h100)
fi
MODEL=${MODEL:-random:flux.1-dev}; SIZE=${SIZE:-1024}; STEPS=${STEPS:-28}
A="python3 scripts/aot_engines.py"
# fp8 (fp8-attn): the transformer's fp8 (fp8-attn) recipe and T5's weights in E4M3 (fp8-wo), all four components,
# every row.
# bf16: the transformer alone (the other three packages are the fp8 build's): its build, read and load rows.
for P in ${1:-fp8 bf16}; do
  if [ "$P" != bf16 ]; then prec=(--precision transformer=$P --precision t5=fp8-wo); comps=clip,t5,transformer,vae_decoder
  else prec=(); comps=transformer; fi
  $A build --gpu "$GPU" --model "$MODEL" "${prec[@]}" --components $comps --root /tmp/aot \
    --out "$OUTDIR/build_$P.json" || continue
  DIR=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['gpu_dir'])" "$OUTDIR/build_$P.json")
  if [ "${BRIEF:-0}" = 0 ]; then
    $A read --engines "$DIR" --out "$OUTDIR/read_$P.json"
    python3 -X faulthandler scripts/aot_engines.py load --engines "$DIR" --out "$OUTDIR/load_$P.json"
  fi
  if [ "$P" != bf16 ]; then
    [ "${BRIEF:-0}" = 0 ] && profile=--profile || profile=
    $A first --engines "$DIR" --steps "$STEPS" --size "$SIZE" $profile --out "$OUTDIR/first_$P.json"
    [ "${SPEED:-1}" = 0 ] || $A speed --engines "$DIR" --steps "$STEPS" --size "$SIZE" --variants diffusers,packages-graph \
      --out "$OUTDIR/speed_$P.json"
  fi
  rm -rf "$DIR"
done
echo "rows done"
