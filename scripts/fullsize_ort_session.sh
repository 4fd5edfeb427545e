#!/usr/bin/env bash
# The full-size measurements of issues 20 and 21 in one lease of the lent H200, as one background job that
# survives between calls (start it with setsid; poll with `fullsize_ort_session.sh OUTDIR poll SECONDS`):
# the random checkpoint and calibration on the GPU, then two CPU lanes side by side (cores 0-7: the fp4
# build for the 5090, then the fp8 transformer for the 4090; cores 8-15: the other components for the 4090),
# and on the GPU, as their graphs appear: validation of the other components, then (after the fp4 build)
# of the bf16 transformer graph, a whole generation and timings on ONNX Runtime CUDA, then (after the fp8
# build) of the fp8 graph. TensorRT-RTX and onnxruntime-gpu
# must be staged in /tmp/site first. Each step's start and end go to OUTDIR/steps.log.
#   setsid nohup bash scripts/fullsize_ort_session.sh OUTDIR run > OUTDIR/run.log 2>&1 &
#   bash scripts/fullsize_ort_session.sh OUTDIR poll 540   # waits up to 540 s, then packs OUTDIR into $OUT
# MODE rest instead of run: only what the first run left (see below).
set -uo pipefail
OUTDIR=${1:?OUTDIR}; MODE=${2:?run or poll}
WORK=${WORK:-/root/fullsize}
F="bash scripts/fullsize_footprint.sh $OUTDIR"
step() { echo "$(date +%T) start $*" >> "$OUTDIR/steps.log"; "$@"; local rc=$?; echo "$(date +%T) end $* rc=$rc" >> "$OUTDIR/steps.log"; }
# the graphs without a TensorRT-RTX transformer engine: the checkpoint, then the bf16 transformer graph (cores
# 0-7) beside the builds of the components in $1 (cores 8-15: a manifest to enter the graph in), then its entry
graphs() {
  mkdir -p "$OUTDIR"
  step $F checkpoint-all
  CORES=0-7 step $F bf16-graph > "$OUTDIR/lane1.log" 2>&1 &
  local lane1=$!
  CORES=8-15 COMPONENTS="$1" step $F build-others > "$OUTDIR/lane2.log" 2>&1
  "${@:2}"  # GPU work that needs only the other components, while the graph is made
  wait $lane1
  step $F bf16-entry
}
case "$MODE" in
  run)
    mkdir -p "$OUTDIR"
    step $F checkpoint-all
    step $F calibrate
    ( CORES=0-7 step $F build-fp4; rm -rf "$WORK"/build/onnx/*-fp4-zc; CORES=0-7 step $F build-fp8 ) \
      > "$OUTDIR/lane1.log" 2>&1 &
    lane1=$!
    CORES=8-15 step $F build-others > "$OUTDIR/lane2.log" 2>&1
    COMPONENTS="clip t5 vae_decoder vae_encoder" step $F validate
    while ! ls "$WORK"/build/5090*/manifest.json >/dev/null 2>&1 && kill -0 $lane1 2>/dev/null; do sleep 5; done
    step $F bf16-entry
    COMPONENTS=transformer step $F validate
    step $F generate
    step $F bench-ort
    wait $lane1
    step $F validate-fp8
    echo "$(date +%T) all done" >> "$OUTDIR/steps.log" ;;
  rest)  # what the first run left of issue 20 (no calibration): T5 computed in fp32 (validate --fp32), the
         # whole generation on ORT CUDA, the transformer in fp32
    graphs "clip t5 vae_decoder" step env FP32=1 COMPONENTS=t5 $F validate
    step $F generate
    FP32=1 COMPONENTS=transformer step $F validate
    echo "$(date +%T) all done" >> "$OUTDIR/steps.log" ;;
  fp32)  # the bf16 transformer graph computed in fp32 (validate --fp32) alone (CLIP built for its manifest)
    graphs clip true
    FP32=1 COMPONENTS=transformer step $F validate
    echo "$(date +%T) all done" >> "$OUTDIR/steps.log" ;;
  poll)
    end=$((SECONDS + ${3:-540}))
    while [ $SECONDS -lt $end ] && ! grep -q "all done" "$OUTDIR/steps.log" 2>/dev/null; do sleep 5; done
    cat "$OUTDIR/steps.log"; free -g | head -2; df -h "$WORK" | tail -1; nvidia-smi --query-gpu=memory.used --format=csv
    tail -n 3 "$OUTDIR"/*.log
    tar czf "$OUT/results.tgz" -C "$OUTDIR" --exclude='*.png' . && cp "$OUTDIR"/*.png "$OUT/" 2>/dev/null; ls -la "$OUT" ;;
esac
