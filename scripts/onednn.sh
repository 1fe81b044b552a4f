#!/usr/bin/env bash
# Fetches oneDNN 2.x (Debian's libdnnl2, and the libOpenCL.so.1 its build links) without
# root, for the bf16 products on the CPU's matrix units (README, "bf16 on the CPU"). Unpacks
# the packages under DIR (default target/test-tools/onednn, where streamrl looks for it;
# $STREAMRL_TOOLS_DIR/onednn is the other place it looks) and prints the library's path:
#
#   lib=$(scripts/onednn.sh)          # then STREAMRL_ONEDNN=$lib, or nothing to set
#
# Idempotent: a second run only prints the path. Needs apt-get (downloads only) and dpkg-deb.
set -euo pipefail
dir=${1:-${STREAMRL_TOOLS_DIR:-target/test-tools}/onednn}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
lib=$dir/usr/lib/x86_64-linux-gnu/libdnnl.so.2
if [[ ! -e $lib || ! -e $dir/usr/lib/x86_64-linux-gnu/libOpenCL.so.1 ]]; then
    mkdir -p "$dir/debs"
    (cd "$dir/debs" && apt-get download libdnnl2 ocl-icd-libopencl1 >&2)
    for d in "$dir"/debs/*.deb; do
        dpkg-deb -x "$d" "$dir"
    done
fi
echo "$lib"
