#!/usr/bin/env bash
# Fetches oneDNN 3.2 (Intel's `onednn-cpu-gomp` wheel from PyPI: the library alone, on GNU
# OpenMP, no other dependency) without root, for the bf16 products on the CPU's matrix
# units (README, "bf16 on the CPU"). Unpacks it under DIR (default target/test-tools/onednn,
# where streamrl looks for it; $STREAMRL_TOOLS_DIR/onednn is the other place it looks) and
# prints the library's path:
#
#   lib=$(scripts/onednn.sh)          # then STREAMRL_ONEDNN=$lib, or nothing to set
#
# Idempotent: a second run only prints the path. Needs python3 with pip (downloads only).
set -euo pipefail
version=2023.2.0
dir=${1:-${STREAMRL_TOOLS_DIR:-target/test-tools}/onednn}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
# The library lands in DIR/lib, whatever the wheel's version (where streamrl looks).
lib=$dir/lib/libdnnl.so.3
if [[ ! -e $lib ]]; then
    python3 -m pip download --quiet --no-deps "onednn-cpu-gomp==$version" -d "$dir/wheel" >&2
    python3 -m zipfile -e "$dir/wheel/onednn_cpu_gomp-$version-"*.whl "$dir/wheel"
    rm -rf "$dir/lib"
    mv "$dir/wheel/onednn_cpu_gomp-$version.data/data/lib" "$dir/lib"
    rm -rf "$dir/wheel"
fi
echo "$lib"
