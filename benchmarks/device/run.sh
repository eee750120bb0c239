#!/bin/bash
# On a GPU machine with nvcc, cmake and ninja but no network, from the checkout's root with .gpu/
# (benchmarks/device/prepare.sh) beside it: builds the patched engine for CUDA (sm_90 unless
# CUDA_ARCH says otherwise), then runs the residency round trip with real VRAM and the handoff
# benchmark on a random-weight model, writing JSON and logs to $OUT (default ./device-out).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/device-out}"
ARCH="${CUDA_ARCH:-90}"
MODEL_MB="${MODEL_MB:-1500}"
mkdir -p "$OUT"
began=$SECONDS
{ nvidia-smi; nproc; python3 --version; nvcc --version; } >"$OUT/machine.txt" 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/arbiterd-site \
    .gpu/whl/*.whl || exit 3

# cuBLAS as the machine has it (a toolkit's lib64, or a Python package's lib folder).
cublas="$(find / -name 'libcublas.so.1[0-9]' -not -path '/proc/*' 2>/dev/null | head -n 1)"
links=/tmp/arbiterd-cublas
mkdir -p "$links"
for lib in libcublas libcublasLt; do
    ln -sf "$(dirname "$cublas")/$lib.so.${cublas##*.so.}" "$links/$lib.so"
done
include="$(dirname "$(find / -name cublas_v2.h -not -path '/proc/*' 2>/dev/null | head -n 1)")"
# shellcheck disable=SC2016  # $ORIGIN is the loader's, not the shell's
cmake -S .gpu/llama.cpp -B /tmp/arbiterd-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF -DCMAKE_INSTALL_RPATH='$ORIGIN' \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCUDA_cublas_LIBRARY="$links/libcublas.so" \
    -DCUDA_cublasLt_LIBRARY="$links/libcublasLt.so" -DCMAKE_CUDA_FLAGS="-I$include" \
    -DCMAKE_CXX_FLAGS="-I$include" >"$OUT/cmake.log" 2>&1 || { tail -n 40 "$OUT/cmake.log"; exit 4; }
ninja -C /tmp/arbiterd-build llama >"$OUT/build.log" 2>&1 || { tail -n 60 "$OUT/build.log"; exit 5; }
echo "engine built in $((SECONDS - began)) s"

cp -r .gpu/site/llama_cpp /tmp/arbiterd-site/
mkdir -p /tmp/arbiterd-site/llama_cpp/lib
cp -a /tmp/arbiterd-build/bin/*.so* /tmp/arbiterd-site/llama_cpp/lib/
export PYTHONPATH="/tmp/arbiterd-site:$PWD"
LD_LIBRARY_PATH="$(dirname "$cublas"):${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH
python3 -c "from arbiterd import engine; print(engine.engine_info())" || exit 6

model=/tmp/arbiterd-random.gguf
python3 -c "
from pathlib import Path
from benchmarks.residency_roundtrip import random_model
random_model($MODEL_MB, Path('/tmp')).rename('$model')" || exit 7

timeout 240 python3 -m benchmarks.residency_roundtrip --model "$model" --n-gpu-layers -1 \
    --rounds 3 --out "$OUT/residency_roundtrip.json" >"$OUT/residency_roundtrip.log" 2>&1
echo "residency_roundtrip: exit $?"
# shellcheck disable=SC2086  # HANDOFF_ARGS is words on purpose
timeout 240 python3 -m benchmarks.worker_handoff --model "$model" --n-gpu-layers -1 \
    ${HANDOFF_ARGS:-} --out "$OUT/worker_handoff.json" >"$OUT/worker_handoff.log" 2>&1
echo "worker_handoff: exit $?"
echo "done in $((SECONDS - began)) s"
