#!/usr/bin/env bash
# The GPU check: streamrl's CUDA path on a GPU machine, as one prepared call.
#
#   scripts/gpu-check.sh build        # here (no GPU needed): release binary, --features cuda,
#                                     # stripped and xz-packed, with the CUDA runtime beside it,
#                                     # in target/gpu-check
#   scripts/gpu-check.sh run [DIR]    # on the GPU machine (no Rust there): runs DIR/streamrl
#   scripts/gpu-check.sh rl GGUF [DIR] # on the GPU machine: topologies/smollm2.yaml end to end
#                                     # on cuda:0 (SFT, rollout, trainer) from the SmolLM2 GGUF
#
# `run` prints the GPU, then `streamrl bench gpu`'s one table: the fused RL kernels' parity
# with their CPU references (values and gradients; it exits non-zero if one fails) and their
# GB/s, and training and decode tokens/s of the tiny, small and SmolLM2-135M shapes in bf16
# against PyTorch + transformers on the same GPU. Extra arguments go to `streamrl bench gpu`.
# With the `device` tool: carry target/gpu-check, command `scripts/gpu-check.sh run`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-check

case "${1:-}" in
build)
    root=$(scripts/cuda-toolkit.sh)
    # Hopper (H100/H200): candle's kernels as sm_90a code, streamrl's as compute_90 PTX.
    CUDA_ROOT=$root PATH=$root/bin:$PATH CUDA_COMPUTE_CAP=90 RAYON_NUM_THREADS=$(nproc) \
        cargo build --release --features cuda --bin streamrl
    mkdir -p "$out"
    # The stripped release binary is ~150 MB (148 MB measured for the CPU build), over the
    # device tool's 64 MiB carry limit; xz packs it to about a fifth (26.6 MB for the CPU
    # build).
    strip -o "$out/streamrl.bin" target/release/streamrl
    xz -T0 -6 -f "$out/streamrl.bin"
    cp -L "$root/lib/libcudart.so.13" "$out/"
    ls -la "$out"
    du -sh "$out"
    ;;
run | rl)
    what=$1
    if [[ $what == rl ]]; then
        gguf=${2:?usage: scripts/gpu-check.sh rl GGUF [DIR]}
        shift
    fi
    dir=${2:-$out}
    shift $(( $# > 1 ? 2 : 1 ))
    # libcudart from beside the binary; cuBLAS, cuRAND and NVRTC (opened at run time by
    # cudarc) from the system CUDA or PyTorch's wheels, whichever is there.
    torch_libs=$(python3 - <<'PY' 2>/dev/null || true
import glob, os
try:
    import nvidia
    roots = [os.path.dirname(p) for p in nvidia.__path__]
    print(":".join(sorted({os.path.dirname(l) for r in roots for l in glob.glob(r + "/nvidia/**/lib/*.so*", recursive=True)})))
except Exception:
    pass
PY
)
    if [[ -e $dir/streamrl.bin.xz ]]; then
        bin=$(mktemp -d)/streamrl
        xz -dc "$dir/streamrl.bin.xz" > "$bin"
        chmod +x "$bin"
    else
        bin=$dir/streamrl
    fi
    export LD_LIBRARY_PATH="$dir:/usr/local/cuda/lib64:${torch_libs}:${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    if [[ $what == run ]]; then
        "$bin" bench gpu --device cuda:0 --dtype bf16 --preset tiny,small,smollm2 "$@"
        exit
    fi
    # The SmolLM2 recipe with every model on the GPU, from a fresh import, then the final
    # policy's greedy accuracy on 200 held-out problems (as the README's CPU run).
    rm -rf runs/smollm2
    "$bin" model import --gguf "$gguf" --out runs/smollm2/base
    cuda=(--set sft.device=cuda --set stages.rollout.config.device=cuda
        --set stages.trainer.config.train.device=cuda "$@")
    start=$SECONDS
    "$bin" run -t topologies/smollm2.yaml "${cuda[@]}"
    echo "run: $((SECONDS - start)) s wall"
    last=$(ls -d runs/smollm2/checkpoints/step-* | sort | tail -1)
    "$bin" eval -t topologies/smollm2.yaml --env arith --checkpoint "$last" \
        --n 200 --k 4 --max-tokens 32 --device cuda --dtype bf16
    ;;
*)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
