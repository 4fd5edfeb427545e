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
# ONNX Runtime on the GPU (issue 20; onnxruntime-gpu staged), after checkpoint-all (+ calibrate, build-fp8):
#   bash scripts/fullsize_footprint.sh OUTDIR build-others    # clip, t5, vae_decoder, vae_encoder for the 4090 (its
#                                                   # config's precisions) to $WORK/build2; engines deleted (disk)
#   bash scripts/fullsize_footprint.sh OUTDIR bf16-graph      # the zero-copy bf16 transformer graph `build -p
#                                                   # transformer=bf16` hands TensorRT (export + graph passes, no engine)
#   bash scripts/fullsize_footprint.sh OUTDIR bf16-entry      # after build-fp4 or bf16-graph: that graph entered in
#                                                   # build2's manifest (no 24 GB bf16 engine: the disk holds 64 GB)
#   bash scripts/fullsize_footprint.sh OUTDIR validate        # fluxtrt validate --ort-provider cuda, each component
#                                                   # (COMPONENTS="t5 ..." some; FP32=1: --fp32, bf16 graphs in fp32)
#   bash scripts/fullsize_footprint.sh OUTDIR validate-fp8    # the same for build-fp8's transformer
#   bash scripts/fullsize_footprint.sh OUTDIR generate        # 28 steps at 1024² on ORT CUDA vs diffusers bf16
#   bash scripts/fullsize_footprint.sh OUTDIR bench-ort       # fluxtrt bench on ORT CUDA, --baseline diffusers
# Work files go to $WORK (default /root/fullsize); results are appended to OUTDIR/footprint.jsonl. CPU-only
# builds use the cores in $CORES (default 0-15; two builds side by side: 0-7 and 8-15).
set -uo pipefail
OUTDIR=${1:?OUTDIR}; STEP=${2:?step}
WORK=${WORK:-/root/fullsize}
mkdir -p "$OUTDIR" "$WORK"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export FLUXTRT_CACHE=$WORK/cache
CKPT=$WORK/flux1-dev-random
FULL=$WORK/flux1-dev-random-all
# CPU-only builds: no GPU visible (calibration comes from the cache `calibrate` filled), 16 cores
CORES=${CORES:-0-15}
# the ONNX Runtime steps: provider, PyTorch device, image size and steps (a CPU rehearsal on a small model:
# PROVIDER=cpu DEVICE=cpu SIZE=256 STEPS=3 DTYPE=fp32)
PROVIDER=${PROVIDER:-cuda}; DEVICE=${DEVICE:-cuda}; SIZE=${SIZE:-1024}; STEPS=${STEPS:-28}; DTYPE=${DTYPE:-bf16}
CPU16="env CUDA_VISIBLE_DEVICES= taskset -c $CORES"
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
    [ -f "$FULL/model_index.json" ] && { echo "$FULL exists: kept"; exit 0; }
    { nproc; free -g | head -2; df -h "$WORK" | tail -1; python3 -c 'import torch; print("torch", torch.__version__)'; } \
      | tee "$OUTDIR/machine.txt"
    $M --label write-random-checkpoint-all --written "$FULL" -- \
      python3 scripts/write_random_checkpoint.py --model random:flux.1-dev --out "$FULL" \
      --components transformer,text_encoder,text_encoder_2,vae --dtype bf16 --device cuda ;;
  calibrate)
    $M --label calibrate-fp8-$DEVICE --written "$WORK/build/calibration" -- \
      python3 -m fluxtrt.cli calibrate --model "$FULL" --out "$WORK/build" --device $DEVICE ;;
  build-fp8|build-bf16|build-fp4)
    P=${STEP#build-}
    GPU=4090; SM=sm89; [ "$P" = fp4 ] && { GPU=5090; SM=sm120; }  # NVFP4 is Blackwell-only
    python3 -c 'import tensorrt_rtx as t; print("tensorrt_rtx", t.__version__)' | tee -a "$OUTDIR/machine.txt"
    $CPU16 $M --label "fluxtrt-build-$P-$SM-cores-$CORES" --written "$WORK/build" -- \
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
from fluxtrt.quantize.zerocopy import quantize_zero_copy
amax = json.loads(next(Path('$WORK/build/calibration').glob('*.json')).read_text())['amax']
quantize_zero_copy(Path('$WORK/build/onnx/$H-bf16-zc/transformer.onnx'), Path('$WORK/fp8-unfused'), 'fp8', amax)"
    python3 scripts/layer_counts.py "$WORK/build/onnx/$H-bf16-zc/transformer.onnx" \
      "$WORK/build/onnx/$H-bf16-zc-opt/transformer.onnx" "$WORK/fp8-unfused/transformer.onnx" \
      "$WORK/build/onnx/$H-fp8-zc/transformer.onnx" | tee "$OUTDIR/layers.jsonl"
    rm -rf "$WORK/fp8-unfused" ;;
  build-others)  # its own root and cache, so it can run beside build-fp4/build-fp8 (on other cores); each
                 # engine is deleted once built (ONNX Runtime runs the ONNX; the manifest keeps every entry)
    export FLUXTRT_CACHE=$WORK/cache2
    for C in ${COMPONENTS:-clip t5 vae_decoder vae_encoder}; do
      $CPU16 $M --label "fluxtrt-build-$C-sm89-cores-$CORES" --written "$WORK/build2" -- \
        python3 -m fluxtrt.cli build --gpu 4090 --model "$FULL" -c $C --no-validate --out "$WORK/build2"
      rm -f "$WORK/build2/4090/"*.engine
    done
    cp "$WORK/build2/4090/manifest.json" "$OUTDIR/manifest-others-4090.json" ;;
  bf16-graph)  # the stages `build -p transformer=bf16` runs before TensorRT (zero-copy export, graph passes) into
               # $WORK/build, on the CPU; no engine
    $CPU16 $M --label "bf16-transformer-graph-cores-$CORES" --written "$WORK/build" -- python3 -c "
from pathlib import Path
from fluxtrt.models.source import resolve_model
from fluxtrt.records import CalibrationSettings
from fluxtrt.stages.zerocopy_plan import ensure_zero_copy
path, res = ensure_zero_copy(resolve_model('$FULL'), 'transformer', 'bf16', Path('$WORK/build'), False, print,
                          CalibrationSettings(), validate=False)
print(path, *res, sep='\n')" ;;
  bf16-entry)  # the graph `build -p transformer=bf16` hands TensorRT (the bf16-zc-opt stage of build-fp4 or
               # bf16-graph) entered in build2's 4090 manifest, from the fp4 build's transformer entry (same
               # profile) or, without one, $TEMPLATE's (default: the full-size bf16 build's, kept in docs/bench)
    python3 - "$WORK" "${TEMPLATE:-docs/bench/fullsize_manifest_bf16_fused.json}" <<'PY'
import json, sys
from pathlib import Path
from fluxtrt.fileio import sha256_file
w = Path(sys.argv[1])
template = next((w / "build").glob("5090*/manifest.json"), Path(sys.argv[2]))
entry = json.loads(template.read_text())["components"]["transformer"]
opt = next((w / "build" / "onnx").glob("*-bf16-zc-opt"))
link = w / "build2" / "onnx" / opt.name  # holds build2's own T5 graph: the transformer's files linked beside it
link.mkdir(parents=True, exist_ok=True)
for f in opt.glob("transformer.*"):
    if not (link / f.name).exists():
        (link / f.name).symlink_to(f)
entry.update(onnx=f"onnx/{opt.name}/transformer.onnx", onnx_sha256=sha256_file(link / "transformer.onnx"),
             precision="bf16", quantization=None)
path = w / "build2" / "4090" / "manifest.json"
m = json.loads(path.read_text())
m["components"]["transformer"] = entry
path.write_text(json.dumps(m, indent=1))
print("transformer entry:", entry["onnx"])
PY
    ;;
  validate)  # each component's graph in ONNX Runtime CUDA vs PyTorch on the GPU, one process per component
    X=; [ "${FP32:-0}" = 1 ] && X=-fp32
    for C in ${COMPONENTS:-clip t5 transformer vae_decoder vae_encoder}; do
      $M --label "validate-ort-$PROVIDER-4090-$C$X" -- \
        python3 -m fluxtrt.cli validate --engines "$WORK/build2/4090" -c $C --model "$FULL" \
        --ort-provider $PROVIDER --device $DEVICE ${X:+--fp32} --json "$OUTDIR/validate-4090-$C$X.jsonl"
    done ;;
  validate-fp8)  # after build-fp8: the Q/DQ graph (run widened to fp32) vs the fake-quant and unquantized module
    $M --label "validate-ort-cuda-4090-fp8-transformer" -- \
      python3 -m fluxtrt.cli validate --engines "$WORK/build/4090-fp8" -c transformer --model "$FULL" \
      --ort-provider $PROVIDER --device $DEVICE --json "$OUTDIR/validate-4090-fp8-transformer.jsonl" ;;
  generate)
    $M --label "generate-$SIZE-$STEPS-ort-$PROVIDER-vs-diffusers-$DTYPE" -- \
      python3 scripts/fullsize_generation.py --engines "$WORK/build2/4090" --model "$FULL" --provider $PROVIDER \
      --device $DEVICE --size $SIZE --steps $STEPS --dtype $DTYPE --json "$OUTDIR/generation.jsonl" \
      --image "$OUTDIR/generation" ;;
  bench-ort)
    python3 -m fluxtrt.cli bench --engines "$WORK/build2/4090" --backend onnxruntime --ort-provider $PROVIDER \
      --baseline diffusers --torch-dtype $DTYPE --sizes $SIZE --steps $STEPS --runs 2 --warmup 1 \
      --json "$OUTDIR/bench-ort-$PROVIDER.json" ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
