#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs every fuzzer (statistics loaders, GGUF loader) for a bounded time on a corpus built at run
# time from the real calibration and model files, in a temporary folder (nothing is written into
# the repository):
#   1. the real .pt files (copied), their safetensors conversions and their data.pkl are replayed
#      once through the matching target;
#   2. each target then fuzzes for SECONDS, starting from tiny/small/medium variants cut from the
#      real statistics (full-size inputs would hold libFuzzer to a few dozen runs a second).
#   usage: fuzz/run_fuzzers.sh BUILD_DIR SECONDS [CALIBRATION_DIR]
# BUILD_DIR is a build configured with -DTRIATTN_BUILD_FUZZERS=ON (see fuzz/CMakeLists.txt).
# Exit status: 0 when no fuzzer found anything, 1 otherwise (inputs and logs are kept under
# BUILD_DIR/fuzz-artifacts/), 2 on bad usage.
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
  echo "usage: $0 BUILD_DIR SECONDS [CALIBRATION_DIR]" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
seconds=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
calib=$(cd "${3:-$here/../../shared/data/calibration}" && pwd)

fuzz_bin=$build/fuzz
for exe in fuzz_pt_loader fuzz_safetensors_loader fuzz_pickle fuzz_gguf_loader triattn_fuzz_seeds; do
  [[ -x $fuzz_bin/$exe ]] || { echo "missing $fuzz_bin/$exe: build with -DTRIATTN_BUILD_FUZZERS=ON" >&2; exit 2; }
done
ls "$calib"/*.pt > /dev/null  # no real files, no run

work=$(mktemp -d "${TMPDIR:-/tmp}/triattn-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$fuzz_bin/triattn_fuzz_seeds" "$calib" "$work"
cp "$calib"/*.pt "$work/full/pt/"
cp "$calib"/../models/*.gguf "$work/full/gguf/"  # the real SmolLM2 model (98 MB), replayed once

artifacts=$build/fuzz-artifacts
mkdir -p "$artifacts"
status=0
run() {  # run TARGET KIND
  local target=$1 kind=$2 log=$work/$1.log
  local common=(-timeout=60 -rss_limit_mb=2048 -artifact_prefix="$artifacts/$target-")
  echo "== $target: replay $(ls "$work/full/$kind" | wc -l) full-size inputs, then fuzz ${seconds}s from" \
       "$(ls "$work/seeds/$kind" | wc -l) seeds"
  if ! "$fuzz_bin/$target" "${common[@]}" "$work/full/$kind"/* > "$log" 2>&1 ||
     ! "$fuzz_bin/$target" "${common[@]}" "$work/seeds/$kind" -max_total_time="$seconds" -max_len=65536 \
         -print_final_stats=1 >> "$log" 2>&1; then
    echo "!! $target found a problem; see $artifacts" >&2
    cp "$log" "$artifacts/"
    status=1
  fi
  grep -E "^stat::(number_of_executed_units|peak_rss_mb)|DONE" "$log" || tail -5 "$log"
}
run fuzz_pt_loader pt
run fuzz_safetensors_loader safetensors
run fuzz_pickle pickle
run fuzz_gguf_loader gguf
exit $status
