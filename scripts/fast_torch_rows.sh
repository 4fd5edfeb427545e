#!/usr/bin/env bash
# Issue 42's GPU rows in one background chain that outlives a device call, polled by the calls after it (a call
# runs 10 minutes at most; a warm machine keeps the chain running between calls):
#   bash scripts/fast_torch_rows.sh start; bash scripts/fast_torch_rows.sh poll 520     (first call)
#   bash scripts/fast_torch_rows.sh poll 560                                             (each next call, within 30 s)
# Each poll brings back everything written so far as $OUT/rows.tgz (chain/log: each step's start, end, status).
# Carry .whl (diffusers, onnx-graphsurgeon, polygraphy, pydantic and their missing dependencies as cp312 wheels,
# and scripts/carry_flashinfer.sh's FlashInfer), which scripts/device_env.sh installs. Order: what the issue needs
# first; a cut chain keeps every finished step and every row a step saved.
set -u
cd "$(dirname "$0")/.."
R=/tmp/chain
case "${1:-}" in
start)
  rm -rf $R; mkdir -p $R
  setsid nohup bash "$0" chain > $R/chain.out 2>&1 < /dev/null &
  sleep 3; echo "chain started" ;;
poll)
  limit=${2:-540}; t0=$(date +%s)
  while ! grep -q DONE $R/log 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 10; done
  cat $R/log
  last=$(grep "^==" $R/log | tail -1 | awk '{print $2}')
  [ -n "$last" ] && { echo "--- tail of $last"; tail -15 "$R/$last.log" | cut -c1-400; }
  tar czf "$OUT/rows.tgz" -C /tmp chain ;;
chain)
  OUTDIR=$R source scripts/device_env.sh > $R/env.log 2>&1
  step() { name=$1; shift; echo "== $name $(date +%T)" >> $R/log; ( "$@" ) > $R/$name.log 2>&1; echo "   rc=$? $(date +%T)" >> $R/log; }
  F="python3 scripts/fast_torch.py"
  mkdir -p $R/s1024 $R/acc $R/smore $R/bf16
  step gpu_tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_gelu_quantize.py tests/kernels/test_gelu_quantize.py
  step kernels $F kernels --out $R/kernels.json
  step speed1024 $F speed --shapes 1024x1 --variants diffusers,fp8attn-graph,fp8attn-graph+unfused --profile fp8attn-graph --out $R/s1024/speed.json
  step accuracy $F accuracy --out $R/acc/acc.json
  step speedmore $F speed --shapes 512x1,1024x4 --variants diffusers,fp8attn-graph --out $R/smore/speed.json
  step bf16 $F speed --shapes 1024x1 --variants diffusers,bf16-graph --out $R/bf16/speed.json
  echo DONE >> $R/log ;;
*) echo "usage: bash scripts/fast_torch_rows.sh start | poll SECONDS" >&2; exit 2 ;;
esac
