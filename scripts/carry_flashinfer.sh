#!/usr/bin/env bash
# FlashInfer for the lent Hopper machine, small enough to carry (issue 42: fp8-attn's FA3 FP8 kernel).
# flashinfer-python's wheel is 101 MB, over a call's 64 MiB carry; fluxtrt uses one JIT-built kernel of it
# (single-request FP8 prefill, FA3 template): its Python package, headers, CUTLASS/CCCL headers and the four
# source templates of that kernel. This keeps those, drops the other kernels' sources, and packs the rest
# (16 MB as tar.xz) beside apache-tvm-ffi (cp312) and the small pure-Python dependencies the import needs, in
# DIR (default .whl, which scripts/device_env.sh installs: wheels with pip, *.tar.xz unpacked into /tmp/site).
# The kernel compiles on first use there (nvcc on the device image; its five sources took about a minute each on
# one core of this machine), cached under ~/.cache.
# Usage (on your machine, in the project's root): bash scripts/carry_flashinfer.sh [DIR]
set -euo pipefail
dir=${1:-.whl}
version=0.7.4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$dir"
python3 -m pip download -q --no-deps -d "$work" "flashinfer-python==$version"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$dir" "apache-tvm-ffi>=0.1.11,<0.2" einops tabulate nvidia-ml-py
python3 -m zipfile -e "$work"/flashinfer_python-*.whl "$work/x"
pkg="$work/x/flashinfer"
# compiled sources of the other kernels: not read by the import, only by their own JIT
find "$pkg" -not -path "$pkg/data/*" -type f \( -name "*.cu" -o -name "*.cuh" -o -name "*.h" -o -name "*.cpp" \
  -o -name "*.hpp" -o -name "*.cc" -o -name "*.cubin" -o -name "*.so" -o -name "*.ptx" \) -delete
# data/csrc: the shared headers and the sm90 single-prefill templates only
find "$pkg/data/csrc" -maxdepth 1 -type f ! -name "*.h" ! -name "*.cuh" ! -name "single_prefill_*sm90*" -delete
find "$pkg/data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
tar cJf "$dir/flashinfer-$version-pruned.tar.xz" -C "$work/x" flashinfer
du -sh "$dir/flashinfer-$version-pruned.tar.xz"
