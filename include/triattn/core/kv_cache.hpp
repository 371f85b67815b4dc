// SPDX-License-Identifier: Apache-2.0
// KvCache<Policy...>: the owning API. It keeps the per-sequence bookkeeping (block tables,
// logical position, physical length, pinned prompt) on the host, owns the memory through its
// allocator policy, and hands kernels a KvCacheView whose type does not depend on the policies.
//
// Roles (order-free, each at most once, each with a default):
//   allocator  StaticAllocator<HostBackend> (CPU) | StaticAllocator<cuda::DeviceBackend> | cuda::VmmAllocator
//   compactor  HostCompactor (CPU) | cuda::DeviceCompactor
//   scorer     NoScorer | TriAttentionScorer | ... (what makes compress() possible)
//   selector   TopKSelector (the spec's selection)
//
// Error model: bad arguments throw triattn::logic_error and leave the cache exactly as it was;
// running out of blocks is an expected outcome and comes back as AppendStatus::kOutOfBlocks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/concepts.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/host_kv_ops.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/policy/host_backend.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/no_scorer.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/round_types.hpp>

namespace triattn {

using SeqId = std::int32_t;

/// Whether appended tokens belong to the prompt (prefill) or are generated (decode). Prompt
/// tokens can be pinned by the selector; the trigger fires on decode steps.
enum class Phase : int { kPrefill = 0, kDecode = 1 };

enum class AppendStatus : int { kOk = 0, kOutOfBlocks = 1 };

/// Outcome of extend()/append(). On kOutOfBlocks nothing changed.
struct AppendResult {
  AppendStatus status = AppendStatus::kOk;
  int first_slot = 0;   ///< physical slot of the first new token
  int blocks_needed = 0;  ///< new blocks the request needed (on failure: how many were missing is blocks_needed - free)
  [[nodiscard]] bool ok() const noexcept { return status == AppendStatus::kOk; }
};

/// Which slots of a sequence hold their positions implicitly (KvCache::position_state): slot i
/// holds logical position i below in_place, the explicitly tracked one below explicit_len, and
/// logical - length + i from there on (appended since the last compaction).
struct PositionState {
  int in_place = 0;
  int explicit_len = 0;
};

/// Memory accounting of one cache.
struct MemoryStats {
  std::size_t blocks_total = 0;
  std::size_t blocks_used = 0;
  std::size_t blocks_free = 0;
  std::size_t bytes_resident = 0;     ///< what the allocator holds from its backend / the driver
  std::size_t bytes_in_used_blocks = 0;  ///< blocks_used * bytes per block id (all layers, K and V)
  std::size_t bytes_live = 0;         ///< cached tokens * bytes per token (all layers, K and V)
  std::int64_t cached_tokens = 0;     ///< sum of physical lengths
  std::int64_t logical_tokens = 0;    ///< sum of logical positions
};

/// What KvCache::relocate_blocks() did.
struct RelocationReport {
  std::size_t blocks_moved = 0;   ///< blocks copied to a new place (table entries repointed)
  std::size_t slabs_emptied = 0;  ///< allocator slabs left without a live block
  std::size_t bytes_freed = 0;    ///< their mapped bytes, which the allocator's trim() gives back
  std::size_t copies = 0;         ///< copy calls issued (runs of adjacent blocks go as one)
};

/// What one compression round did to one sequence.
struct CompressionReport {
  SeqId seq = -1;
  int length_before = 0;
  int length_after = 0;
  int blocks_freed = 0;
  /// kCompressed, or kNonFinite: a selectable score was NaN/±Inf under NonFinitePolicy::kRefuse
  /// and the sequence was left unchanged (length_after == length_before, no positions).
  RoundStatus status = RoundStatus::kCompressed;
  /// True when the cache tracks positions (CacheConfig::track_positions) and kept_positions
  /// holds them; false: the report carries lengths and status only.
  bool has_positions = false;
  /// A device round of a cache that tracks positions: they stay in device memory
  /// (cuda::tracked_positions reads a sequence's, cuda::DeviceRounds::kept_positions a round's),
  /// kept_positions is empty.
  bool positions_on_device = false;
  /// Rows of kept_positions: kept_rows(mode) with a selector that has SelectionParams, else
  /// layers * kv_heads (kept_row_source says which (layer, KV head) a row describes).
  int kept_rows = 0;
  /// [kept_rows, length_after]: original logical position of the token slot i of row r holds.
  std::vector<std::int32_t> kept_positions;

  /// @throws logic_error naming CacheConfig::track_positions when a compressed sequence's
  /// positions were not tracked (asking for them must never read as "nothing kept").
  void require_positions() const {
    TRIATTN_EXPECTS(!positions_on_device, "CompressionReport::kept: this device round's kept positions stay in device "
                                          "memory; read them with cuda::tracked_positions(cache, seq, layer, kv_head) "
                                          "or copy cuda::DeviceRounds::kept_positions()");
    TRIATTN_EXPECTS(has_positions || status != RoundStatus::kCompressed,
                    "CompressionReport::kept: the cache does not track positions; set CacheConfig::track_positions "
                    "to have rounds report the kept tokens' positions");
  }
  /// @throws logic_error naming CacheConfig::track_positions when positions were not tracked.
  [[nodiscard]] std::span<const std::int32_t> kept(int row) const {
    require_positions();
    TRIATTN_EXPECTS(row >= 0 && row < kept_rows,
                    "CompressionReport::kept: row " + std::to_string(row) + " outside [0, " + std::to_string(kept_rows) + ")");
    return {kept_positions.data() + static_cast<std::size_t>(row) * static_cast<std::size_t>(length_after),
            static_cast<std::size_t>(length_after)};
  }
};

template <class... Policies>
class KvCache {
  static_assert(detail::count_role<allocator_role, Policies...> <= 1, "KvCache<...>: more than one allocator policy");
  static_assert(detail::count_role<compactor_role, Policies...> <= 1, "KvCache<...>: more than one compactor policy");
  static_assert(detail::count_role<scorer_role, Policies...> <= 1, "KvCache<...>: more than one scorer policy");
  static_assert(detail::count_role<selector_role, Policies...> <= 1, "KvCache<...>: more than one selector policy");
  static_assert(((plays_role<Policies, allocator_role> || plays_role<Policies, compactor_role> ||
                  plays_role<Policies, scorer_role> || plays_role<Policies, selector_role>) && ...),
                "KvCache<...>: every policy must declare policy_role = allocator_role, compactor_role, scorer_role "
                "or selector_role");

 public:
  using allocator_type = detail::pick_role_t<allocator_role, StaticAllocator<HostBackend>, Policies...>;
  using compactor_type = detail::pick_role_t<compactor_role, HostCompactor, Policies...>;
  using scorer_type = detail::pick_role_t<scorer_role, NoScorer, Policies...>;
  using selector_type = detail::pick_role_t<selector_role, NoSelector, Policies...>;
  using index_type = std::int32_t;
  static constexpr MemorySpace memory_space = allocator_type::memory_space;

  static_assert(BlockAllocator<allocator_type>,
                "KvCache<...>: the allocator policy must provide allocate(span)->bool, retain, release->bool, "
                "num_free, capacity, ref_count, bytes_resident, data, range_stride_bytes and memory_space");
  static_assert(Compactor<compactor_type>,
                "KvCache<...>: the compactor policy must provide apply(view, seq, plan) and memory_space");
  static_assert(std::is_same_v<scorer_type, NoScorer> || Scorer<scorer_type>,
                "KvCache<...>: the scorer policy must provide score(view, seq, length, t0, span<float>) and memory_space");
  static_assert(std::is_same_v<selector_type, NoSelector> || Selector<selector_type>,
                "KvCache<...>: the selector policy must provide should_compress(length, prompt, decoding) and "
                "select(scores, geometry, length, prompt) -> KeepPlan");
  static_assert(!Compactor<compactor_type> || serves_memory_space<compactor_type, memory_space>,
                "KvCache<...>: the compactor works on another memory space than the allocator (device memory needs "
                "triattn::cuda::DeviceCompactor, host memory HostCompactor)");
  static_assert(!Scorer<scorer_type> || serves_memory_space<scorer_type, memory_space>,
                "KvCache<...>: the scorer reads another memory space than the allocator's (device memory needs a "
                "device scorer such as triattn::cuda::TriAttentionDeviceScorer)");

  /// Builds the cache. Policy objects may be passed in any order (e.g. a configured scorer);
  /// roles not passed are constructed from `cfg` when they can be, else default-constructed.
  /// @throws logic_error when cfg is invalid (the message names the value), out_of_memory
  /// naming cfg when the host cannot hold its pool or tables.
  template <class... Given>
  explicit KvCache(const CacheConfig& cfg, Given&&... given) try
      : config_(validated(cfg)),
        allocator_(make_policy<allocator_type>(config_, std::forward<Given>(given)...)),
        compactor_(make_policy<compactor_type>(config_, std::forward<Given>(given)...)),
        scorer_(make_policy<scorer_type>(config_, std::forward<Given>(given)...)),
        selector_(make_policy<selector_type>(config_, std::forward<Given>(given)...)),
        seqs_(static_cast<std::size_t>(config_.max_seqs)),
        tables_(static_cast<std::size_t>(config_.max_seqs) * config_.blocks_per_seq(), index_type{-1}),
        lens_(static_cast<std::size_t>(config_.max_seqs), 0) {
    static_assert(((std::is_same_v<std::remove_cvref_t<Given>, allocator_type> ||
                    std::is_same_v<std::remove_cvref_t<Given>, compactor_type> ||
                    std::is_same_v<std::remove_cvref_t<Given>, scorer_type> ||
                    std::is_same_v<std::remove_cvref_t<Given>, selector_type>) && ...),
                  "KvCache(cfg, policies...): an argument is not one of this cache's policy types");
    free_seq_slots_.reserve(seqs_.size());
    for (int s = config_.max_seqs - 1; s >= 0; --s) free_seq_slots_.push_back(s);
  } catch (const std::bad_alloc&) {
    throw out_of_memory("KvCache: cannot allocate the tables of " + describe(cfg));
  }

  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  KvCache(KvCache&&) noexcept = default;
  KvCache& operator=(KvCache&&) noexcept = default;
  ~KvCache() = default;

  // ---- sequences ------------------------------------------------------------------------------

  /// Opens a sequence slot. @throws logic_error when all max_seqs slots are in use.
  [[nodiscard]] SeqId add_sequence() {
    check_live("add_sequence");
    TRIATTN_EXPECTS(!free_seq_slots_.empty(),
                    "add_sequence: all max_seqs = " + std::to_string(config_.max_seqs) + " sequence slots are in use");
    const SeqId s = free_seq_slots_.back();
    free_seq_slots_.pop_back();
    seqs_[static_cast<std::size_t>(s)] = SeqState{true, 0, 0, false, std::numeric_limits<int>::max(), {}};
    return s;
  }

  /// Opens a new sequence sharing the first `tokens` cached tokens of `parent` (a whole number of
  /// blocks), e.g. a common prompt. Shared blocks are reference counted and never rewritten.
  [[nodiscard]] SeqId fork_prefix(SeqId parent, int tokens) {
    const SeqState& p = state(parent, "fork_prefix");
    TRIATTN_EXPECTS(tokens >= 0 && tokens <= lens_[idx(parent)] && tokens % config_.block_size == 0,
                    "fork_prefix: tokens = " + std::to_string(tokens) + " must be a multiple of block_size = " +
                        std::to_string(config_.block_size) + " within the parent's length " +
                        std::to_string(lens_[idx(parent)]));
    // The child continues at logical position `tokens`, which is only true while those slots
    // still hold tokens 0..tokens-1 (compaction may have moved later tokens down).
    TRIATTN_EXPECTS(tokens <= p.in_place,
                    "fork_prefix: slots below " + std::to_string(tokens) + " of sequence " + std::to_string(parent) +
                        " no longer hold its first tokens in order (compaction moved slot " + std::to_string(p.in_place) +
                        "); fork at most " + std::to_string(p.in_place) + " tokens");
    const int prompt = std::min(p.prompt_len, tokens);
    const std::span<const index_type> blocks(tables_.data() + row(parent), static_cast<std::size_t>(tokens / config_.block_size));
    return open_shared(blocks, tokens, prompt, tokens > prompt);
  }

  /// Opens a new sequence whose first `tokens` prompt tokens are already cached in `blocks`
  /// (live blocks of this cache, ceil(tokens / block_size) of them, e.g. a prefix-cache hit; see
  /// prefix_cache.hpp). The blocks are shared (retained), never rewritten: when `tokens` ends
  /// inside the last block, the first extend() copies that block (copy-on-write) before anything
  /// is written past the shared tokens, which needs a compactor with copy_block(); otherwise
  /// `tokens` must be whole blocks. The sequence continues with prefill at position `tokens`.
  /// @throws logic_error (nothing changed) on a wrong block count, a free or foreign block, a
  /// row too short, a partial block without copy support, or no free sequence slot.
  [[nodiscard]] SeqId add_sequence(std::span<const index_type> blocks, int tokens) {
    const int bs = config_.block_size;
    TRIATTN_EXPECTS(tokens >= 0 && static_cast<std::int64_t>(blocks.size()) == detail::ceil_div<std::int64_t>(tokens, bs),
                    "add_sequence(blocks, tokens): " + std::to_string(blocks.size()) + " blocks for tokens = " +
                        std::to_string(tokens) + " (need ceil(tokens / block_size = " + std::to_string(bs) + "))");
    TRIATTN_EXPECTS(static_cast<int>(blocks.size()) <= config_.blocks_per_seq(),
                    "add_sequence(blocks, tokens): " + std::to_string(blocks.size()) +
                        " blocks exceed the block-table row of " + std::to_string(config_.blocks_per_seq()));
    TRIATTN_EXPECTS(tokens % bs == 0 || copies_blocks,
                    "add_sequence(blocks, tokens): tokens = " + std::to_string(tokens) +
                        " ends inside a block, which needs copy-on-write, but the compactor has no copy_block(); "
                        "share a multiple of block_size = " + std::to_string(bs) + " tokens");
    for (const index_type b : blocks)
      TRIATTN_EXPECTS(b >= 0 && static_cast<std::size_t>(b) < allocator_.capacity() && allocator_.ref_count(b) > 0,
                      "add_sequence(blocks, tokens): block " + std::to_string(b) + " is not a live block of this cache");
    return open_shared(blocks, tokens, tokens, false);
  }

  /// Points block `j` of `seq` at `block`, a live block that holds the same tokens at the same
  /// positions (e.g. the prefix cache's copy of a prompt block this sequence computed again; see
  /// publish_prompt). The sequence's own block loses its reference (freed if it was the last);
  /// from then on the block is shared like a prefix hit: never rewritten, protected from rounds.
  /// @throws logic_error (nothing changed) unless block j is full and its slots still hold the
  /// sequence's tokens in order, and `block` is a live block of this cache.
  void share_block(SeqId seq, int j, index_type block) {
    const SeqState& s = state(seq, "share_block");
    const int bs = config_.block_size;
    const int in_place = std::min(lens_[idx(seq)], s.in_place);
    TRIATTN_EXPECTS(j >= 0 && static_cast<std::int64_t>(j + 1) * bs <= in_place,
                    "share_block: block " + std::to_string(j) + " of sequence " + std::to_string(seq) +
                        " is not a full block of its first " + std::to_string(in_place) + " tokens in order");
    TRIATTN_EXPECTS(block >= 0 && static_cast<std::size_t>(block) < allocator_.capacity() && allocator_.ref_count(block) > 0,
                    "share_block: block " + std::to_string(block) + " is not a live block of this cache");
    index_type& slot = tables_[row(seq) + static_cast<std::size_t>(j)];
    if (slot == block) return;
    allocator_.retain(block);
    allocator_.release(slot);
    slot = block;
  }

  /// Leading tokens of `seq` that sit in blocks it shares (reference count > 1: another sequence
  /// or the prefix cache holds them). Compression rounds protect them: they are never selected
  /// away, moved or rewritten.
  [[nodiscard]] int shared_prefix(SeqId seq) const {
    (void)state(seq, "shared_prefix");
    const int nb = num_blocks_of(seq);
    int j = 0;
    while (j < nb && allocator_.ref_count(tables_[row(seq) + static_cast<std::size_t>(j)]) > 1) ++j;
    return std::min(lens_[idx(seq)], j * config_.block_size);
  }

  /// Largest `tokens` fork_prefix(seq, tokens) accepts: whole blocks whose slots still hold the
  /// sequence's first tokens in order.
  [[nodiscard]] int forkable_prefix(SeqId seq) const {
    const SeqState& s = state(seq, "forkable_prefix");
    const int n = std::min(lens_[idx(seq)], s.in_place);
    return n - n % config_.block_size;
  }

  /// Frees the sequence's blocks (shared ones lose one reference) and its slot.
  void release(SeqId seq) {
    (void)state(seq, "release");
    const int nb = num_blocks_of(seq);
    for (int j = 0; j < nb; ++j) {
      allocator_.release(tables_[row(seq) + j]);
      tables_[row(seq) + j] = -1;
    }
    lens_[idx(seq)] = 0;
    seqs_[idx(seq)] = SeqState{};
    free_seq_slots_.push_back(seq);
    // Scorers that keep per-sequence state (SnapKV's query window) must not leak it to the
    // next sequence that gets this slot.
    if constexpr (requires { scorer_.forget(seq); }) scorer_.forget(seq);
  }

  // ---- appending ------------------------------------------------------------------------------

  /// Blocks extend(seq, n) would allocate: those past the sequence's current blocks, plus one
  /// when its last block is shared and partly filled (copied before the first write into it).
  [[nodiscard]] int blocks_to_extend(SeqId seq, int n) const {
    (void)state(seq, "blocks_to_extend");
    TRIATTN_EXPECTS(n >= 0, "blocks_to_extend: n = " + std::to_string(n) + " must be non-negative");
    return extend_need(seq, n).blocks();
  }

  /// Makes room for n new tokens at the end of `seq` (allocating blocks all-or-nothing) and
  /// advances its physical length and logical position by n. The caller then writes the
  /// tokens' K/V at slots [first_slot, first_slot + n), layer by layer (write() on the CPU, the
  /// append kernel on the GPU).
  [[nodiscard]] AppendResult extend(SeqId seq, int n, Phase phase = Phase::kDecode) {
    SeqState& s = state(seq, "extend");
    TRIATTN_EXPECTS(n >= 0, "extend: n = " + std::to_string(n) + " must be non-negative");
    const int len = lens_[idx(seq)];
    // Checked before anything changes: a refused call leaves the cache exactly as it was.
    TRIATTN_EXPECTS(phase != Phase::kPrefill || s.prompt_len == len,
                    "extend: prefill tokens must come before any decode token (sequence " + std::to_string(seq) +
                        " caches " + std::to_string(len) + " tokens of which " + std::to_string(s.prompt_len) +
                        " are prompt)");
    const std::int64_t new_len = static_cast<std::int64_t>(len) + n;
    const std::int64_t cap = static_cast<std::int64_t>(config_.blocks_per_seq()) * config_.block_size;
    const int have = num_blocks_of(seq);
    const ExtendNeed en = extend_need(seq, n);
    const int need = en.fresh;
    const bool cow = en.cow;
    TRIATTN_EXPECTS(!cow || copies_blocks, "extend: sequence " + std::to_string(seq) +
                                               " would write into a shared block and the compactor cannot copy it");
    AppendResult r{AppendStatus::kOk, len, en.blocks()};
    if (new_len > cap) {  // the block-table row is full: same typed outcome as an empty pool
      r.status = AppendStatus::kOutOfBlocks;
      return r;
    }
    if (r.blocks_needed > 0) {
      fresh_.resize(static_cast<std::size_t>(r.blocks_needed));  // may throw: nothing changed yet
      if (!allocator_.allocate(std::span<index_type>(fresh_))) {
        r.status = AppendStatus::kOutOfBlocks;
        return r;
      }
      if (cow) copy_on_write(seq, have - 1, fresh_.back());
      std::copy_n(fresh_.begin(), need > 0 ? need : 0, tables_.begin() + static_cast<std::ptrdiff_t>(row(seq) + have));
    }
    // Positions need no work here: appended slots hold logical - length + slot (position_of).
    lens_[idx(seq)] = static_cast<index_type>(new_len);
    s.logical += n;
    if (phase == Phase::kPrefill) s.prompt_len += n;
    else if (n > 0) s.decoded = true;
    return r;
  }

  /// Writes K and V of n tokens of one layer at slots [first_slot, first_slot + n), CPU path.
  /// k, v: [n, num_kv_heads, head_dim] of the cache's dtype.
  template <class T>
  void write(SeqId seq, int layer, int first_slot, const T* k, const T* v, int n)
    requires(memory_space == MemorySpace::kHost)
  {
    check_dtype<T>("write");
    check_write("write", seq, layer, first_slot, k != nullptr && v != nullptr, n);
    host::append(view<T>(), seq, layer, first_slot, k, v, n);
  }

  /// write() from float K and V of any cache dtype, each element rounded to the cache's dtype
  /// (fp8: x / scale of its layer and head, nearest even, saturating at +-448), CPU path.
  void write_values(SeqId seq, int layer, int first_slot, const float* k, const float* v, int n)
    requires(memory_space == MemorySpace::kHost)
  {
    check_write("write_values", seq, layer, first_slot, k != nullptr && v != nullptr, n);
    dispatch_dtype([&](auto tag) { host::append_values(view<typename decltype(tag)::type>(), seq, layer, first_slot, k, v, n); });
  }

  /// extend() + write() for every layer, CPU path. k, v: [num_layers, n, num_kv_heads, head_dim].
  /// On kOutOfBlocks nothing was written and nothing changed.
  template <class T>
  [[nodiscard]] AppendResult append(SeqId seq, std::span<const T> k, std::span<const T> v, int n,
                                    Phase phase = Phase::kDecode)
    requires(memory_space == MemorySpace::kHost)
  {
    check_dtype<T>("append");
    return append_layers("append", seq, k, v, n, phase,
                         [&](int l, const T* kl, const T* vl, int first) { write(seq, l, first, kl, vl, n); });
  }

  /// append() from float K and V of any cache dtype, rounded as write_values() does (the
  /// quantising append of fp8 caches). k, v: [num_layers, n, num_kv_heads, head_dim] floats.
  [[nodiscard]] AppendResult append_values(SeqId seq, std::span<const float> k, std::span<const float> v, int n,
                                           Phase phase = Phase::kDecode)
    requires(memory_space == MemorySpace::kHost)
  {
    return append_layers("append_values", seq, k, v, n, phase, [&](int l, const float* kl, const float* vl, int first) {
      write_values(seq, l, first, kl, vl, n);
    });
  }

  // ---- compaction -----------------------------------------------------------------------------

  /// Compacts every (layer, KV head) of `seq` to the plan's kept slots, in order, into slots
  /// 0..keep-1, and frees the blocks past ceil(keep / block_size). The logical position is
  /// unchanged; the prompt length becomes min(prompt length, first slot the plan moves in any
  /// row), the prompt prefix that is still in place. @throws logic_error (cache unchanged) on a
  /// bad plan, when compaction would rewrite a block shared with another sequence, or when it
  /// would leave a shared block partly filled (the next append would write into it).
  void apply_keep_plan(SeqId seq, const KeepPlan& plan) {
    (void)state(seq, "apply_keep_plan");
    check_host_positions("apply_keep_plan");
    check_keep_plan(seq, plan, "apply_keep_plan");
    commit_keep_plan(seq, plan);
  }

  /// True when `seq`'s counted length reached budget + divide_length (the selector's trigger).
  [[nodiscard]] bool needs_compression(SeqId seq) const
    requires(!std::is_same_v<selector_type, NoSelector>)
  {
    const SeqState& s = state(seq, "needs_compression");
    return selector_.should_compress(lens_[idx(seq)], s.prompt_len, s.decoded);
  }

  /// One compression round for `seq`: score every cached key, select the keep set, compact, free
  /// tail blocks (the batched round's host pieces, core/round_types.hpp). On a device cache whose
  /// scorer provides compress_round(cache, seqs, reports) (cuda::TriAttentionDeviceScorer with
  /// device tables and a selector with SelectionParams) the whole round runs on the device, as
  /// cuda::DeviceRounds runs it, and returns once it is done: scores and keep sets never come to
  /// the host. With CacheConfig::track_positions the report carries the kept tokens' original
  /// positions (a device cache keeps them on the device: positions_on_device). A sequence with
  /// non-finite scores (NonFinitePolicy::kRefuse) is left unchanged and reported kNonFinite.
  /// @throws logic_error (cache unchanged) on a bad id or when compaction would rewrite a shared
  /// block.
  CompressionReport compress(SeqId seq)
    requires(!std::is_same_v<scorer_type, NoScorer> && !std::is_same_v<selector_type, NoSelector>)
  {
    const SeqId one[1] = {seq};
    return round(std::span<const SeqId>(one, 1), false, "compress").front();
  }

  /// One batched round over the sequences of `seqs` whose trigger fired; returns a report per such
  /// sequence, in order. Atomic for bad input: every id is checked (active, no duplicates) and every
  /// plan is computed and checked before any sequence changes, so a throw leaves the cache as it was.
  /// Per-sequence data problems do not throw: a sequence with non-finite scores is left unchanged
  /// and reported kNonFinite (NonFinitePolicy::kEvictFirst lets it compress instead), the others
  /// complete. (A selector without SelectionParams, or a tensor-parallel one, decides itself: it
  /// may throw, still before anything changed.) On a device cache the round runs on the device
  /// when the scorer provides compress_round (see compress).
  std::vector<CompressionReport> compress_if_needed(std::span<const SeqId> seqs)
    requires(!std::is_same_v<scorer_type, NoScorer> && !std::is_same_v<selector_type, NoSelector>)
  {
    return round(seqs, true, "compress_if_needed");
  }

  /// Host bookkeeping of a round whose compaction ran elsewhere over view() (a device round):
  /// for every batch entry b with out.status[b] == kCompressed, the sequence's length becomes
  /// out.new_lens[b], the blocks past it are released, and its prompt state follows
  /// out.first_moved[b]. O(batch + blocks freed), nothing allocated once `reports` has grown.
  /// With CacheConfig::track_positions, out.kept ([batch, out.kept_rows, out.max_keep] pre-round
  /// slots, slot_positions null) is required and the positions follow it (O(kept slots)). Call
  /// it only once the compaction is complete (after its event), never while a kernel may still
  /// touch the freed blocks. Entries with another status are left as they are. `reports` gets one
  /// report per batch entry, in order.
  /// @throws logic_error (cache unchanged) when an id, length, first moved slot or kept row is
  /// inconsistent, or a compaction would have rewritten a shared block.
  void commit_round(std::span<const SeqId> seqs, const RoundOutputs& out, std::vector<CompressionReport>& reports) {
    const ModelGeometry& g = config_.model;
    const bool positions = config_.track_positions && !tracks_positions_on_device;  // mapped here
    TRIATTN_EXPECTS(seqs.empty() || (out.new_lens != nullptr && out.status != nullptr),
                    "commit_round: out.new_lens and out.status must not be null");
    TRIATTN_EXPECTS(seqs.empty() || !positions || out.kept != nullptr,
                    "commit_round: the cache tracks positions (CacheConfig::track_positions), so out.kept (pre-round "
                    "slots) must not be null");
    TRIATTN_EXPECTS(seqs.empty() || out.kept != nullptr || out.first_moved != nullptr,
                    "commit_round: out.first_moved (or out.kept) must not be null");
    TRIATTN_EXPECTS(out.kept == nullptr || out.slot_positions == nullptr,
                    "commit_round: out.kept must hold pre-round slots (slot_positions null); the cache maps positions");
    TRIATTN_EXPECTS(seqs.empty() || out.kept == nullptr || out.kept_rows == g.num_layers * g.num_kv_heads ||
                        out.kept_rows == g.num_kv_heads || out.kept_rows == 1,
                    "commit_round: out.kept_rows = " + std::to_string(out.kept_rows) +
                        " must be 1, num_kv_heads or num_layers * num_kv_heads");
    check_batch_ids(seqs, "commit_round");
    const bool with_plans = out.kept != nullptr;
    if (with_plans) plans_.resize(seqs.size());
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      if (out.status[b] != static_cast<std::int32_t>(RoundStatus::kCompressed)) continue;
      const int len = lens_[idx(seqs[b])];
      const int keep = out.new_lens[b];
      TRIATTN_EXPECTS(keep >= 0 && keep <= len && (!with_plans || keep <= out.max_keep),
                      "commit_round: new length " + std::to_string(keep) + " of sequence " + std::to_string(seqs[b]) +
                          " is outside [0, its length " + std::to_string(len) + "]" +
                          (with_plans ? " or above max_keep = " + std::to_string(out.max_keep) : std::string()));
      if (with_plans) {
        KeepPlan& plan = plans_[b];
        plan = KeepPlan(g.num_layers, g.num_kv_heads, keep);
        for (int l = 0; l < g.num_layers; ++l)
          for (int h = 0; h < g.num_kv_heads; ++h) {
            const int r = out.kept_rows == 1 ? 0 : out.kept_rows == g.num_kv_heads ? h : l * g.num_kv_heads + h;
            std::copy_n(out.kept + (static_cast<std::size_t>(b) * out.kept_rows + r) * out.max_keep, keep, plan.row(l, h));
          }
        check_keep_plan(seqs[b], plan, "commit_round");
        TRIATTN_EXPECTS(out.first_moved == nullptr || out.first_moved[b] == plan.first_moved(),
                        "commit_round: out.first_moved = " + std::to_string(out.first_moved[b]) + " of sequence " +
                            std::to_string(seqs[b]) + " disagrees with its kept slots (first moved " +
                            std::to_string(plan.first_moved()) + ")");
      } else {
        const int first = out.first_moved[b];
        TRIATTN_EXPECTS(first >= 0 && first <= keep,
                        "commit_round: out.first_moved = " + std::to_string(first) + " of sequence " +
                            std::to_string(seqs[b]) + " is outside [0, new length " + std::to_string(keep) + "]");
        check_compaction_blocks(seqs[b], first, keep, "commit_round");
      }
    }
    reports.clear();
    reports.reserve(seqs.size());
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const SeqId q = seqs[b];
      if (out.status[b] != static_cast<std::int32_t>(RoundStatus::kCompressed)) {
        reports.push_back(unchanged_report(q, static_cast<RoundStatus>(out.status[b])));
        continue;
      }
      if (positions) {
        reports.push_back(commit_with_report(q, plans_[b], g.num_layers * g.num_kv_heads));
        continue;
      }
      const int first = with_plans ? plans_[b].first_moved() : out.first_moved[b];
      reports.push_back(commit_counts(q, out.new_lens[b], first));
      if (config_.track_positions) {  // the device round mapped them into its position store
        seqs_[idx(q)].positions_len = out.new_lens[b];
        reports.back().positions_on_device = true;
      }
    }
  }

  /// commit_round(seqs, out, reports) returning the reports of the kCompressed entries only.
  std::vector<CompressionReport> commit_round(std::span<const SeqId> seqs, const RoundOutputs& out) {
    std::vector<CompressionReport> all;
    commit_round(seqs, out, all);
    std::erase_if(all, [](const CompressionReport& r) { return r.status != RoundStatus::kCompressed; });
    return all;
  }

  // ---- queries --------------------------------------------------------------------------------

  /// True when this cache's tracked positions (CacheConfig::track_positions) live in device
  /// memory, kept by cuda::DeviceRounds; host rounds are then refused.
  static constexpr bool tracks_positions_on_device = memory_space == MemorySpace::kDevice;

  /// Where `seq`'s slots hold their positions implicitly (PositionState): what a device round
  /// that maps tracked positions needs.
  [[nodiscard]] PositionState position_state(SeqId seq) const {
    const SeqState& s = state(seq, "position_state");
    const int len = lens_[idx(seq)];
    return {std::min(s.in_place, len), std::min(s.positions_len, len)};
  }

  /// Original logical position of every slot of row (layer, kv_head) of `seq`
  /// ([physical_length]). Host caches with CacheConfig::track_positions only.
  [[nodiscard]] std::vector<std::int32_t> positions(SeqId seq, int layer, int kv_head) const {
    const SeqState& s = state(seq, "positions");
    TRIATTN_EXPECTS(config_.track_positions && !tracks_positions_on_device,
                    "positions: only a host cache with CacheConfig::track_positions keeps them here");
    TRIATTN_EXPECTS(layer >= 0 && layer < config_.model.num_layers && kv_head >= 0 && kv_head < config_.model.num_kv_heads,
                    "positions: (layer " + std::to_string(layer) + ", kv head " + std::to_string(kv_head) +
                        ") is outside the model");
    const int len = lens_[idx(seq)];
    const std::size_t c = static_cast<std::size_t>(layer) * config_.model.num_kv_heads + kv_head;
    std::vector<std::int32_t> p(static_cast<std::size_t>(len));
    for (int i = 0; i < len; ++i) p[static_cast<std::size_t>(i)] = position_of(s, len, i, c);
    return p;
  }

  /// Block ids of `seq`, in slot order ([ceil(physical_length / block_size)]).
  [[nodiscard]] std::span<const index_type> block_table(SeqId seq) const {
    (void)state(seq, "block_table");
    return {tables_.data() + row(seq), static_cast<std::size_t>(num_blocks_of(seq))};
  }
  /// Next RoPE position: tokens processed so far (never decreases).
  [[nodiscard]] std::int64_t logical_position(SeqId seq) const { return state(seq, "logical_position").logical; }
  /// Cached tokens (what attention reads and where the next token is written).
  [[nodiscard]] int physical_length(SeqId seq) const {
    (void)state(seq, "physical_length");
    return lens_[idx(seq)];
  }
  /// Prompt (prefill) tokens of `seq`; they occupy slots [0, prompt_length) while pinned.
  /// Never more than physical_length (compaction that moves prompt slots shortens it).
  [[nodiscard]] int prompt_length(SeqId seq) const { return state(seq, "prompt_length").prompt_len; }
  [[nodiscard]] bool is_active(SeqId seq) const noexcept {
    return live_.live && seq >= 0 && seq < config_.max_seqs && seqs_[idx(seq)].active;
  }
  [[nodiscard]] int num_active() const noexcept {
    return live_.live ? config_.max_seqs - static_cast<int>(free_seq_slots_.size()) : 0;
  }

  [[nodiscard]] MemoryStats memory() const {
    check_live("memory");
    MemoryStats m;
    m.blocks_total = allocator_.capacity();
    m.blocks_free = allocator_.num_free();
    m.blocks_used = m.blocks_total - m.blocks_free;
    m.bytes_resident = allocator_.bytes_resident();
    m.bytes_in_used_blocks = m.blocks_used * static_cast<std::size_t>(config_.block_bytes_all_ranges());
    for (int s = 0; s < config_.max_seqs; ++s) {
      if (!seqs_[static_cast<std::size_t>(s)].active) continue;
      m.cached_tokens += lens_[static_cast<std::size_t>(s)];
      m.logical_tokens += seqs_[static_cast<std::size_t>(s)].logical;
    }
    m.bytes_live = static_cast<std::size_t>(m.cached_tokens) * static_cast<std::size_t>(config_.token_bytes());
    return m;
  }

  /// View for kernels and the CPU reference. T must be the configured dtype's storage type.
  /// Block tables, lengths and fp8 scales are the allocator's published copy (device memory for
  /// device allocators, after their publish step; the host arrays otherwise).
  template <class T>
  [[nodiscard]] KvCacheView<T, index_type> view() const {
    check_live("view");
    check_dtype<T>("view");
    const index_type* tables = tables_.data();
    const index_type* lens = lens_.data();
    const float* scales = config_.kv_scales.empty() ? nullptr : config_.kv_scales.data();
    if constexpr (requires { allocator_.published_tables(); }) {
      tables = allocator_.published_tables();
      lens = allocator_.published_lengths();
    }
    if constexpr (requires { allocator_.published_scales(); }) scales = allocator_.published_scales();
    return KvCacheView<T, index_type>::contiguous(
               static_cast<T*>(allocator_.data()),
               allocator_.range_stride_bytes() / static_cast<std::int64_t>(sizeof(T)), config_.block_layout(),
               config_.model.num_layers, config_.num_blocks, config_.max_seqs, config_.blocks_per_seq(), tables, lens)
        .with_scales(scales, config_.kv_scale_heads());
  }
  /// Host copies of the block tables ([max_seqs, max_blocks_per_seq], -1 padded) and physical
  /// lengths ([max_seqs]): what an engine's own page table is built from.
  [[nodiscard]] std::span<const index_type> host_block_tables() const noexcept { return tables_; }
  [[nodiscard]] std::span<const index_type> host_lengths() const noexcept { return lens_; }

  [[nodiscard]] const CacheConfig& config() const noexcept { return config_; }
  [[nodiscard]] allocator_type& allocator() noexcept { return allocator_; }
  [[nodiscard]] const allocator_type& allocator() const noexcept { return allocator_; }
  [[nodiscard]] compactor_type& compactor() noexcept { return compactor_; }
  [[nodiscard]] scorer_type& scorer() noexcept { return scorer_; }
  [[nodiscard]] selector_type& selector() noexcept { return selector_; }

  /// True when the compactor can copy blocks, i.e. sequences may share a block partly
  /// (add_sequence(blocks, tokens) with tokens inside a block; extend() copies on write).
  static constexpr bool copies_blocks =
      requires(compactor_type& c, const KvCacheView<float, index_type>& v, index_type b) { c.copy_block(v, b, b); };

  // ---- relocation -----------------------------------------------------------------------------

  /// True when the allocator can plan relocations (VmmAllocatorCore, cuda::VmmAllocator and
  /// wrappers of them) and the compactor can copy blocks.
  static constexpr bool relocates_blocks =
      copies_blocks && requires(allocator_type& a, std::span<const index_type> m) { a.plan_relocation(m, std::size_t{1}); };

  /// Moves blocks out of sparsely used allocator slabs so that whole slabs empty: compaction keeps
  /// each sequence's first blocks, so after a round every slab may still hold a few survivors of
  /// several sequences and nothing can be unmapped. Only blocks a single sequence holds alone
  /// (reference count 1) move; shared prefix blocks and blocks only a prefix cache holds stay
  /// where they are, and a slab holding one stays mapped. At most `max_blocks` blocks move. The
  /// copies go through the compactor (on its stream for a device cache, a run of adjacent blocks
  /// per call), the block tables are repointed and the old blocks released; the allocator's
  /// trim(stream) afterwards gives the emptied slabs back once the copies are done. Lengths,
  /// positions and blocks in use are unchanged. A device cache must publish its tables again
  /// before kernels read them (cuda::publish; the next append does).
  /// @throws logic_error (cache unchanged) on a device cache that tracks positions in device
  /// memory (its position store is indexed by block); the compactor's error (tables unchanged,
  /// the new blocks released) when a copy cannot be issued.
  RelocationReport relocate_blocks(std::size_t max_blocks = std::numeric_limits<std::size_t>::max())
    requires relocates_blocks
  {
    check_live("relocate_blocks");
    TRIATTN_EXPECTS(!(config_.track_positions && tracks_positions_on_device),
                    "relocate_blocks: this device cache tracks positions in device memory "
                    "(CacheConfig::track_positions), indexed by block; relocation does not move them");
    movable_.clear();
    owner_of_.resize(static_cast<std::size_t>(config_.num_blocks), -1);
    for (int q = 0; q < config_.max_seqs; ++q) {
      if (!seqs_[idx(q)].active) continue;
      const int nb = num_blocks_of(q);
      for (int j = 0; j < nb; ++j) {
        const std::size_t at = row(q) + static_cast<std::size_t>(j);
        const index_type b = tables_[at];
        if (allocator_.ref_count(b) != 1) continue;
        movable_.push_back(b);
        owner_of_[static_cast<std::size_t>(b)] = static_cast<std::int64_t>(at);
      }
    }
    RelocationReport rep;
    const auto plan = allocator_.plan_relocation(std::span<const index_type>(movable_), max_blocks);
    if (plan.from.empty()) return rep;
    try {
      dispatch_dtype([&](auto tag) {
        using T = typename decltype(tag)::type;
        const KvCacheView<T, index_type> v = view<T>();
        for (std::size_t i = 0; i < plan.from.size();) {
          std::size_t n = 1;
          if constexpr (requires { compactor_.copy_blocks(v, index_type{0}, index_type{0}, index_type{1}); }) {
            while (i + n < plan.from.size() && plan.from[i + n] == plan.from[i] + static_cast<index_type>(n) &&
                   plan.to[i + n] == plan.to[i] + static_cast<index_type>(n))
              ++n;
            compactor_.copy_blocks(v, plan.from[i], plan.to[i], static_cast<index_type>(n));
          } else {
            compactor_.copy_block(v, plan.from[i], plan.to[i]);
          }
          ++rep.copies;
          i += n;
        }
      });
    } catch (...) {
      for (const index_type b : plan.to) allocator_.release(b);
      throw;
    }
    for (std::size_t i = 0; i < plan.from.size(); ++i) {
      tables_[static_cast<std::size_t>(owner_of_[static_cast<std::size_t>(plan.from[i])])] = plan.to[i];
      allocator_.release(plan.from[i]);
    }
    rep.blocks_moved = plan.from.size();
    rep.slabs_emptied = plan.slabs.size();
    rep.bytes_freed = plan.bytes_freed;
    return rep;
  }

 private:
  struct SeqState {
    bool active = false;
    std::int64_t logical = 0;  ///< tokens processed (next RoPE position)
    int prompt_len = 0;        ///< prefill tokens still in place in slots [0, prompt_len)
    bool decoded = false;      ///< a decode token was appended (prompt_len alone cannot tell once compaction shortened it)
    int in_place = std::numeric_limits<int>::max();  ///< slots [0, in_place) still hold tokens 0..in_place-1
    /// CacheConfig::track_positions only: [layers * kv_heads, positions_len], the original logical
    /// position of slots [0, positions_len) per (layer, KV head) as the last compaction left them;
    /// later slots were appended since and hold logical - length + slot (position_of). Empty otherwise.
    std::vector<std::int32_t> positions;
    int positions_len = 0;
  };

  // Storage types this cache's policies take: every dtype on the host, the kernels' on a device.
  using kv_storage_types =
      std::conditional_t<memory_space == MemorySpace::kHost, all_storage_types, device_storage_types>;
  static constexpr const char* kDtypeUser = memory_space == MemorySpace::kHost ? "KvCache" : "KvCache on the GPU";

  static const CacheConfig& validated(const CacheConfig& c) {
    c.validate();
    triattn::dispatch_dtype_in(kv_storage_types{}, c.dtype, kDtypeUser, [](auto) {});  // refuses fp8 on a device
    return c;
  }

  // Returns the argument of type P with its value category: lvalues (const or not) are copied
  // from, rvalues moved from (a caller's lvalue policy is never moved from behind its back).
  template <class P, class First, class... Rest>
  static decltype(auto) pick_arg(First&& first, Rest&&... rest) {
    if constexpr (std::is_same_v<std::remove_cvref_t<First>, P>) return std::forward<First>(first);
    else return pick_arg<P>(std::forward<Rest>(rest)...);
  }
  template <class P, class... Given>
  static P make_policy(const CacheConfig& cfg, Given&&... given) {
    if constexpr ((std::is_same_v<std::remove_cvref_t<Given>, P> || ...)) return P(pick_arg<P>(std::forward<Given>(given)...));
    else if constexpr (std::is_constructible_v<P, const CacheConfig&>) return P(cfg);
    else return P{};
  }

  template <class F>
  void dispatch_dtype(F&& f) const {
    triattn::dispatch_dtype_in(kv_storage_types{}, config_.dtype, kDtypeUser, std::forward<F>(f));
  }

  // write()'s checks: a live sequence, a layer in range, slots inside its length, no shared block.
  void check_write(const char* op, SeqId seq, int layer, int first_slot, bool have_data, int n) const {
    (void)state(seq, op);
    TRIATTN_EXPECTS(layer >= 0 && layer < config_.model.num_layers, std::string(op) + ": layer " + std::to_string(layer) +
                                                                        " out of [0, " +
                                                                        std::to_string(config_.model.num_layers) + ")");
    TRIATTN_EXPECTS(n >= 0 && first_slot >= 0 && static_cast<std::int64_t>(first_slot) + n <= lens_[idx(seq)],
                    std::string(op) + ": slots [" + std::to_string(first_slot) + ", " +
                        std::to_string(static_cast<std::int64_t>(first_slot) + n) + ") are outside the sequence's length " +
                        std::to_string(lens_[idx(seq)]) + " (call extend first)");
    TRIATTN_EXPECTS(n == 0 || have_data, std::string(op) + ": k and v must not be null");
    for (int j = first_slot / config_.block_size; n > 0 && j <= (first_slot + n - 1) / config_.block_size; ++j) {
      const index_type b = tables_[row(seq) + static_cast<std::size_t>(j)];
      TRIATTN_EXPECTS(allocator_.ref_count(b) == 1,
                      std::string(op) + ": slots [" + std::to_string(first_slot) + ", " + std::to_string(first_slot + n) +
                          ") fall in block " + std::to_string(b) + " that sequence " + std::to_string(seq) +
                          " shares with another sequence; shared prefix blocks are never rewritten");
    }
  }

  // append()'s body: checks the sizes, extends, then write_layer(l, k_l, v_l, first_slot) per layer.
  template <class E, class W>
  AppendResult append_layers(const char* op, SeqId seq, std::span<const E> k, std::span<const E> v, int n, Phase phase,
                             W&& write_layer) {
    (void)state(seq, op);
    TRIATTN_EXPECTS(n >= 0, std::string(op) + ": n = " + std::to_string(n) + " must be non-negative");
    const std::size_t per_layer = static_cast<std::size_t>(n) * config_.model.num_kv_heads * config_.model.head_dim;
    const std::size_t expect = per_layer * static_cast<std::size_t>(config_.model.num_layers);
    TRIATTN_EXPECTS(k.size() == expect && v.size() == expect,
                    std::string(op) + ": k has " + std::to_string(k.size()) + " and v " + std::to_string(v.size()) +
                        " elements; for n = " + std::to_string(n) +
                        " tokens [num_layers, n, num_kv_heads, head_dim] = " + std::to_string(expect));
    const AppendResult r = extend(seq, n, phase);
    if (!r.ok()) return r;
    for (int l = 0; l < config_.model.num_layers; ++l)
      write_layer(l, k.data() + l * per_layer, v.data() + l * per_layer, r.first_slot);
    return r;
  }

  template <class T>
  void check_dtype(const char* op) const {
    TRIATTN_EXPECTS(dtype_of<T> == config_.dtype, std::string(op) + ": element type is " + dtype_name(dtype_of<T>) +
                                                     " but the cache stores " + dtype_name(config_.dtype));
  }

  // Cleared in the source of a move, whose members are then empty: every call on a moved-from
  // cache throws instead of reading them (assigning a cache to it makes it usable again).
  struct LiveFlag {
    bool live = true;
    LiveFlag() = default;
    LiveFlag(LiveFlag&& o) noexcept : live(std::exchange(o.live, false)) {}
    LiveFlag& operator=(LiveFlag&& o) noexcept {
      live = std::exchange(o.live, false);
      return *this;
    }
  };
  void check_live(const char* op) const {
    TRIATTN_EXPECTS(live_.live, std::string(op) + ": this is a moved-from KvCache (it holds nothing; assign a cache to it)");
  }

  SeqState& state(SeqId seq, const char* op) {
    return const_cast<SeqState&>(static_cast<const KvCache*>(this)->state(seq, op));
  }
  const SeqState& state(SeqId seq, const char* op) const {
    check_live(op);
    TRIATTN_EXPECTS(seq >= 0 && seq < config_.max_seqs,
                    std::string(op) + ": sequence " + std::to_string(seq) + " is not a sequence id of this cache");
    const SeqState& s = seqs_[idx(seq)];
    TRIATTN_EXPECTS(s.active, std::string(op) + ": sequence " + std::to_string(seq) + " is not active (released or never added)");
    return s;
  }
  static std::size_t idx(SeqId s) noexcept { return static_cast<std::size_t>(s); }
  std::size_t row(SeqId s) const noexcept { return idx(s) * static_cast<std::size_t>(config_.blocks_per_seq()); }
  int num_blocks_of(SeqId s) const noexcept {
    return static_cast<int>(detail::ceil_div(lens_[idx(s)], config_.block_size));
  }
  std::size_t position_rows() const noexcept {
    return static_cast<std::size_t>(config_.model.num_layers) * static_cast<std::size_t>(config_.model.num_kv_heads);
  }
  // Original logical position of `slot` in (layer, KV head) row c of a sequence of `len` slots.
  static std::int32_t position_of(const SeqState& s, int len, int slot, std::size_t c) noexcept {
    if (slot < s.positions_len) return s.positions[c * static_cast<std::size_t>(s.positions_len) + static_cast<std::size_t>(slot)];
    return static_cast<std::int32_t>(s.logical - len + slot);
  }

  // Host rounds map tracked positions on the host; a device cache keeps them on the device.
  void check_host_positions(const char* op) const {
    TRIATTN_EXPECTS(!(config_.track_positions && tracks_positions_on_device),
                    std::string(op) + ": this device cache tracks positions in device memory "
                                      "(CacheConfig::track_positions), which only device rounds update (KvCache::compress "
                                      "with cuda::TriAttentionDeviceScorer, or cuda::DeviceRounds); run its rounds there");
  }

  // Every check apply_keep_plan makes, without changing anything.
  void check_keep_plan(SeqId seq, const KeepPlan& plan, const char* op) const {
    (void)state(seq, op);
    plan.validate(config_.model.num_layers, config_.model.num_kv_heads, lens_[idx(seq)]);
    check_compaction_blocks(seq, plan.first_moved(), plan.keep, op);
  }

  // A compaction of `seq` to `keep` slots that moves slots from `first_changed` on rewrites the
  // blocks from there to the new end, and may leave the last kept block partly filled: each of
  // them must be this sequence's alone.
  void check_compaction_blocks(SeqId seq, int first_changed, int keep, const char* op) const {
    const int len = lens_[idx(seq)];
    if (first_changed < keep) {
      const int b_end = static_cast<int>(detail::ceil_div(keep, config_.block_size));
      for (int j = first_changed / config_.block_size; j < b_end; ++j) {
        const index_type b = tables_[row(seq) + j];
        TRIATTN_EXPECTS(allocator_.ref_count(b) == 1,
                        std::string(op) + ": compaction would rewrite block " + std::to_string(b) + " (slots from " +
                            std::to_string(j * config_.block_size) + ") that sequence " + std::to_string(seq) +
                            " shares with another sequence; shared prefix blocks must stay untouched");
      }
    }
    if (keep < len && keep % config_.block_size != 0) {
      const int j = (keep - 1) / config_.block_size;
      const index_type b = tables_[row(seq) + static_cast<std::size_t>(j)];
      TRIATTN_EXPECTS(allocator_.ref_count(b) == 1,
                      std::string(op) + ": keeping " + std::to_string(keep) + " of " + std::to_string(len) +
                          " tokens would leave block " + std::to_string(b) + " (slots from " +
                          std::to_string(j * config_.block_size) + "), which sequence " + std::to_string(seq) +
                          " shares with another sequence, partly filled: the next append would rewrite it (keep a "
                          "multiple of block_size = " + std::to_string(config_.block_size) + " there)");
    }
  }

  // apply_keep_plan after check_keep_plan passed: compaction, positions (when tracked), then the
  // length, tail blocks and prompt state.
  void commit_keep_plan(SeqId seq, const KeepPlan& plan, bool compact = true) {
    SeqState& s = state(seq, "apply_keep_plan");
    const int len = lens_[idx(seq)];
    const int first_changed = plan.first_moved();
    if (first_changed < plan.keep && compact) {
      dispatch_dtype([&](auto tag) {
        using T = typename decltype(tag)::type;
        compactor_.apply(view<T>(), seq, plan);
      });
    }
    if (config_.track_positions) {
      const std::size_t keep = static_cast<std::size_t>(plan.keep);
      moved_.resize(keep * position_rows());
      for (int l = 0; l < plan.num_layers; ++l)
        for (int h = 0; h < plan.num_kv_heads; ++h) {
          const std::size_t c = static_cast<std::size_t>(l) * plan.num_kv_heads + h;
          const std::int32_t* r = plan.row(l, h);
          std::int32_t* dst = moved_.data() + c * keep;
          for (std::size_t i = 0; i < keep; ++i) dst[i] = position_of(s, len, r[i], c);
        }
      s.positions.swap(moved_);
      s.positions_len = plan.keep;
    }
    set_kept(seq, plan.keep, first_changed);
  }

  // The bookkeeping of a compaction to `keep` slots that moved slots from `first_changed` on.
  void set_kept(SeqId seq, int keep, int first_changed) {
    SeqState& s = seqs_[idx(seq)];
    shrink_to(seq, keep);
    s.prompt_len = std::min(s.prompt_len, first_changed);
    s.in_place = std::min({s.in_place, first_changed, keep});
  }

  CompressionReport unchanged_report(SeqId seq, RoundStatus status) const {
    CompressionReport r;
    r.seq = seq;
    r.length_before = r.length_after = lens_[idx(seq)];
    r.status = status;
    return r;
  }

  // A device round's commit without kept slots (positions not tracked): lengths and blocks only.
  CompressionReport commit_counts(SeqId seq, int keep, int first_changed) {
    CompressionReport rep;
    rep.seq = seq;
    rep.length_before = lens_[idx(seq)];
    rep.blocks_freed = num_blocks_of(seq);
    set_kept(seq, keep, first_changed);
    rep.length_after = keep;
    rep.blocks_freed -= num_blocks_of(seq);
    return rep;
  }

  // True when every (layer, KV head) pair holds the positions of the row of a `rows`-row report
  // that stands for it (kept_row_source).
  bool rows_agree(const SeqState& s, int len, int rows) const noexcept {
    const int L = config_.model.num_layers, H = config_.model.num_kv_heads;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const std::size_t c = static_cast<std::size_t>(l) * H + h;
        const std::size_t rep_c = rows == 1 ? 0 : static_cast<std::size_t>(h);
        if (c == rep_c) continue;
        for (int i = 0; i < len; ++i)
          if (position_of(s, len, i, c) != position_of(s, len, i, rep_c)) return false;
      }
    return true;
  }

  // commit_keep_plan plus the report (with tracked positions: kept positions in `rows` rows,
  // kept_row_source).
  CompressionReport commit_with_report(SeqId seq, const KeepPlan& plan, int rows, bool compact = false) {
    CompressionReport rep;
    rep.seq = seq;
    rep.length_before = lens_[idx(seq)];
    rep.blocks_freed = num_blocks_of(seq);
    commit_keep_plan(seq, plan, compact);
    rep.length_after = lens_[idx(seq)];
    rep.blocks_freed -= num_blocks_of(seq);
    if (!config_.track_positions) return rep;
    const SeqState& s = seqs_[idx(seq)];
    // A row standing for several (layer, KV head) pairs is exact only while they all hold the
    // same positions (plans applied through apply_keep_plan may differ per layer): else report all.
    if (rows != static_cast<int>(position_rows()) && !rows_agree(s, rep.length_after, rows))
      rows = static_cast<int>(position_rows());
    rep.has_positions = true;
    rep.kept_rows = rows;
    rep.kept_positions.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(rep.length_after));
    for (int r = 0; r < rows; ++r) {
      int l = 0, h = 0;
      kept_row_source(r, rows, config_.model.num_kv_heads, &l, &h);
      const std::size_t c = static_cast<std::size_t>(l) * config_.model.num_kv_heads + h;
      for (int i = 0; i < rep.length_after; ++i)
        rep.kept_positions[static_cast<std::size_t>(r) * rep.length_after + i] = position_of(s, rep.length_after, i, c);
    }
    return rep;
  }

  // Every id valid and active, none twice.
  // Steady state allocates nothing: one reused mark per slot, cleared again before returning.
  void check_batch_ids(std::span<const SeqId> seqs, const char* op) const {
    seen_.resize(static_cast<std::size_t>(config_.max_seqs), 0);
    std::size_t marked = 0;
    try {
      for (; marked < seqs.size(); ++marked) {
        const SeqId q = seqs[marked];
        (void)state(q, op);
        TRIATTN_EXPECTS(!seen_[idx(q)], std::string(op) + ": sequence " + std::to_string(q) + " appears twice");
        seen_[idx(q)] = 1;
      }
    } catch (...) {
      for (std::size_t i = 0; i < marked; ++i) seen_[idx(seqs[i])] = 0;
      throw;
    }
    for (SeqId q : seqs) seen_[idx(q)] = 0;
  }

  // The round of compress / compress_if_needed: ids checked, then every plan computed and
  // checked (nothing written), then every plan applied.
  std::vector<CompressionReport> round(std::span<const SeqId> seqs, bool only_due, const char* op) {
    check_batch_ids(seqs, op);
    // A scorer that runs the whole round where the cache lives (cuda::TriAttentionDeviceScorer on a
    // cache with device tables): scores, keep sets, compaction and tracked positions stay there.
    if constexpr (requires(std::vector<CompressionReport>& r) { scorer_.compress_round(*this, seqs, r); }) {
      round_seqs_.clear();
      for (SeqId q : seqs)
        if (!only_due || needs_compression(q)) round_seqs_.push_back(q);
      std::vector<CompressionReport> done;
      if (!round_seqs_.empty()) scorer_.compress_round(*this, std::span<const SeqId>(round_seqs_), done);
      return done;
    }
    check_host_positions(op);
    const ModelGeometry& g = config_.model;
    const ValidSelectionParams* params = nullptr;
    // Report-not-throw needs a selector whose SelectionParams describe it and that decides alone
    // (a tensor-parallel selector meets the other ranks in select(): every rank must call it).
    if constexpr (requires { { selector_.params() } -> std::convertible_to<const SelectionParams&>; } &&
                  !requires { selector_.collective(); })
      params = &selector_.params();
    int rows = static_cast<int>(position_rows());
    if constexpr (requires { { selector_.params() } -> std::convertible_to<const SelectionParams&>; })
      rows = kept_rows(selector_.params().mode, g.num_layers, g.num_kv_heads);
    struct Planned {
      SeqId seq;
      RoundStatus status;
      KeepPlan plan;
    };
    std::vector<Planned> planned;
    for (SeqId q : seqs) {
      if (only_due && !needs_compression(q)) continue;
      const int len = lens_[idx(q)];
      const SeqState& st = seqs_[idx(q)];
      scores_.resize(static_cast<std::size_t>(g.num_layers) * g.num_q_heads * len);
      Planned p{q, RoundStatus::kCompressed, KeepPlan{}};
      const auto select = [this, q](std::span<const float> sc, const ModelGeometry&, int n, int pl) {
        return select_plan(sc, q, n, pl);  // the shared prefix protected
      };
      dispatch_dtype([&](auto tag) {
        using T = typename decltype(tag)::type;
        p.status = triattn::detail::plan_round_one(view<T>(), scorer_, select, params, g, q, len, st.prompt_len,
                                                   shared_prefix(q), st.logical, std::span<float>(scores_), p.plan);
      });
      if (p.status == RoundStatus::kCompressed) check_keep_plan(q, p.plan, op);
      planned.push_back(std::move(p));
    }
    std::vector<CompressionReport> done;
    done.reserve(planned.size());
    for (Planned& p : planned) {
      if (p.status != RoundStatus::kCompressed) {
        done.push_back(unchanged_report(p.seq, p.status));
        continue;
      }
      done.push_back(commit_with_report(p.seq, p.plan, rows, true));
    }
    return done;
  }

  // The selector's plan for `seq`, its shared prefix protected (selectors that take no protected
  // length leave it to apply_keep_plan's shared-block checks).
  KeepPlan select_plan(std::span<const float> scores, SeqId seq, int len, int prompt_len) const
    requires(!std::is_same_v<selector_type, NoSelector>)
  {
    if constexpr (requires { selector_.select(scores, config_.model, len, prompt_len, len); })
      return selector_.select(scores, config_.model, len, prompt_len, shared_prefix(seq));
    else
      return selector_.select(scores, config_.model, len, prompt_len);
  }

  // Opens a sequence over `blocks` (retained) holding `tokens` tokens, `prompt` of them prompt.
  SeqId open_shared(std::span<const index_type> blocks, int tokens, int prompt, bool decoded) {
    const SeqId s = add_sequence();
    for (std::size_t j = 0; j < blocks.size(); ++j) {
      allocator_.retain(blocks[j]);
      tables_[row(s) + j] = blocks[j];
    }
    seqs_[idx(s)] = SeqState{true, tokens, prompt, decoded, std::numeric_limits<int>::max(), {}};
    lens_[idx(s)] = tokens;
    return s;
  }

  struct ExtendNeed {
    int fresh;  ///< blocks past the current ones (may be <= 0)
    bool cow;   ///< the last block is shared and partly filled: the first write copies it
    [[nodiscard]] int blocks() const noexcept { return (fresh > 0 ? fresh : 0) + (cow ? 1 : 0); }
  };
  [[nodiscard]] ExtendNeed extend_need(SeqId seq, int n) const {
    const int len = lens_[idx(seq)];
    const int have = num_blocks_of(seq);
    // int64: with block_size 1 an absurd n would overflow int before the capacity check.
    const std::int64_t need64 =
        detail::ceil_div<std::int64_t>(static_cast<std::int64_t>(len) + n, config_.block_size) - have;
    const int fresh = static_cast<int>(std::min<std::int64_t>(need64, std::numeric_limits<int>::max()));
    const bool cow = n > 0 && len % config_.block_size != 0 &&
                     allocator_.ref_count(tables_[row(seq) + static_cast<std::size_t>(have - 1)]) > 1;
    return {fresh, cow};
  }

  // Replaces block j of `seq` (shared) by its copy in `fresh` and drops the reference to the old
  // one. On a failed copy `fresh` goes back and the old block stays.
  void copy_on_write(SeqId seq, int j, index_type fresh) {
    index_type& slot = tables_[row(seq) + static_cast<std::size_t>(j)];
    if constexpr (copies_blocks) {
      try {
        dispatch_dtype([&](auto tag) {
          using T = typename decltype(tag)::type;
          compactor_.copy_block(view<T>(), slot, fresh);
        });
      } catch (...) {
        for (const index_type b : fresh_) allocator_.release(b);
        throw;
      }
    }
    const index_type old = slot;
    slot = fresh;
    allocator_.release(old);
  }

  void shrink_to(SeqId seq, int keep) {
    const int before = num_blocks_of(seq);
    const int after = static_cast<int>(detail::ceil_div(keep, config_.block_size));
    for (int j = after; j < before; ++j) {
      allocator_.release(tables_[row(seq) + j]);
      tables_[row(seq) + j] = -1;
    }
    lens_[idx(seq)] = keep;
  }

  CacheConfig config_;
  allocator_type allocator_;
  compactor_type compactor_;
  scorer_type scorer_;
  selector_type selector_;
  std::vector<SeqState> seqs_;          // [max_seqs]
  std::vector<index_type> tables_;      // [max_seqs, max_blocks_per_seq], -1 padded
  std::vector<index_type> lens_;        // [max_seqs] physical lengths
  std::vector<SeqId> free_seq_slots_;   // stack of unused sequence slots
  LiveFlag live_;
  std::vector<float> scores_;           // [L, Hq, len] scratch of compress()
  std::vector<index_type> fresh_;       // blocks allocated by one extend()
  std::vector<KeepPlan> plans_;         // commit_round's plans (tracked positions only)
  std::vector<std::int32_t> moved_;     // positions after a compaction (tracked positions only)
  std::vector<SeqId> round_seqs_;       // the sequences a scorer's compress_round compresses
  std::vector<index_type> movable_;     // relocate_blocks: blocks one sequence holds alone
  std::vector<std::int64_t> owner_of_;  // relocate_blocks: table entry of each such block [num_blocks]
  mutable std::vector<std::uint8_t> seen_;  // check_batch_ids' marks, all zero between calls
};

}  // namespace triattn
