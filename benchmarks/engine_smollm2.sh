#!/usr/bin/env bash
# SmolLM2-135M through the reference transformer on the GPU, issue #48's serving workload:
# REQUESTS (64) requests of one PROMPT_TOKENS-token passage of Pride and Prejudice (6,857 tokens:
# the issue's 64 x 6,856-token passage + BOS, 438,848 prefill tokens) + STEPS (256) new tokens
# each, bf16 weights and KV, prefill in chunks of PREFILL_CHUNK tokens, CUDA graphs on, VMM
# allocator; once without compression and once with TriAttention (budget BUDGET = 2,048,
# --prompt-mode compete: the passage is longer than the budget). The statistics are calibrated
# first (--calibrate, pre-RoPE queries of CALIB_TOKENS = 2,548 Shakespeare tokens: disjoint from
# the evaluation text).
#   benchmarks/engine_smollm2.sh OUT_DIR [MODEL.gguf]
# Writes OUT_DIR/smollm2_{full,triattn}.json (reference_transformer --json: prefill and decode
# tok/s, KV live / resident bytes at the end, device memory in use from cudaMemGetInfo), their
# logs, the statistics and the passage, then prints the issue's three ratios:
#   prefill tok/s >= 30 x 3,291; decode tok/s with compression >= 2 x without;
#   KV resident <= 1.1 x live at the end (compressed run).
# Env: BUILD (build dir holding examples/reference_transformer/reference_transformer, default
#      build-gpu), BIN (the binary itself), MODEL, DATA (shared data dir, default ../shared/data
#      next to the repository), REQUESTS, PROMPT_TOKENS, STEPS, PREFILL_CHUNK (default 4096),
#      BUDGET, CALIB_TOKENS, EXTRA_ARGS (more reference_transformer options for both runs, e.g.
#      "--no-graph-buckets" or "--allocator static").
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:?usage: benchmarks/engine_smollm2.sh OUT_DIR [MODEL.gguf]}
DATA=${DATA:-$ROOT/../shared/data}
[ -d "$DATA" ] || DATA=$ROOT/shared/data
MODEL=${2:-${MODEL:-$DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf}}
BUILD=${BUILD:-$ROOT/build-gpu}
BIN=${BIN:-$BUILD/examples/reference_transformer/reference_transformer}
REQUESTS=${REQUESTS:-64}
PROMPT_TOKENS=${PROMPT_TOKENS:-6857}
STEPS=${STEPS:-256}
PREFILL_CHUNK=${PREFILL_CHUNK:-4096}
BUDGET=${BUDGET:-2048}
CALIB_TOKENS=${CALIB_TOKENS:-2548}
for f in "$BIN" "$MODEL" "$DATA/text/pride_and_prejudice.txt" "$DATA/text/shakespeare.txt"; do
  [ -e "$f" ] || { echo "engine_smollm2.sh: missing $f" >&2; exit 1; }
done
mkdir -p "$OUT"

# The passage: the novel from its first sentence (chapter 1); 60,000 characters hold about
# 14,000 tokens, --prompt-tokens keeps the first PROMPT_TOKENS of them.
python3 - "$DATA/text/pride_and_prejudice.txt" "$OUT/passage.txt" <<'PASSAGE'
import sys
text = open(sys.argv[1], encoding="utf-8").read()
start = text.index("It is a truth universally acknowledged")  # chapter 1, after the front matter
open(sys.argv[2], "w", encoding="utf-8").write(text[start:start + 60000])
PASSAGE
head -c 20000 "$DATA/text/shakespeare.txt" >"$OUT/calibration.txt"

COMMON=(--model "$MODEL" --device gpu --no-chat --quiet --report-every 0)
echo "== calibration: $CALIB_TOKENS Shakespeare tokens -> $OUT/smollm2_stats.safetensors"
"$BIN" "${COMMON[@]}" --prompt-file "$OUT/calibration.txt" --prompt-tokens "$CALIB_TOKENS" --steps 0 \
  --calibrate "$OUT/smollm2_stats.safetensors" 2>"$OUT/calibration.log"

PROMPTS=()
for _ in $(seq "$REQUESTS"); do PROMPTS+=(--prompt-file "$OUT/passage.txt"); done
RUN=("${COMMON[@]}" --weight-dtype bf16 --kv-dtype bf16 --prefill-chunk "$PREFILL_CHUNK" --steps "$STEPS"
     --prompt-tokens "$PROMPT_TOKENS" "${PROMPTS[@]}")
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"
RUN+=("${EXTRA[@]}")
echo "== $REQUESTS x $PROMPT_TOKENS tokens + $STEPS new, no compression"
"$BIN" "${RUN[@]}" --json "$OUT/smollm2_full.json" 2>"$OUT/smollm2_full.log"
echo "== $REQUESTS x $PROMPT_TOKENS tokens + $STEPS new, TriAttention budget $BUDGET"
"$BIN" "${RUN[@]}" --stats "$OUT/smollm2_stats.safetensors" --budget "$BUDGET" --prompt-mode compete \
  --json "$OUT/smollm2_triattn.json" 2>"$OUT/smollm2_triattn.log"

python3 - "$OUT/smollm2_full.json" "$OUT/smollm2_triattn.json" <<'EOF'
import json, sys
full, tri = (json.load(open(p)) for p in sys.argv[1:3])
gib = 1024.0 ** 3
for name, r in (("no compression", full), ("TriAttention", tri)):
    print(f"{name:>15}: prefill {r['prefill_tok_s']:,.0f} tok/s ({r['prefill_tokens']:,.0f} tokens, "
          f"{r['prefill_seconds']:.2f} s), decode {r['decode_tok_s']:,.0f} tok/s ({r['decode_steps']:.0f} steps), "
          f"KV live {r['kv_bytes_live'] / gib:.2f} GiB, resident {r['kv_bytes_resident'] / gib:.2f} GiB, "
          f"device memory in use {r['device_memory_used_bytes'] / gib:.2f} GiB, "
          f"graphs {r['graph_captures']:.0f} captured / {r['graph_replays']:.0f} replayed")
prefill = min(full["prefill_tok_s"], tri["prefill_tok_s"])
print(f"prefill: {prefill / 3291:.1f}x the issue's 3,291 tok/s (target >= 30x)")
print(f"decode with compression: {tri['decode_tok_s'] / full['decode_tok_s']:.2f}x without (target >= 2x)")
print(f"KV resident / live at the end, compressed: {tri['kv_resident_over_live']:.3f} (target <= 1.1)")
if "kv_vmm_slabs_mapped" in tri:
    print(f"compressed VMM pool: {tri['kv_vmm_slabs_mapped']:.0f} slabs of {tri['kv_vmm_slab_bytes'] / 2**20:.0f} MiB "
          f"mapped at the end, {tri['kv_vmm_blocks_relocated']:.0f} blocks relocated in "
          f"{tri['kv_vmm_relocations']:.0f} passes, {tri['kv_vmm_slabs_unmapped']:.0f} slabs unmapped")
EOF
