#!/usr/bin/env bash
# The README's test command. On a fresh Debian machine (root) it installs what it needs, then:
#   1. CPU-only configure (CUDA never enabled): build, run the host tests
#   2. full configure (CUDA compiled for sm_90, not run): build tests, benchmarks, examples,
#      header tests; CPU reference benchmarks run briefly
#   3. AddressSanitizer + UBSan build of the core tests, run
#   4. install to staging prefixes; build and run the downstream consumers (the README's CMake
#      block against the CPU-only and the full install, and an add_subdirectory consumer)
#   5. fuzz each loader for a bounded time (when clang's libFuzzer runtime is available)
#   6. mutation check: deliberate bugs, each must fail a named test (docs/testing.md)
#   7. the Python package (pip install ., CPU only) and its pytest suite (numpy; no torch needed)
#   8. last: ctest on the full build, everything but the `gpu` label (its summary ends the log)
# Without a CUDA toolkit (no nvcc), or with TRIATTN_TEST_CUDA=0, the CUDA parts (step 2, the
# CUDA consumer, step 8) are skipped and listed at the end; the rest must pass.
# TRIATTN_TEST_STEPS="1 4" runs only the listed steps (default: all).
# GPU tests (`ctest -L gpu`) and GPU benchmarks run on a GPU machine: benchmarks/run_gpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
B=${BUILD_ROOT:-$ROOT/build-ci}
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
STEPS=" ${TRIATTN_TEST_STEPS:-1 2 3 4 5 6 7 8} "
step() { printf '\n=== %s [%s] ===\n' "$*" "$(date +%T)"; }
want() { [[ "$STEPS" == *" $1 "* ]]; }
skipped=()
skip() { skipped+=("$*"); echo "skipped: $*" >&2; }

step "dependencies"
missing=()
for p in cmake g++ ninja-build doctest-dev libbenchmark-dev clang-14 libclang-rt-14-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
HAVE_NVCC=0; command -v nvcc >/dev/null 2>&1 && HAVE_NVCC=1
[ -x /usr/local/cuda/bin/nvcc ] && { export PATH=/usr/local/cuda/bin:$PATH; HAVE_NVCC=1; }
[ "${TRIATTN_TEST_CUDA:-1}" = 0 ] && HAVE_NVCC=0
[ "$HAVE_NVCC" = 1 ] || echo "no nvcc (or TRIATTN_TEST_CUDA=0): the CUDA parts are skipped" >&2

if want 1; then
  step "1. CPU-only build (TRIATTN_ENABLE_CUDA=OFF)"
  cmake -S . -B "$B/cpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRIATTN_ENABLE_CUDA=OFF >/dev/null
  cmake --build "$B/cpu" -j "$JOBS"
  ctest --test-dir "$B/cpu" -LE gpu -j "$JOBS" --output-on-failure
  for b in "$B"/cpu/benchmarks/bench_ref_*; do
    [ -x "$b" ] && "$b" --benchmark_min_time=0.01 >/dev/null && echo "ran $(basename "$b")"
  done
fi

if want 2; then
  if [ "$HAVE_NVCC" = 1 ]; then
    step "2. full build (CUDA compiled for sm_90a and, for test_score, sm_90; not run)"
    cmake -S . -B "$B/full" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRIATTN_ENABLE_CUDA=ON >/dev/null
    cmake --build "$B/full" -j "$JOBS"
  else
    skip "2. full build with the CUDA layer (no nvcc)"
  fi
fi

if want 3; then
  step "3. sanitizer build of the host tests (ASan + UBSan)"
  cmake -S . -B "$B/asan" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTRIATTN_ENABLE_CUDA=OFF -DTRIATTN_SANITIZE=ON \
        -DTRIATTN_BUILD_BENCHMARKS=OFF -DCMAKE_CXX_FLAGS=-O1 >/dev/null
  cmake --build "$B/asan" -j "$JOBS"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir "$B/asan" -LE gpu -j "$JOBS" --output-on-failure
fi

if want 4; then
  step "4. staged installs and downstream consumers"
  # The README's CMake block against a CPU-only install of the library alone (header-only:
  # configuring is all the build it needs).
  cmake -S . -B "$B/cpu-lib" -G Ninja -DTRIATTN_ENABLE_CUDA=OFF -DTRIATTN_BUILD_TESTS=OFF \
        -DTRIATTN_BUILD_BENCHMARKS=OFF -DTRIATTN_BUILD_EXAMPLES=OFF >/dev/null
  rm -rf "$B/stage-cpu"
  cmake --install "$B/cpu-lib" --prefix "$B/stage-cpu" >/dev/null
  if [ -n "$(find "$B/stage-cpu/include" -name '*.cuh' -print -quit)" ]; then
    echo "the CPU-only install holds CUDA headers" >&2; exit 1
  fi
  cmake -S tests/downstream/cpu -B "$B/downstream-cpu-only" -G Ninja -DCMAKE_PREFIX_PATH="$B/stage-cpu" >/dev/null
  cmake --build "$B/downstream-cpu-only" -j "$JOBS"
  "$B/downstream-cpu-only/consumer_cpu"
  # add_subdirectory: no tests, benchmarks, doctest or Google Benchmark for the consumer.
  subdir_args=(); [ "${TRIATTN_TEST_CUDA:-1}" = 0 ] && subdir_args=(-DTRIATTN_ENABLE_CUDA=OFF)
  cmake -S tests/downstream/subdir -B "$B/downstream-subdir" -G Ninja "${subdir_args[@]}" >/dev/null
  cmake --build "$B/downstream-subdir" -j "$JOBS"
  "$B/downstream-subdir/consumer_subdir"
  if [ "$HAVE_NVCC" = 1 ]; then
    STAGE="$B/stage"
    rm -rf "$STAGE"
    cmake -S . -B "$B/full" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRIATTN_ENABLE_CUDA=ON >/dev/null
    cmake --install "$B/full" --prefix "$STAGE" >/dev/null
    cmake -S tests/downstream/cpu -B "$B/downstream-cpu" -G Ninja -DCMAKE_PREFIX_PATH="$STAGE" \
          -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON >/dev/null
    cmake --build "$B/downstream-cpu" -j "$JOBS"
    "$B/downstream-cpu/consumer_cpu"
    cmake -S tests/downstream/cuda -B "$B/downstream-cuda" -G Ninja -DCMAKE_PREFIX_PATH="$STAGE" \
          -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
    cmake --build "$B/downstream-cuda" -j "$JOBS"
    "$B/downstream-cuda/consumer_cuda"
  else
    skip "4. the CUDA install and its consumers (no nvcc)"
  fi
fi

if ! want 5; then
  :
elif [ -f fuzz/run_fuzzers.sh ] && command -v clang++-14 >/dev/null 2>&1; then
  step "5. fuzzers (${FUZZ_SECONDS}s each)"
  cmake -S . -B "$B/fuzz" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRIATTN_ENABLE_CUDA=OFF \
        -DTRIATTN_BUILD_TESTS=OFF -DTRIATTN_BUILD_BENCHMARKS=OFF -DTRIATTN_BUILD_EXAMPLES=OFF \
        -DTRIATTN_BUILD_FUZZERS=ON -DCMAKE_CXX_COMPILER=clang++-14 >/dev/null
  cmake --build "$B/fuzz" -j "$JOBS"
  bash fuzz/run_fuzzers.sh "$B/fuzz" "$FUZZ_SECONDS"
else
  skip "5. fuzzers (clang++-14 not found)"
fi

if want 6; then
  step "6. mutation check"
  JOBS=$JOBS bash scripts/mutation_check.sh "$B/mutation"
fi

if want 7; then
  step "7. Python package (CPU extension) and its pytest suite"
  PY=${PYTHON:-python3}
  pymissing=()
  for m in nanobind scikit_build_core numpy pytest; do
    "$PY" -c "import $m" >/dev/null 2>&1 || pymissing+=("$m")
  done
  if [ ${#pymissing[@]} -gt 0 ]; then
    pkgs=("${pymissing[@]/scikit_build_core/scikit-build-core}")
    echo "pip installing: ${pkgs[*]}"
    "$PY" -m pip install -q "${pkgs[@]}"
  fi
  # Build in place of the wheel cache under $B (no build isolation: the packages above are used),
  # then test the installed package from outside the source tree.
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PY" -m pip install -q --no-build-isolation \
    --config-settings=build-dir="$B/python" .
  rc=0
  (cd "$B" && "$PY" -m pytest -q -p no:cacheprovider "$ROOT/python/tests") || rc=$?
  [ "$rc" -eq 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
  [ "$rc" -ne 0 ] && exit "$rc"
fi

if want 8; then
  if [ "$HAVE_NVCC" = 1 ]; then
    step "8. all host tests of the full build (ctest -LE gpu)"
    ctest --test-dir "$B/full" -LE gpu -j "$JOBS" --output-on-failure
  else
    skip "8. host tests of the full build (no nvcc; step 1 ran the CPU build's)"
  fi
fi

if [ ${#skipped[@]} -gt 0 ]; then
  printf '\nPassed; skipped:\n' >&2
  printf '  - %s\n' "${skipped[@]}" >&2
fi
