// SPDX-License-Identifier: Apache-2.0
// Prefix caching: full blocks of prompt tokens are kept after their request ends and shared by
// later requests whose prompts start with the same tokens (a system prompt, few-shot examples,
// a document many questions ask about).
//
// The cache itself is an allocator policy, PrefixCachingAllocator<Inner>
// (core/policy/prefix_caching_allocator.hpp); this header admits prompts over its hits and
// publishes prompts into it.
//
// Use with KvCache<PrefixCachingAllocator<...>, ...>:
//   PrefixHit h = prefix_hit(cache, prompt, key);           // what would be shared (read-only)
//   PrefixAdmission a = admit_prompt(cache, prompt, key);   // new sequence over the longest hit
//   ... prefill prompt[a.cached_tokens..] ...
//   publish_prompt(cache, a.seq, prompt, key);              // its full prompt blocks enter the cache
// Shared and cached blocks have a reference count above one, so KvCache never rewrites them:
// compression rounds protect them (KvCache::shared_prefix), compaction refuses to move them, and a
// sequence that shares a partly used block copies it before its first write there. Blocks a round
// compacted never enter the cache (publish_prompt stops at KvCache::forkable_prefix).
//
// Error model: prefix_hit is read-only; admit_prompt and publish_prompt check everything before
// they change anything and leave the cache as it was when they throw (logic_error naming the
// input).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <triattn/core/error.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/prefix_caching_allocator.hpp>

namespace triattn {

/// A prompt admitted with admit_prompt().
struct PrefixAdmission {
  SeqId seq = -1;
  int cached_tokens = 0;  ///< prompt tokens taken from the cache (compute prompt[cached_tokens..])
  int hit_blocks = 0;     ///< cached blocks the sequence shares
};

/// What admit_prompt would share for a prompt, found without admitting it (read-only).
struct PrefixHit {
  PrefixMatch match;      ///< longest cached chain of the prompt's full blocks
  int cached_tokens = 0;  ///< prompt tokens a sequence would take from the cache
  int blocks = 0;         ///< leading blocks of match it would share
};

/// The prefix hit admit_prompt takes for `prompt` under `key`: at most prompt.size() - 1 tokens
/// come from the cache (the last prompt token is computed, for its logits); when that ends inside
/// a block and the cache copies blocks, the block is shared partly (copied on its first write),
/// else the hit is rounded down to whole blocks. Changes nothing (no recency, no statistics).
/// @throws logic_error when prompt is empty.
template <class Cache>
[[nodiscard]] PrefixHit prefix_hit(const Cache& cache, std::span<const std::int32_t> prompt, std::uint64_t key = 0) {
  const auto& pc = cache.allocator();
  TRIATTN_EXPECTS(!prompt.empty(), "prefix_hit: the prompt is empty");
  PrefixHit h;
  h.match = pc.match(prompt, key);
  const int bs = pc.block_size();
  h.cached_tokens = std::min(h.match.num_blocks() * bs, static_cast<int>(prompt.size()) - 1);
  if (!Cache::copies_blocks) h.cached_tokens -= h.cached_tokens % bs;
  h.blocks = (h.cached_tokens + bs - 1) / bs;
  return h;
}

/// Opens a sequence for `prompt` over the longest cached chain of its full blocks under `key`
/// (prefix_hit says how much of it is shared).
/// @throws logic_error (nothing changed) when prompt is empty or no sequence slot is free.
template <class Cache>
PrefixAdmission admit_prompt(Cache& cache, std::span<const std::int32_t> prompt, std::uint64_t key = 0) {
  const PrefixHit h = prefix_hit(cache, prompt, key);
  PrefixAdmission a;
  a.seq = cache.add_sequence(std::span<const std::int32_t>(h.match.blocks.data(), static_cast<std::size_t>(h.blocks)),
                             h.cached_tokens);
  a.cached_tokens = h.cached_tokens;
  a.hit_blocks = h.blocks;
  auto& pc = cache.allocator();
  pc.touch(h.match, h.blocks);
  pc.count_lookup(h.blocks, h.cached_tokens);
  return a;
}

/// Enters the full blocks of `seq`'s prompt that still hold it in place (never blocks a round
/// compacted) into the prefix cache under `key`; `prompt` must be the tokens the sequence was
/// prefilled with. Call it after the prompt's K/V are written (e.g. after the prefill step).
/// Leading blocks already cached in other blocks (the prompt computed twice, e.g. by two requests
/// prefilled at once) are shared instead (KvCache::share_block): the duplicates go back to the
/// pool, and the prompt ends up cached and protected from rounds as if it had been prefilled alone.
/// @return prompt blocks of `seq` that are cached now
/// @throws logic_error (nothing changed) on an unknown sequence or a prompt shorter than its
///         cached prompt.
template <class Cache>
int publish_prompt(Cache& cache, SeqId seq, std::span<const std::int32_t> prompt, std::uint64_t key = 0) {
  const int in_place = std::min(cache.prompt_length(seq), cache.forkable_prefix(seq));
  TRIATTN_EXPECTS(static_cast<std::size_t>(cache.prompt_length(seq)) <= prompt.size(),
                  "publish_prompt: sequence " + std::to_string(seq) + " caches " +
                      std::to_string(cache.prompt_length(seq)) + " prompt tokens but the prompt has " +
                      std::to_string(prompt.size()));
  auto& pc = cache.allocator();
  const int nblocks = in_place / pc.block_size();
  const PrefixMatch m = pc.match(prompt.first(static_cast<std::size_t>(nblocks) * static_cast<std::size_t>(pc.block_size())), key);
  const int twice = std::min(m.num_blocks(), nblocks);
  for (int j = 0; j < twice; ++j) cache.share_block(seq, j, m.blocks[static_cast<std::size_t>(j)]);
  return pc.insert(prompt, key, cache.block_table(seq), nblocks);
}

}  // namespace triattn
