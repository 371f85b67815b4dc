// SPDX-License-Identifier: Apache-2.0
// Admission and accounting: the exact worst-case footprint of a request under compression, and
// whether a batch of new requests fits in the free blocks now. With compression a sequence never
// holds more than about max(prompt, budget) + divide_length tokens, however long it generates,
// which is what lets an engine admit several times more requests than prompt + max_new_tokens.
//
// Model (what KvCache and the batched round do): the prompt is appended at once (prefill), then
// one token per decode step, and the round (RoundTrigger::kIfDue) runs after every decode step's
// append. A sequence whose engine runs rounds less often can exceed the bound.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <algorithm>
#include <string>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/round_types.hpp>
#include <triattn/core/scoring_params.hpp>

namespace triattn {

/// One request to admit.
struct AdmissionRequest {
  int prompt_len = 0;      ///< prompt tokens (prefill)
  int max_new_tokens = 0;  ///< decode tokens it may generate
};

/// Worst-case resources of one request over its whole life.
struct RequestFootprint {
  int max_tokens = 0;              ///< most tokens it ever holds (physical length before a round)
  int max_blocks = 0;              ///< ceil(max_tokens / block_size): most blocks it ever holds
  std::int64_t kv_bytes = 0;       ///< max_blocks * bytes of one block id (all layers, K and V)
  std::size_t round_workspace_bytes = 0;  ///< host round workspace for it (paged_round_workspace_size)
  std::int64_t uncompressed_tokens = 0;   ///< prompt_len + max_new_tokens, for comparison
};

/// Most tokens a request holds: with N = max_new_tokens, P = prompt_len,
///   N == 0: P; else max(P, min(P + N, max(P + 1, thr, K + 1))) where
///   thr = budget + divide_length (+ P with kPinnedOnTop) is the physical length that triggers
///   a round and K = max(budget (+ P with kPinnedOnTop), max(pinned P, n_sink) + window) is the
///   length a round leaves (selection::keep_counts once the length exceeds K; a round at length <= K
///   keeps everything).
/// @throws triattn::logic_error on invalid params or a negative length.
[[nodiscard]] inline std::int64_t max_resident_tokens(int prompt_len, int max_new_tokens,
                                                     const ValidSelectionParams& params) {
  TRIATTN_EXPECTS(prompt_len >= 0 && max_new_tokens >= 0,
                  "max_resident_tokens: prompt_len = " + std::to_string(prompt_len) + " and max_new_tokens = " +
                      std::to_string(max_new_tokens) + " must be non-negative");
  const std::int64_t P = prompt_len, N = max_new_tokens;
  if (N == 0) return P;
  const std::int64_t on_top = params.prompt == PromptMode::kPinnedOnTop ? P : 0;
  const std::int64_t thr = static_cast<std::int64_t>(params.budget) + params.divide_length + on_top;
  const std::int64_t pinned = params.prompt_pinned() ? P : 0;
  const std::int64_t K = std::max<std::int64_t>(params.budget + on_top,
                                                std::max<std::int64_t>(pinned, params.n_sink) + params.window);
  return std::max(P, std::min(P + N, std::max({P + 1, thr, K + 1})));
}

/// Footprint of one request in a cache configured as `cfg` (block size, geometry, dtype).
/// @throws triattn::logic_error on invalid cfg/params, negative lengths, or a request that can
///         never fit one block-table row (max_blocks > cfg.blocks_per_seq()).
[[nodiscard]] inline RequestFootprint request_footprint(const CacheConfig& cfg, const AdmissionRequest& request,
                                                        const SelectionParams& params) {
  cfg.validate();
  RequestFootprint f;
  const std::int64_t tokens = max_resident_tokens(request.prompt_len, request.max_new_tokens, params);
  const std::int64_t blocks = (tokens + cfg.block_size - 1) / cfg.block_size;
  TRIATTN_EXPECTS(blocks <= cfg.blocks_per_seq(),
                  "request_footprint: a request of prompt " + std::to_string(request.prompt_len) + " and " +
                      std::to_string(request.max_new_tokens) + " new tokens holds up to " + std::to_string(tokens) +
                      " tokens = " + std::to_string(blocks) + " blocks, more than a block-table row holds (" +
                      std::to_string(cfg.blocks_per_seq()) + ")");
  f.max_tokens = static_cast<int>(tokens);
  f.max_blocks = static_cast<int>(blocks);
  f.kv_bytes = blocks * cfg.block_bytes_all_ranges();
  f.round_workspace_bytes = paged_round_workspace_size(cfg.model, f.max_tokens);
  f.uncompressed_tokens = static_cast<std::int64_t>(request.prompt_len) + request.max_new_tokens;
  return f;
}

/// Block ids (all layers, K and V) a KV memory budget of `kv_bytes` holds in a cache configured
/// as `cfg`: bytes over the dtype's block bytes, so an fp8 cache holds twice the tokens of bf16.
/// @throws triattn::logic_error on an invalid cfg or negative kv_bytes.
[[nodiscard]] inline std::int64_t blocks_for_kv_bytes(const CacheConfig& cfg, std::int64_t kv_bytes) {
  cfg.validate();
  TRIATTN_EXPECTS(kv_bytes >= 0, "blocks_for_kv_bytes: kv_bytes = " + std::to_string(kv_bytes) + " must be non-negative");
  return kv_bytes / cfg.block_bytes_all_ranges();
}

/// Whether every request of `requests` can be admitted now next to the sequences already
/// running: the sum of their max_blocks, plus `reserved_blocks` (what running sequences may still
/// grow to: the sum of their max_blocks minus what they hold), is at most `free_blocks`.
/// @return the number of leading requests of `requests` that fit (requests.size() when all do)
[[nodiscard]] inline std::size_t admissible_prefix(const CacheConfig& cfg, std::span<const AdmissionRequest> requests,
                                                   const SelectionParams& params, std::int64_t free_blocks,
                                                   std::int64_t reserved_blocks = 0) {
  TRIATTN_EXPECTS(free_blocks >= 0 && reserved_blocks >= 0,
                  "admissible_prefix: free_blocks = " + std::to_string(free_blocks) + " and reserved_blocks = " +
                      std::to_string(reserved_blocks) + " must be non-negative");
  std::int64_t need = reserved_blocks;
  std::size_t n = 0;
  for (const AdmissionRequest& r : requests) {
    need += request_footprint(cfg, r, params).max_blocks;
    if (need > free_blocks) break;
    ++n;
  }
  return n;
}

}  // namespace triattn
