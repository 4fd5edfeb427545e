#!/usr/bin/env bash
# Build and pack engine archives for GPU targets with TensorRT-RTX, ahead of time, on a machine without
# those GPUs. Usage: bash scripts/build_artifacts.sh MODEL GPUS OUTDIR   (e.g. tiny 4090,3090 dist)
# Each target gives OUTDIR/fluxtrt-<model>-<gpu>-sm<cc>.tar.gz and its .sha256; the archives are verified
# by unpacking them into a scratch folder.
set -euo pipefail
MODEL=${1:-tiny}; GPUS=${2:-4090}; OUTDIR=${3:-dist}
fluxtrt artifacts --model "$MODEL" --gpus "$GPUS" --engines "${ENGINES:-engines}" --out "$OUTDIR"
check=$(mktemp -d)
for a in "$OUTDIR"/*.tar.gz; do
  (cd "$OUTDIR" && sha256sum -c "$(basename "$a").sha256")
  fluxtrt unpack "$a" --out "$check"
done
rm -rf "$check"
