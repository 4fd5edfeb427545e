#!/usr/bin/env bash
# Full-size FLUX.1-dev transformer: zero-copy vs normal export, and the TensorRT-RTX build (sm89) of the
# zero-copy ONNX, each measured in its own process by scripts/measure.py (seconds, peak RSS, bytes written).
# Run on a big machine (the lent H200's CPU side); TensorRT-RTX must be importable for the `build` step.
#   bash scripts/fullsize_footprint.sh OUTDIR checkpoint   # random bf16 weights as sharded safetensors
#   bash scripts/fullsize_footprint.sh OUTDIR zero-copy    # fluxtrt export --zero-copy (cold: traces the graph)
#   bash scripts/fullsize_footprint.sh OUTDIR relink       # the same again: graph from the cache, relinked
#   bash scripts/fullsize_footprint.sh OUTDIR normal       # fluxtrt export --dtype bf16 --copy-weights
#   bash scripts/fullsize_footprint.sh OUTDIR build        # TensorRT-RTX parse + build for sm89 (4090 config)
# Work files go to $WORK (default /root/fullsize); results are appended to OUTDIR/footprint.jsonl.
set -uo pipefail
OUTDIR=${1:?OUTDIR}; STEP=${2:?step}
WORK=${WORK:-/root/fullsize}
mkdir -p "$OUTDIR" "$WORK"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export FLUXTRT_CACHE=$WORK/cache
CKPT=$WORK/flux1-dev-random
M="python3 scripts/measure.py --json $OUTDIR/footprint.jsonl"
case "$STEP" in
  checkpoint)
    { nproc; free -g | head -2; df -h "$WORK" | tail -1; python3 -c 'import torch; print("torch", torch.__version__)'; } \
      | tee "$OUTDIR/machine.txt"
    $M --label write-random-checkpoint --written "$CKPT" -- \
      python3 scripts/write_random_checkpoint.py --model random:flux.1-dev --out "$CKPT" --components transformer \
      --dtype bf16 --device cuda ;;
  zero-copy)
    $M --label export-zero-copy --written "$WORK/zc" -- \
      python3 -m fluxtrt.cli export --model "$CKPT" -c transformer --zero-copy --no-validate --out "$WORK/zc"
    ls -la "$WORK/zc" "$WORK/zc/transformer.weights" | tee "$OUTDIR/zero_copy_files.txt" ;;
  relink)  # a second zero-copy export: the traced graph comes from the cache and is re-pointed at the shards
    $M --label export-zero-copy-relinked --written "$WORK/zc2" -- \
      python3 -m fluxtrt.cli export --model "$CKPT" -c transformer --zero-copy --no-validate --out "$WORK/zc2"
    rm -rf "$WORK/zc2" ;;
  normal)
    $M --label export-normal-bf16 --written "$WORK/normal" -- \
      python3 -m fluxtrt.cli export --model "$CKPT" -c transformer --dtype bf16 --copy-weights --no-validate --out "$WORK/normal"
    ls -la "$WORK/normal" | tee "$OUTDIR/normal_files.txt"
    rm -rf "$WORK/normal" ;;
  build)
    python3 -c 'import tensorrt_rtx as t; print("tensorrt_rtx", t.__version__)' | tee -a "$OUTDIR/machine.txt"
    $M --label build-sm89-bf16-from-zero-copy --written "$WORK/engines" -- \
      python3 scripts/build_onnx_engine.py --model "$CKPT" --component transformer --onnx "$WORK/zc/transformer.onnx" \
      --gpu 4090 --out "$WORK/engines/transformer.engine"
    rm -rf "$WORK/engines" ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
