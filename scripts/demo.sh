#!/usr/bin/env bash
# The README's main job: build and run the reference transformer through triattn::KvCache.
# Uses stories260K from ../shared/data/models when present (else the synthetic model), the GPU
# path when a GPU and nvcc are present, the CPU path otherwise. Without arguments it shows the
# whole path: calibrate query statistics, then generate with compression on. Arguments replace
# that with one run of the program with them (e.g. `--steps 64`, `--help`).
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
BIN="$B/examples/reference_transformer/reference_transformer"
# With arguments: one run with them. Without: the whole path in two runs.
if [ $# -gt 0 ]; then exec "$BIN" --device "$DEVICE" "$@"; fi
STATS="$B/demo_query_stats.safetensors"
printf '\n=== 1/2 calibration: pre-RoPE query statistics over an uncompressed greedy run (CPU) ===\n'
"$BIN" --device cpu --calibrate "$STATS" --steps 512 --quiet
printf '\n=== 2/2 generation with TriAttention compression (%s): budget 128, a round every 32 tokens ===\n' "$DEVICE"
"$BIN" --device "$DEVICE" --stats "$STATS" --budget 128 --divide-length 32 --steps 400
