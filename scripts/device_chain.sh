#!/usr/bin/env bash
# Device rows in one background chain that outlives a device call, polled by the calls after it (a call runs 10
# minutes at most; a warm machine keeps the chain running between calls):
#   bash scripts/device_chain.sh start STEP...; bash scripts/device_chain.sh poll 520     (first call)
#   bash scripts/device_chain.sh poll 560                                                  (each next call, within 30 s)
# Each poll brings back everything written so far as $OUT/rows.tgz (chain/log: each step's start, end, status).
# Carry .whl (diffusers, onnx-graphsurgeon, polygraphy, pydantic and their missing dependencies as cp312 wheels,
# and scripts/carry_flashinfer.sh's FlashInfer), which scripts/device_env.sh installs. The steps run in the order
# given; a cut chain keeps every finished step and every row a step saved.
#   issue 42's speed rows (run 13): start gpu_tests kernels speed1024 accuracy speedmore bf16
#   the new kernels' tests, fp8-attn packages, the single-stream kernel's A/B and the batch-4 profile:
#     start gpu_tests norm_ab fa_tests packages      (norm_ab profiles fp8attn-graph at both shapes)
#   the same rows without the A/B and profiles, on less device time: start gpu_tests fa_tests targets
#   the one unmet end-to-end target alone (1024² batch 4, with its profile), on the least: start gpu_tests b4
# Rehearse on a CPU: OUT=/tmp/o bash scripts/device_chain.sh steps (lists the steps and their commands)
set -u
cd "$(dirname "$0")/.."
R=/tmp/chain
F="python3 scripts/fast_torch.py"
declare -A CMD=(
  [gpu_tests]="python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_gelu_quantize.py tests/kernels/test_gelu_quantize.py tests/kernels/test_triton_norm_rope_quantize.py tests/kernels/test_norm_rope_quantize.py"
  [fa_tests]="python3 -m pytest -q -p no:cacheprovider tests/kernels/test_flashinfer_fp8_attention.py"
  [kernels]="$F kernels --out $R/kernels.json"
  [speed1024]="$F speed --shapes 1024x1 --variants diffusers,fp8attn-graph,fp8attn-graph+unfused --profile fp8attn-graph --out $R/s1024/speed.json"
  [accuracy]="$F accuracy --out $R/acc/acc.json"
  [speedmore]="$F speed --shapes 512x1,1024x4 --variants diffusers,fp8attn-graph --out $R/smore/speed.json"
  [bf16]="$F speed --shapes 1024x1 --variants diffusers,bf16-graph --out $R/bf16/speed.json"
  [packages]="env OUTDIR=$R/packages BRIEF=1 bash scripts/aot_rows.sh fp8-attn"
  [targets]="$F speed --shapes 1024x1,1024x4 --variants diffusers,fp8attn-graph --out $R/targets/speed.json"
  [b4]="$F speed --shapes 1024x4 --variants diffusers,fp8attn-graph --profile fp8attn-graph --out $R/b4/speed.json"
  [norm_ab]="$F speed --shapes 1024x1,1024x4 --variants diffusers,fp8attn-graph,fp8attn-graph+unfusednorm --profile fp8attn-graph --out $R/norm/speed.json"
)
case "${1:-}" in
start)
  shift
  for s in "$@"; do [ -n "${CMD[$s]:-}" ] || { echo "no step $s; the steps: ${!CMD[*]}" >&2; exit 2; }; done
  [ $# -gt 0 ] || { echo "name the steps: ${!CMD[*]}" >&2; exit 2; }
  rm -rf $R; mkdir -p $R
  setsid nohup bash "$0" chain "$@" > $R/chain.out 2>&1 < /dev/null &
  sleep 3; echo "chain started: $*" ;;
poll)
  limit=${2:-540}; t0=$(date +%s)
  while ! grep -q DONE $R/log 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 10; done
  cat $R/log
  last=$(grep "^==" $R/log | tail -1 | awk '{print $2}')
  [ -n "$last" ] && { echo "--- tail of $last"; tail -15 "$R/$last.log" | cut -c1-400; }
  tar czf "$OUT/rows.tgz" -C /tmp chain ;;
steps)
  for s in "${!CMD[@]}"; do echo "$s: ${CMD[$s]}"; done ;;
chain)
  shift
  OUTDIR=$R source scripts/device_env.sh > $R/env.log 2>&1
  for name in "$@"; do
    echo "== $name $(date +%T)" >> $R/log
    ( eval "${CMD[$name]}" ) > $R/$name.log 2>&1
    echo "   rc=$? $(date +%T)" >> $R/log
  done
  echo DONE >> $R/log ;;
*) echo "usage: bash scripts/device_chain.sh start STEP... | poll SECONDS | steps" >&2; exit 2 ;;
esac
