#!/usr/bin/env bash
# The README's main job: build and run the reference transformer through triattn::KvCache.
# Uses stories260K from ../shared/data/models when present (else the synthetic model), the GPU
# path when a GPU and nvcc are present, the CPU path otherwise. Extra arguments go to the program.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
B=${BUILD:-build-demo}
missing=()
for p in cmake g++ ninja-build doctest-dev libbenchmark-dev; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH
# The CUDA build is only worth its compile time where a GPU will run it.
CUDA=OFF; DEVICE=cpu
if command -v nvcc >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  CUDA=ON; DEVICE=gpu
fi
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRIATTN_ENABLE_CUDA=$CUDA \
      -DTRIATTN_BUILD_TESTS=OFF -DTRIATTN_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$B" -j "$JOBS" --target reference_transformer
exec "$B/examples/reference_transformer/reference_transformer" --device "$DEVICE" "$@"
