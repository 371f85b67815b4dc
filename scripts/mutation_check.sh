#!/usr/bin/env bash
# Mutation check: each mutant below is a deliberate, realistic bug put into a clean copy of the
# tree; the named test case must then fail. The check fails when a mutant survives (its test
# passes), when a mutant no longer applies (the code it patches changed: update the list), or when
# the clean copy's named tests do not pass first. Table of mutants and times: docs/testing.md.
#   usage: scripts/mutation_check.sh [BUILD_ROOT]   (JOBS=n for the build, default nproc)
# One copy, one CPU-only build dir: apply a mutant, rebuild only the test binary that should kill
# it, run only the named test case, revert.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}
WORK=${1:-$ROOT/build-mutation}
SRC=$WORK/src
B=$WORK/build

# name | file | exact text | replacement | test binary | test case (doctest -tc pattern)
# Text and replacement are perl-quoted literals (\n is a newline).
MUTANTS=(
"rope-at-physical-position|examples/reference_transformer/model.hpp|p0 + static_cast<std::int64_t>(t)});|r.first_slot + static_cast<std::int64_t>(t)});|test_core_test_reference_transformer|*saw-tooth cache and RoPE at logical positions"
"keep-count-off-by-one|include/triattn/core/keep_counts.hpp|const long long quota = total - k.num_protected;|const long long quota = total - k.num_protected - 1;|test_core_test_select|sinks and recent window are kept*"
"prompt-prefix-not-protected|include/triattn/core/keep_counts.hpp|const int pinned = p.prompt != PromptMode::kCompete ? prompt_len : 0;|const int pinned = 0;|test_core_test_select|prompt pinned in budget vs pinned on top*"
"ties-to-higher-slot|include/triattn/core/selection.hpp|(values[a] == values[b] && a < b)|(values[a] == values[b] && a > b)|test_core_test_select|exact ties keep the lower slot*"
"normalise-with-sample-std|include/triattn/core/selection.hpp|std::sqrt(ss / n)|std::sqrt(ss / (n - 1))|test_core_test_select|normalize_scores: population z-score*"
"shared-block-freed-at-first-release|include/triattn/core/block_pool.hpp|if (--ref_count_[static_cast<std::size_t>(b)] > 0) return false;|--ref_count_[static_cast<std::size_t>(b)];|test_core_test_block_pool|block pool: reference counts*"
"last-kept-block-freed|include/triattn/core/kv_cache.hpp|const int after = static_cast<int>(detail::ceil_div(keep, config_.block_size));|const int after = keep / config_.block_size;|test_core_test_kv_cache|kv cache: prefill and decode and keep-plan compaction*"
"vmm-map-failure-ignored|include/triattn/core/vmm/vmm_allocator_core.hpp|f.set(DriverCall::kMap, c, why);\n            break;|(void)c;|test_core_test_vmm_faults|vmm faults: failure at the N-th create*"
"trigger-one-step-late|include/triattn/core/trigger.hpp|return counted_len >= threshold(params);|return counted_len > threshold(params);|test_core_test_trigger|counted_length and should_compress"
"pt-crc-not-checked|include/triattn/core/stats/zip_reader.hpp|if (actual != e.crc32 && kEnforceChecksums)|if (false && actual != e.crc32)|test_core_test_stats_pt|stats: 200 corruptions of qwen3_8b.pt*"
"safetensors-crc-not-checked|include/triattn/core/stats/safetensors.hpp|if (crc_text != detail::hex32(crc) && detail::kEnforceChecksums)|if (false)|test_core_test_stats_safetensors|stats: 200 corruptions of qwen3_8b statistics*"
"fifo-read-as-file|include/triattn/core/file_io.hpp|  if (!S_ISREG(mode)) throw|  if (S_ISDIR(mode)) throw|test_core_test_stats_pt|stats loaders refuse a directory or a FIFO*"
"sinks-plus-window-over-budget-accepted|include/triattn/core/scoring_params.hpp|static_cast<long long>(n_sink) + window <= budget,|true,|test_core_test_kv_cache_limits|limits: n_sink + window over the budget*"
"in-place-ignores-first-moved|include/triattn/core/kv_cache.hpp|    s.in_place = std::min({s.in_place, first_changed, keep});|    s.in_place = std::min(s.in_place, keep);|test_core_test_keep_sets_golden|keep sets: positions off leaves the same cache*"
"moved-from-cache-unguarded|include/triattn/core/kv_cache.hpp|    check_live(op);\n|\n|test_core_test_kv_cache_limits|limits: every query on a moved-from KvCache*"
"serving-rows-mixed|examples/serving/serving_loop.hpp|std::span<const float>(logits + c * static_cast<std::size_t>(vocab),|std::span<const float>(logits + (c + 1) % chunks.size() * static_cast<std::size_t>(vocab),|test_core_test_serving_loop|serving loop on the CPU: without compression*"
"serving-round-on-neighbour|examples/serving/serving_loop.hpp|            due.push_back(st[i].seq);|            due.push_back(st[running[(std::find(running.begin(), running.end(), i) - running.begin() + 1) % running.size()]].seq);|test_core_test_serving_loop|serving loop on the CPU: with TriAttention rounds*"
"serving-round-relaunched-at-one-length|examples/serving/serving_loop.hpp|return st[i].phase == Phase::kDecode && !st[i].rounded && cache.needs_compression(st[i].seq);|return st[i].phase == Phase::kDecode && cache.needs_compression(st[i].seq);|test_core_test_serving_loop|serving loop: with rounds in flight across steps*"
"prompt-computed-twice-not-shared|include/triattn/core/prefix_cache.hpp|  for (int j = 0; j < twice; ++j) cache.share_block(seq, j, m.blocks[static_cast<std::size_t>(j)]);|  (void)twice;|test_core_test_prefix_cache|prefix cache: a prompt computed twice*"
"relocation-keeps-old-table|include/triattn/core/kv_cache.hpp|      tables_[static_cast<std::size_t>(owner_of_[static_cast<std::size_t>(plan.from[i])])] = plan.to[i];\n|\n|test_core_test_vmm_relocation|vmm relocation: 64 prompts prefilled in order*"
"relocation-moves-shared|include/triattn/core/kv_cache.hpp|        if (allocator_.ref_count(b) != 1) continue;|        if (allocator_.ref_count(b) < 1) continue;|test_core_test_vmm_relocation|vmm relocation: a prefix shared by 64*"
"serving-round-credited-nowhere|examples/serving/serving_loop.hpp|      owner_of[static_cast<std::size_t>(s.seq)] = i;|      if (!prefix) owner_of[static_cast<std::size_t>(s.seq)] = i;|test_core_test_serving_loop|serving loop on the CPU: with TriAttention rounds*"
)

t0=$(date +%s)
rm -rf "$SRC" && mkdir -p "$SRC"
# A clean copy of the tracked files (the working tree's, uncommitted edits included).
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$SRC"
cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRIATTN_ENABLE_CUDA=OFF -DTRIATTN_BUILD_BENCHMARKS=OFF \
      -DTRIATTN_BUILD_EXAMPLES=OFF -DTRIATTN_SHARED_DATA_DIR="$ROOT/../shared/data" >/dev/null
targets=()
for m in "${MUTANTS[@]}"; do IFS='|' read -r _ _ _ _ bin _ <<<"$m"; targets+=("$bin"); done
mapfile -t targets < <(printf '%s\n' "${targets[@]}" | sort -u)
cmake --build "$B" -j "$JOBS" --target "${targets[@]}" >/dev/null
for m in "${MUTANTS[@]}"; do  # the unmutated tree must pass every named test
  IFS='|' read -r name _ _ _ bin tc <<<"$m"
  "$B/tests/$bin" -tc="$tc" >/dev/null 2>&1 || { echo "mutation check: '$tc' ($bin) fails without a mutant"; exit 1; }
done
echo "mutation check: clean tree built and its named tests pass ($(( $(date +%s) - t0 )) s)"

survivors=0
printf '%-40s %-36s %6s  %s\n' mutant "test binary" time result
for m in "${MUTANTS[@]}"; do
  IFS='|' read -r name file from to bin tc <<<"$m"
  s=$(date +%s)
  cp "$SRC/$file" "$WORK/orig"
  FROM="$from" TO="$to" perl -0pi -e '
    BEGIN { ($f, $t) = ($ENV{FROM}, $ENV{TO}); s/\\n/\n/g for $f, $t; }
    $n = s/\Q$f\E/$t/; END { exit($n ? 0 : 3) }' "$SRC/$file" || {
    echo "mutation check: mutant $name no longer applies to $file (update scripts/mutation_check.sh)"; exit 1; }
  result=survived
  if ! cmake --build "$B" -j "$JOBS" --target "$bin" >"$WORK/build.log" 2>&1; then
    result="killed (does not compile)"
  elif ! "$B/tests/$bin" -tc="$tc" >"$WORK/$name.log" 2>&1; then
    result="killed by '$tc'"
  fi
  cp "$WORK/orig" "$SRC/$file"
  printf '%-40s %-36s %5ss  %s\n' "$name" "$bin" "$(( $(date +%s) - s ))" "$result"
  [ "$result" = survived ] && survivors=$((survivors + 1))
done
echo "mutation check: ${#MUTANTS[@]} mutants, $survivors survived, $(( $(date +%s) - t0 )) s"
[ "$survivors" -eq 0 ]
