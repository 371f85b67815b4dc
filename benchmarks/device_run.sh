#!/usr/bin/env bash
# One device session: build every CUDA target, run the gpu suite, compute-sanitizer on chosen
# tests, and chosen benchmarks; logs packed into OUT/logs.tar.gz, JSON copied to OUT.
#   benchmarks/device_run.sh OUT  (env: DEPS, DATA, SAN="test_a test_b", BENCH="bench_x:filter ...")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUT}; L=$OUT/logs; mkdir -p "$L"
export NCCL_NVLS_ENABLE=0
[ -n "${DEPS:-}" ] && export LD_LIBRARY_PATH=$DEPS/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$L/device.txt"
ARGS=(-DCMAKE_BUILD_TYPE=Release)
[ -n "${DEPS:-}" ] && ARGS+=(-DCMAKE_PREFIX_PATH="$DEPS")
[ -n "${DATA:-}" ] && ARGS+=(-DTRIATTN_SHARED_DATA_DIR="$DATA")
B=${BUILD:-build-dev}
cmake -S . -B "$B" -G Ninja "${ARGS[@]}" >"$L/configure.log" 2>&1 || { tail -20 "$L/configure.log"; }
SECONDS=0
cmake --build "$B" -j "$(nproc)" ${TARGETS:+--target $TARGETS} -- -k 0 >"$L/build.log" 2>&1; echo "build rc=$? ${SECONDS}s"
grep -E "FAILED:|error:" "$L/build.log" | head -20
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  ctest --test-dir "$B" -L '^gpu$' -j 3 --output-on-failure --timeout 300 >"$L/ctest_gpu.log" 2>&1; echo "ctest gpu rc=$?"
  grep -E "tests passed|Failed|\*\*\*|Not Run|Timeout" "$L/ctest_gpu.log" | head -30
fi
for t in ${SAN:-}; do
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 "$B/tests/$t" -ts=gpu >"$L/san_${tool}_$t.log" 2>&1
    echo "sanitizer $tool $t rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$L/san_${tool}_$t.log" | tail -1)"
  done
done
for spec in ${BENCH:-}; do
  b=${spec%%:*}; f=${spec#*:}
  "$B/benchmarks/$b" --benchmark_filter="$f" --benchmark_min_time=${BENCH_MIN_TIME:-0.2} --benchmark_out="$OUT/$b.json" \
     --benchmark_out_format=json >"$L/$b.txt" 2>&1; echo "$b rc=$?"
done
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
