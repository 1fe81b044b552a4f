#!/usr/bin/env bash
# Fetches what a `--features cuda` build needs, without a system CUDA toolkit and without
# root: nvcc, its headers and the CUDA runtime, from NVIDIA's PyPI wheels (CUDA 13.0, the
# version of the GPU machines' driver: newer PTX may not load there). Unpacks them under
# DIR (default target/cuda-toolkit) and prints the CUDA root to use:
#
#   root=$(scripts/cuda-toolkit.sh)
#   CUDA_ROOT=$root PATH=$root/bin:$PATH LD_LIBRARY_PATH=$root/lib cargo build --features cuda
#
# Idempotent: a second run only prints the root. Needs python3 with pip (downloads only).
set -euo pipefail
dir=${1:-target/cuda-toolkit}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
root=$dir/nvidia/cu13
if [[ ! -x $root/bin/nvcc || ! -e $root/lib/libcudart.so.13 ]]; then
    wheels=$dir/wheels
    mkdir -p "$wheels"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 -d "$wheels" \
        "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" \
        "nvidia-nvvm==13.0.*" "nvidia-cuda-cccl==13.0.*" >&2
    for w in "$wheels"/*.whl; do
        python3 -m zipfile -e "$w" "$dir" >&2
    done
    chmod +x "$root"/bin/* "$root"/nvvm/bin/*
fi
echo "$root"
