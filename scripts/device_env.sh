# Sourced by the device scripts: install carried wheels (.whl/) and set the environment for fluxtrt from this
# checkout (no install needed: python3 -m fluxtrt.cli).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  for t in .whl/*.tar.xz; do [ -e "$t" ] && tar xJf "$t" -C /tmp/site; done  # packed packages (carry_flashinfer.sh)
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export FLUXTRT_CACHE=/tmp/fluxtrt-cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
FLUXTRT="python3 -m fluxtrt.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUTDIR/gpu.txt"
