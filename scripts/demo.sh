#!/usr/bin/env bash
# The README's main job: build and run the reference transformer through triattn::KvCache.
# Uses SmolLM2-135M-Instruct (GGUF) from ../shared/data/models when present, else stories260K
# (else the synthetic model), the GPU path when a GPU and nvcc are present, the CPU path
# otherwise. Without arguments it shows the whole path: calibrate query statistics on real text,
# then answer a question about a long document with the full KV cache and with TriAttention
# compression (each round and the memory saved are printed). Arguments replace that with one run
# of the program with them (e.g. `--steps 64`, `--help`).
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
TARGETS=(reference_transformer)
[ "$DEVICE" = gpu ] && TARGETS+=(serving)  # the serving run below needs a GPU to be short
cmake --build "$B" -j "$JOBS" --target "${TARGETS[@]}"
BIN="$B/examples/reference_transformer/reference_transformer"
# On a GPU, the demo ends with a short serving run (examples/serving/README.md): 32 requests
# arriving at once into a 256 MB KV pool, full KV against TriAttention, on an 8-layer model of
# Qwen3-8B's width (random bf16 weights), and its table.
serving_demo() {
  [ "$DEVICE" = gpu ] || return 0
  printf '\n=== serving: 32 requests, 256 MB of KV, full KV vs TriAttention (budget 256), gpu ===\n'
  "$B/examples/serving/serving" --device gpu --synthetic qwen3-8b-like --synthetic-layers 8 --synthetic-vocab 32000 \
      --weight-dtype bf16 --workload reasoning --requests 32 --scale 0.0625 --kv-limit 256M \
      --configs full,tri --budget 256 --divide-length 64 --progress 5
}
# With arguments: one run with them. Without: the whole path in two runs.
if [ $# -gt 0 ]; then exec "$BIN" --device "$DEVICE" "$@"; fi
DATA=../shared/data
GGUF=$DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$GGUF" ] && [ -f "$DATA/text/shakespeare.txt" ] && [ -f "$DATA/text/pride_and_prejudice.txt" ]; then
  # SmolLM2-135M-Instruct: calibration text (Shakespeare) and the document (Pride and Prejudice)
  # are different works, so nothing is tuned on the text the question is about.
  STATS="$B/demo_smollm2_stats.safetensors"
  CALIB="$B/demo_calibration.txt"
  DOC="$B/demo_question.txt"
  head -c 4000 "$DATA/text/shakespeare.txt" > "$CALIB"
  { sed -n '/^It is a truth universally acknowledged/,+98p' "$DATA/text/pride_and_prejudice.txt"
    printf '\nQuestion: According to the passage above, what is the name of the young man who has taken '
    printf 'Netherfield Park? Answer in one sentence.'; } > "$DOC"
  printf '\n=== 1/3 calibration: SmolLM2 pre-RoPE query statistics over 4 KB of Shakespeare (CPU) ===\n'
  "$BIN" --device cpu --model "$GGUF" --no-chat --prompt-file "$CALIB" --steps 1 --quiet --calibrate "$STATS"
  printf '\n=== 2/3 a question about a ~1,100-token chapter of Pride and Prejudice, full KV cache (%s) ===\n' "$DEVICE"
  "$BIN" --device "$DEVICE" --model "$GGUF" --prompt-file "$DOC" --steps 48 --no-compress
  printf '\n=== 3/3 the same with TriAttention: budget 256, a round every 64 tokens, the document compressible (%s) ===\n' "$DEVICE"
  "$BIN" --device "$DEVICE" --model "$GGUF" --prompt-file "$DOC" --steps 48 --stats "$STATS" --budget 256 \
         --divide-length 64 --prompt-mode compete --report-every 8
  serving_demo
  exit 0
fi
# Fast fallback: stories260K (or the synthetic model).
STATS="$B/demo_query_stats.safetensors"
printf '\n=== 1/2 calibration: pre-RoPE query statistics over an uncompressed greedy run (CPU) ===\n'
"$BIN" --device cpu --calibrate "$STATS" --steps 512 --quiet
printf '\n=== 2/2 generation with TriAttention compression (%s): budget 128, a round every 32 tokens ===\n' "$DEVICE"
"$BIN" --device "$DEVICE" --stats "$STATS" --budget 128 --divide-length 32 --steps 400
serving_demo
