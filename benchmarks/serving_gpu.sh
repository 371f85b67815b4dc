#!/usr/bin/env bash
# The GPU tables of issue #44 (a serving loop under load), through examples/serving on one GPU:
#   1. reasoning workload, offline, all four configurations (full, tri, full+prefix, tri+prefix)
#      at one KV memory limit;
#   2. shared-system-prompt workload, offline, all four configurations; the prompt (4,096 shared
#      + 256 own tokens, longer than the budget) pinned on top of the budget: TriAttention keeps
#      2,048 generated tokens beside it (pinned inside the budget it would keep nothing else);
#   3. a Poisson-rate sweep of the reasoning workload, full KV and TriAttention (the prefix
#      configurations find nothing to share in its random prompts).
# Model: the Qwen3-8B-shape synthetic model, bf16 weights generated on the device, bf16 KV.
#
#   benchmarks/serving_gpu.sh OUT_DIR        (JSON per table under OUT_DIR, plots if matplotlib)
#
# Sizing. At the issue's sizes (prompts 128-1,024, 4,096-16,384 generated, a 40 GB KV limit,
# budget 2,048) one wave of TriAttention requests (~124 at once) is ~1.3 M generated tokens, about
# 4 minutes per configuration: the tables would take about an hour. SCALE (default 1/8) shrinks the
# whole sequence axis by one factor: prompt and generated lengths (--scale), the KV limit
# (40 GB x SCALE), the budget (2,048 x SCALE) and divide_length (128 x SCALE). Scaling only the
# generated lengths would leave 4-8 times more full-KV requests fitting in 40 GB, so full KV would
# no longer be memory bound and the comparison would measure nothing; scaled together, every
# configuration runs at the concurrency of the full-size experiment (full KV ~25 requests at once,
# TriAttention ~124), while each step reads less KV. The factor is stored in every JSON file
# ("scale", and the "note"). SCALE=1 runs the issue's sizes.
# Request counts (estimates from decode steps of ~6 ms at batch 1, ~16 ms at 64, ~23 ms at 128
# with 2K-token KV, prefill 5-10K tok/s): table 1 about 2.5 min, table 2 about 1.3 min, table 3
# about 2.5 min, plus ~20 s of start-up (weights, CUDA graphs) per table: about 7-8 minutes on
# one H100; measured on one H100 at b720504: table 1 took 269 s. Env: TABLES (which tables, default
# "reasoning shared poisson": one per device call keeps each under a 10-minute limit),
# REQ_REASONING (160), REQ_SHARED (192), REQ_SWEEP (48), RATES (3,6,12), BUILD (build-gpu),
# EXTRA_CMAKE_ARGS, DEPS (as benchmarks/run_gpu.sh). ITL_ABLATION=1 adds a further table (about 4
# more minutes; TABLES="" ITL_ABLATION=1 runs it alone): the reasoning workload, offline,
# TriAttention only, with the rounds on their own stream or on the model's and the KV pages mapped
# ahead or in the step's extend: what the decode ITL p99 owes to each (every JSON carries the
# per-step attribution); TABLES=itl runs only its first row (the defaults: rounds beside the
# steps, pages mapped ahead), the decode ITL of TriAttention alone in about 50 s.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:?usage: benchmarks/serving_gpu.sh OUT_DIR}
mkdir -p "$OUT"
BUILD=${BUILD:-$ROOT/build-gpu}
S=${SCALE:-0.125}
REQ_REASONING=${REQ_REASONING:-160}
REQ_SHARED=${REQ_SHARED:-192}
REQ_SWEEP=${REQ_SWEEP:-48}
RATES=${RATES:-3,6,12}
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH

PREFIX_ARGS=()
[ -n "${DEPS:-}" ] && PREFIX_ARGS=(-DCMAKE_PREFIX_PATH="$DEPS")
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DTRIATTN_ENABLE_CUDA=ON "${PREFIX_ARGS[@]}" \
      ${EXTRA_CMAKE_ARGS:-} >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" --target serving >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
BIN=$BUILD/examples/serving/serving

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
echo "device: $GPU  commit: $COMMIT  date: $(date -u +%FT%TZ)  scale: $S" | tee "$OUT/device.txt"

times() { awk -v x="$1" -v s="$S" 'BEGIN { v = x * s; if (v < 1) v = 1; printf "%.0f", v }'; }
KV_LIMIT=$(times 40000000000)
BUDGET=$(times 2048)
DIVIDE=$(times 128)
NOTE="Qwen3-8B-shape synthetic model, bf16 weights and KV, on $GPU; the issue's sequence axis scaled by $S: prompt and generated lengths, the KV limit (40 GB x $S = $KV_LIMIT bytes), the budget (2048 x $S = $BUDGET) and divide_length (128 x $S = $DIVIDE); SCALE=1 is the issue's size"
COMMON=(--device gpu --synthetic qwen3-8b-like --weight-dtype bf16 --kv-dtype bf16 --scale "$S"
        --kv-limit "$KV_LIMIT" --budget "$BUDGET" --divide-length "$DIVIDE" --prefill-chunk 2048
        --max-seqs 256 --admission exact --progress 15 --note "$NOTE")

stage() {
  local name=$1; shift
  local t0=$SECONDS
  printf '\n=== %s ===\n' "$name"
  "$BIN" "${COMMON[@]}" "$@" | tee "$OUT/$(echo "$name" | tr ' ' '_').md"
  echo "($name: $((SECONDS - t0)) s)"
}
TABLES=${TABLES-reasoning shared poisson}  # set but empty: none
for t in $TABLES; do
  case $t in
    reasoning) stage "reasoning offline" --workload reasoning --requests "$REQ_REASONING" --rates 0 \
                     --configs full,tri,full+prefix,tri+prefix --json "$OUT/serving_reasoning_offline.json" ;;
    shared) stage "shared prompt offline" --workload shared --requests "$REQ_SHARED" --rates 0 \
                  --configs full,tri,full+prefix,tri+prefix --prompt-mode pinned_on_top \
                  --json "$OUT/serving_shared_offline.json" ;;
    itl) stage "itl rounds side pages ahead" --workload reasoning --requests "$REQ_REASONING" --rates 0 --configs tri \
               --json "$OUT/serving_itl_side_ahead.json" ;;
    poisson) stage "reasoning poisson" --workload reasoning --requests "$REQ_SWEEP" --rates "$RATES" \
                   --configs full,tri --json "$OUT/serving_reasoning_poisson.json" ;;
    *) echo "TABLES: unknown table '$t' (reasoning, shared, poisson, itl)" >&2; exit 2 ;;
  esac
done

if [ "${ITL_ABLATION:-0}" = 1 ]; then
  for rs in side engine; do
    for ma in ahead step; do
      extra=(); [ "$ma" = step ] && extra=(--no-map-ahead)
      stage "itl rounds $rs pages $ma" --workload reasoning --requests "$REQ_REASONING" --rates 0 --configs tri \
            --round-stream "$rs" ${extra[@]+"${extra[@]}"} --json "$OUT/serving_itl_${rs}_${ma}.json"
    done
  done
fi

python3 examples/serving/plot.py "$OUT/plots" "$OUT"/serving_*.json | tee "$OUT/summary.txt"
echo "total: $SECONDS s; results in $OUT"
