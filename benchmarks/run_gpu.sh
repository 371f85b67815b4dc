#!/usr/bin/env bash
# One command to build triattn on a GPU machine, run every `gpu`-labelled test (plus the host
# tests), optionally compute-sanitizer, and every CUDA benchmark, writing JSON results.
#   benchmarks/run_gpu.sh [OUT_DIR]          (default: benchmarks/results/<date>)
# Labels: `gpu` tests need one GPU; `gpu_multi` tests (tensor parallelism) need two and run only
# where nvidia-smi lists at least two.
# Env: BUILD (build dir, default build-gpu), BENCH_FILTER (regex of benchmark binaries to run),
#      BENCH_MIN_TIME (default 0.2), SANITIZE=1 (run compute-sanitizer memcheck+racecheck on the
#      gpu tests), DEPS (a prefix with doctest and Google Benchmark, if the machine lacks them),
#      SKIP_TESTS=1 (benchmarks only, e.g. a second call after the tests; the build is reused),
#      CTEST_JOBS (default 1: tests that share the GPU; 3 measured fine on one H200, the tests that
#      read device-wide free memory run alone either way).
set -uo pipefail
# NVLink multicast stays off: a program that uses it can put a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# triattn dlopen()s libnccl.so.2; where it is not on the loader path, use the NCCL wheel's copy.
if [ -z "${TRIATTN_NCCL_LIBRARY:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2'; then
  NCCL_WHEEL_LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  [ -n "$NCCL_WHEEL_LIB" ] && [ -f "$NCCL_WHEEL_LIB" ] && export TRIATTN_NCCL_LIBRARY=$NCCL_WHEEL_LIB
fi
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${1:-$ROOT/benchmarks/results/$(date +%F)}
BUILD=${BUILD:-$ROOT/build-gpu}
mkdir -p "$OUT_DIR"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
GPU_TAG=$(echo "$GPU" | tr -c 'A-Za-z0-9.\n-' '_')   # --benchmark_context values cannot hold commas
echo "device: $GPU  commit: $COMMIT  date: $(date -u +%FT%TZ)" | tee "$OUT_DIR/device.txt"

PREFIX_ARGS=()
[ -n "${DEPS:-}" ] && PREFIX_ARGS=(-DCMAKE_PREFIX_PATH="$DEPS")
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)  # make also works; -k 0 below is understood by both
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release "${PREFIX_ARGS[@]}" ${EXTRA_CMAKE_ARGS:-} >"$OUT_DIR/configure.log" 2>&1 \
  || { tail -30 "$OUT_DIR/configure.log"; exit 1; }
# Keep going past a failing target so one broken binary does not hide every other result.
if ! cmake --build "$BUILD" -j "$(nproc)" -- -k 0 >"$OUT_DIR/build.log" 2>&1; then
  echo "BUILD FAILED for some targets:"
  grep -E "FAILED:|error" "$OUT_DIR/build.log" | head -30
  BUILD_FAILED=1
else
  echo "build ok"
fi

# `gpu_multi` tests need two GPUs: run them (label regex "gpu") only where there are two.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
LABEL='^gpu$'; [ "$NGPU" -ge 2 ] && LABEL='gpu'
echo "GPUs: $NGPU, ctest -L '$LABEL'" | tee -a "$OUT_DIR/device.txt"
GPU_RC=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  ctest --test-dir "$BUILD" -L "$LABEL" -j "${CTEST_JOBS:-1}" --output-on-failure --timeout 600 >"$OUT_DIR/ctest_gpu.log" 2>&1
  GPU_RC=$?
  tail -15 "$OUT_DIR/ctest_gpu.log"
fi
if [ "${SANITIZE:-0}" = 1 ] && [ "${SKIP_TESTS:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
  for t in "$BUILD"/tests/test_cuda_${SANITIZE_FILTER:-*}; do
    [[ -x "$t" && "$t" != *.cmake ]] || continue
    for tool in memcheck racecheck; do
      compute-sanitizer --tool $tool --error-exitcode 9 "$t" -ts=gpu >"$OUT_DIR/sanitizer_${tool}_$(basename "$t").log" 2>&1
      echo "compute-sanitizer $tool $(basename "$t"): rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT_DIR/sanitizer_${tool}_$(basename "$t").log" | tail -1)"
    done
  done | tee "$OUT_DIR/sanitizer_summary.txt"
fi

for b in "$BUILD"/benchmarks/bench_*; do
  name=$(basename "$b")
  [[ "$name" == bench_ref_* ]] && continue
  [ -n "${BENCH_FILTER:-}" ] && ! [[ "$name" =~ $BENCH_FILTER ]] && continue
  "$b" --benchmark_min_time="${BENCH_MIN_TIME:-0.2}" --benchmark_out="$OUT_DIR/$name.json" \
       --benchmark_out_format=json --benchmark_context=commit="$COMMIT" --benchmark_context=device="$GPU_TAG" --benchmark_context=date="$(date -u +%FT%TZ)" \
       >"$OUT_DIR/$name.txt" 2>&1
  echo "$name rc=$?"
done
[ "${BUILD_FAILED:-0}" = 1 ] && exit 1
exit $GPU_RC
