#!/usr/bin/env bash
# The Python package on a GPU machine: builds triattn with the CUDA round (TRIATTN_PYTHON_CUDA=ON),
# runs the whole pytest suite (the GPU tests included: torch CUDA vs CPU, CUDA graph, torch.compile)
# and the Python benchmark. The GPU machine fetches nothing: the pure-Python build and test
# packages travel as wheels in .whl/ (git-ignored), which `--fetch` downloads here first:
#   bash scripts/python_gpu.sh --fetch          # here (network): fills .whl/
#   bash scripts/python_gpu.sh [OUT_DIR]        # there (carry .whl): build, test, benchmark
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--fetch" ]; then
  mkdir -p .whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl \
    nanobind scikit-build-core pathspec packaging pytest pluggy iniconfig
  ls .whl
  exit 0
fi
OUT=${1:-${OUT:-build-pygpu}}
mkdir -p "$OUT"
missing=0
for m in nanobind scikit_build_core pytest; do "$PY" -c "import $m" 2>/dev/null || missing=1; done
if [ "$missing" = 1 ]; then
  [ -d .whl ] || { echo "nanobind / scikit-build-core / pytest missing and no .whl/ (run --fetch where pip works)" >&2; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/triattn-site .whl/*.whl
  export PYTHONPATH=/tmp/triattn-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PATH=/usr/local/cuda/bin:$PATH
TRIATTN_PYTHON_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install -q --no-build-isolation --no-index \
  --no-deps --target /tmp/triattn-pkg --config-settings=build-dir=build-pygpu/build .
export PYTHONPATH=/tmp/triattn-pkg:${PYTHONPATH:-}
"$PY" -c "import triattn, torch; assert triattn.has_cuda; print('triattn', triattn.__version__, 'torch', torch.__version__)"
(cd /tmp && PYTHONUNBUFFERED=1 "$PY" -m pytest -q -p no:cacheprovider -rs "$OLDPWD/python/tests") 2>&1 | tee "$OUT/pytest.log"
PYTHONUNBUFFERED=1 "$PY" benchmarks/python/bench_round.py --json "$OUT/bench_round.json" 2>&1 | tee "$OUT/bench_round.log"
