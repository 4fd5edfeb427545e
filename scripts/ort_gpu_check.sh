#!/usr/bin/env bash
# ONNX Runtime on the GPU (issue 20), one call on the lent H200 once onnxruntime-gpu (and diffusers) are staged
# (../shared/device/stage-wheels.sh onnxruntime-gpu==1.31.1 diffusers==0.42.1 ...): the GPU tests, then
# `fluxtrt run --backend onnxruntime --ort-provider cuda` on tiny fp32 engines built elsewhere (the H200 has no
# TensorRT-RTX unless staged): FLUXTRT_TEST_ENGINES names their GPU folder.
# Usage: FLUXTRT_TEST_ENGINES=DIR/4090 bash scripts/ort_gpu_check.sh OUTDIR [pytest -k expression]
set -uo pipefail
OUTDIR=${1:?OUTDIR}; K=${2:-}
mkdir -p "$OUTDIR"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export FLUXTRT_CACHE=/tmp/fluxtrt-cache
python3 -c "import onnxruntime as o, torch, diffusers; print('onnxruntime', o.__version__, o.get_available_providers(),
'torch', torch.__version__, 'diffusers', diffusers.__version__)" | tee "$OUTDIR/versions.txt"
echo "== GPU tests (torch executor, ONNX Runtime CUDA)"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -s ${K:+-k "$K"} 2>&1 | tail -30 | tee "$OUTDIR/gpu_tests.txt"
echo "== fluxtrt run --backend onnxruntime --ort-provider cuda, tiny"
python3 -m fluxtrt.cli run --engines "$FLUXTRT_TEST_ENGINES" --backend onnxruntime --ort-provider cuda \
  --prompt "a red fox in the snow" --steps 4 --height 512 --width 512 --out "$OUTDIR/tiny_ort_cuda.png" 2>&1 \
  | tail -8 | tee "$OUTDIR/run_tiny.txt"
