#!/usr/bin/env bash
# Full-size FLUX.1-dev transformer: zero-copy vs normal export, and the TensorRT-RTX build (sm89) of the
# zero-copy ONNX, each measured in its own process by scripts/measure.py (seconds, peak RSS, bytes written).
# Run on a big machine (the lent H200's CPU side); TensorRT-RTX must be importable for the `build` step.
#   bash scripts/fullsize_footprint.sh OUTDIR checkpoint   # random bf16 weights as sharded safetensors
#   bash scripts/fullsize_footprint.sh OUTDIR zero-copy    # fluxtrt export --zero-copy (cold: traces the graph)
#   bash scripts/fullsize_footprint.sh OUTDIR relink       # the same again: graph from the cache, relinked
#   bash scripts/fullsize_footprint.sh OUTDIR normal       # fluxtrt export --dtype bf16 --copy-weights
#   bash scripts/fullsize_footprint.sh OUTDIR build        # TensorRT-RTX parse + build for sm89 (4090 config)
# The whole `fluxtrt build` (zero-copy path) for the transformer, fp8 and bf16, from a full pipeline checkpoint:
#   bash scripts/fullsize_footprint.sh OUTDIR checkpoint-all  # every component, random bf16 weights (33.7 GB)
#   bash scripts/fullsize_footprint.sh OUTDIR calibrate       # fluxtrt calibrate --device cuda (needs the GPU)
#   bash scripts/fullsize_footprint.sh OUTDIR build-fp8       # fluxtrt build -p transformer=fp8, CPU only, 16 cores
#   bash scripts/fullsize_footprint.sh OUTDIR build-bf16      # fluxtrt build -p transformer=bf16, CPU only, 16 cores
#   bash scripts/fullsize_footprint.sh OUTDIR layers          # parsed / computed layers, unfused vs fused (after both)
#   bash scripts/fullsize_footprint.sh OUTDIR build-fp4       # fluxtrt build --gpu 5090 -p transformer=fp4 (sm120)
#   bash scripts/fullsize_footprint.sh OUTDIR static-all      # every component, 5090, 1024² batch 1 (memory table)
#   bash scripts/fullsize_footprint.sh OUTDIR validate        # fluxtrt validate --ort-provider cuda (GPU, onnxruntime-gpu)
# Work files go to $WORK (default /root/fullsize); results are appended to OUTDIR/footprint.jsonl.
set -uo pipefail
OUTDIR=${1:?OUTDIR}; STEP=${2:?step}
WORK=${WORK:-/root/fullsize}
mkdir -p "$OUTDIR" "$WORK"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export FLUXTRT_CACHE=$WORK/cache
CKPT=$WORK/flux1-dev-random
FULL=$WORK/flux1-dev-random-all
# CPU-only builds: no GPU visible (calibration comes from the cache `calibrate` filled), 16 cores
CPU16="env CUDA_VISIBLE_DEVICES= taskset -c 0-15"
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
  checkpoint-all)
    { nproc; free -g | head -2; df -h "$WORK" | tail -1; python3 -c 'import torch; print("torch", torch.__version__)'; } \
      | tee "$OUTDIR/machine.txt"
    $M --label write-random-checkpoint-all --written "$FULL" -- \
      python3 scripts/write_random_checkpoint.py --model random:flux.1-dev --out "$FULL" \
      --components transformer,text_encoder,text_encoder_2,vae --dtype bf16 --device cuda ;;
  calibrate)
    $M --label calibrate-fp8-cuda --written "$WORK/build/calibration" -- \
      python3 -m fluxtrt.cli calibrate --model "$FULL" --out "$WORK/build" --device cuda ;;
  build-fp8|build-bf16|build-fp4)
    P=${STEP#build-}
    GPU=4090; SM=sm89; [ "$P" = fp4 ] && { GPU=5090; SM=sm120; }  # NVFP4 is Blackwell-only
    python3 -c 'import tensorrt_rtx as t; print("tensorrt_rtx", t.__version__)' | tee -a "$OUTDIR/machine.txt"
    $CPU16 $M --label "fluxtrt-build-$P-$SM-cpu16" --written "$WORK/build" -- \
      python3 -m fluxtrt.cli build --gpu $GPU --model "$FULL" -c transformer -p "transformer=$P" --no-validate \
      --out "$WORK/build"
    G="$WORK/build/$GPU"; [ -d "$WORK/build/$GPU-$P" ] && G="$WORK/build/$GPU-$P"  # -p other than the config's
    cp "$G/manifest.json" "$OUTDIR/manifest-$P.json"
    cp "$G/build.log" "$OUTDIR/build-$P.log"
    ls -la "$WORK/build/onnx"/* | tee "$OUTDIR/onnx-files-$P.txt"
    rm -f "$G/transformer.engine" ;;
  static-all)  # every run component for the 5090 at 1024², batch 1 (static profile): the builder's activation
               # and weight reports for the memory table (scripts/memory_table.py); engines deleted after
    $CPU16 $M --label "fluxtrt-build-static-all-sm120-cpu16" --written "$WORK/static" -- \
      python3 -m fluxtrt.cli build --gpu 5090 --model "$FULL" --static-shape --no-validate --out "$WORK/static"
    cp "$WORK/static/5090/manifest.json" "$OUTDIR/manifest-static-5090.json"
    rm -f "$WORK/static/5090/"*.engine ;;
  layers)  # parsed and computed layers of the graphs handed to TensorRT: unfused zero-copy vs fused (bf16),
           # and fp8 quantized from the unfused graph (as before the passes ran on this path) vs the fused one
    H=$(ls -d "$WORK/build/onnx/"*-bf16-zc | head -1); H=$(basename "$H"); H=${H%-bf16-zc}
    python3 -c "from pathlib import Path; import json
from fluxtrt.quantize.native import quantize_linked
amax = json.loads(next(Path('$WORK/build/calibration').glob('*.json')).read_text())['amax']
quantize_linked(Path('$WORK/build/onnx/$H-bf16-zc/transformer.onnx'), Path('$WORK/fp8-unfused'), 'fp8', amax)"
    python3 scripts/layer_counts.py "$WORK/build/onnx/$H-bf16-zc/transformer.onnx" \
      "$WORK/build/onnx/$H-bf16-zc-opt/transformer.onnx" "$WORK/fp8-unfused/transformer.onnx" \
      "$WORK/build/onnx/$H-fp8-zc/transformer.onnx" | tee "$OUTDIR/layers.jsonl"
    rm -rf "$WORK/fp8-unfused" ;;
  validate)  # the graphs of the builds above (bf16 and fp8 transformer) in ONNX Runtime CUDA vs PyTorch on the GPU
    for G in "$WORK/build/4090" "$WORK/build/4090-bf16"; do
      [ -f "$G/manifest.json" ] && $M --label "validate-ort-cuda-$(basename "$G")" -- \
        python3 -m fluxtrt.cli validate --engines "$G" --model "$FULL" --ort-provider cuda --device cuda \
        --json "$OUTDIR/validate-$(basename "$G").jsonl"
    done ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
