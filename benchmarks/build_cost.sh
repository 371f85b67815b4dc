#!/usr/bin/env bash
# Build cost of downstream CUDA translation units (benchmarks/build_cost/*.cu): CPU time
# (user + sys of nvcc and its children, not wall time: the machine may be shared), object size
# and kernels in the object, for each source tree given (default: this checkout).
#   benchmarks/build_cost.sh [-o OUTDIR] [-t "score_call round_call"] [TREE ...]
# TREE: a triattn source tree (e.g. a `git worktree add` of an older commit); the TUs always come
# from this script's directory, so every tree compiles the same files. Env: NVCC (default nvcc),
# ARCH (default sm_90a), CUOBJDUMP (default: cuobjdump on PATH; without one kernels are not counted).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/triattn-build-cost"
tus="score_call round_call"
while getopts "o:t:" opt; do
  case "$opt" in
    o) out="$OPTARG" ;;
    t) tus="$OPTARG" ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
trees=("$@")
[[ ${#trees[@]} -gt 0 ]] || trees=("$(cd "$here/.." && pwd)")
nvcc="${NVCC:-nvcc}"
arch="${ARCH:-sm_90a}"
cuobjdump="${CUOBJDUMP:-$(command -v cuobjdump || true)}"
mkdir -p "$out"

printf '%-10s %-12s %10s %12s %8s  %s\n' tree tu cpu_s object_B kernels source
for tree in "${trees[@]}"; do
  rev="$(git -C "$tree" rev-parse --short HEAD 2>/dev/null || basename "$tree")"
  for tu in $tus; do
    obj="$out/${tu}-${rev}.o"
    log="$out/${tu}-${rev}.time"
    /usr/bin/time -v -o "$log" "$nvcc" -std=c++20 -O3 -DNDEBUG -arch="$arch" -I "$tree/include" \
      -c "$here/build_cost/$tu.cu" -o "$obj"
    cpu=$(awk -F': ' '/User time/ {u=$2} /System time/ {s=$2} END {printf "%.1f", u + s}' "$log")
    kernels=-
    if [[ -n "$cuobjdump" ]]; then
      kernels=$("$cuobjdump" -sass "$obj" | grep -c '^[[:space:]]*Function :' || true)
      "$cuobjdump" -sass "$obj" >"$out/${tu}-${rev}.sass"
    fi
    printf '%-10s %-12s %10s %12s %8s  %s\n' "$rev" "$tu" "$cpu" "$(stat -c %s "$obj")" "$kernels" "$tree"
  done
done
