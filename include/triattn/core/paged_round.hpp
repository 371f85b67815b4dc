// SPDX-License-Identifier: Apache-2.0
// The batched compression round over any paged cache a KvCacheView describes (triattn's own
// KvCache or an engine's tensors): for every sequence of the batch, score every cached key,
// normalise, select the keep set (SelectionParams, PruningMode), compact the kept K/V in place
// into slots [0, new_len), and report per sequence the new length, the kept tokens' original
// logical positions, which block-table columns are now free, and a status.
//
// One function shape, two memory spaces:
//   triattn::paged_round(view, scorer, params, trigger, batch, out, workspace, bytes)   host memory, the oracle
//   triattn::cuda::paged_round(view, model, params, trigger, batch, out, workspace, bytes, stream)
//                                                                     device memory, asynchronous
// Both read the same structs (RoundBatch, RoundOutputs) from their own memory space and use a
// caller-owned workspace sized by a query (no allocation on the device in steady state).
//
// The round never writes the view's block tables or lengths: the engine (or KvCache) applies
// new_lens and releases the columns [freed_begin, freed_end) of each sequence's table row once
// the round is done (on the device: after an event recorded behind it, never earlier).
//
// Shared blocks (prefix caching): a block that another row of the block tables also references
// (every row up to its length counts, in the batch or not) is never rewritten. A sequence's
// leading shared blocks are protected whole (effective_protected_prefix extends its
// protected_prefix over them); a shared block after a private one is refused, since compaction
// would move tokens across it.
//
// Errors (the same rule for every batch call): arguments are validated before anything is
// written (view, every table row the round reads, sequence ids, lengths, sizes, shared blocks,
// outputs or workspace overlapping each other or the inputs) and a bad one throws
// triattn::logic_error naming it, the cache untouched. The device round checks the same data on
// the device instead (RoundStatus::kInvalid, cuda::RoundError). Per-sequence data problems never throw: a sequence whose scores are
// not finite is left unchanged with RoundStatus::kNonFinite (NonFinitePolicy::kRefuse, the
// default) and the other sequences complete; NonFinitePolicy::kEvictFirst ranks those scores
// below every finite one so the round proceeds and the sequence stays usable.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/cache_geometry.hpp>
#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/host_kv_ops.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/selection.hpp>
#include <triattn/core/trigger.hpp>

namespace triattn {

/// Which sequences of a batch a round compresses.
enum class RoundTrigger : int {
  kIfDue = 0,   ///< only those whose counted length reached budget + divide_length (CompressionTrigger);
                ///< the others are reported kNotDue and left untouched. Call it between decode steps.
  kAlways = 1,  ///< every sequence is brought to selection::keep_counts(...).keep (KvCache::compress)
};

/// Outcome of one sequence of a round (RoundOutputs::status).
enum class RoundStatus : std::int32_t {
  kCompressed = 0,  ///< compacted to new_len slots (new_len may equal the old length when nothing is evicted)
  kNotDue = 1,      ///< kIfDue and the trigger did not fire: untouched, new_len = old length
  kNonFinite = 2,   ///< a score in the selectable range was NaN/±Inf under NonFinitePolicy::kRefuse: untouched
  kNoRoom = 3,      ///< the keep count exceeds RoundOutputs::max_keep (device rounds only; the host
                    ///< validates max_keep and throws): untouched
  kInvalid = 4,     ///< device rounds only: the round's inputs failed the device checks (the host
                    ///< throws instead); nothing of the round was written, cuda::RoundError says why
};

[[nodiscard]] inline const char* to_string(RoundStatus s) noexcept {
  switch (s) {
    case RoundStatus::kCompressed: return "compressed";
    case RoundStatus::kNotDue: return "not_due";
    case RoundStatus::kNonFinite: return "non_finite";
    case RoundStatus::kNoRoom: return "no_room";
    case RoundStatus::kInvalid: return "invalid";
  }
  return "<invalid RoundStatus>";
}

/// Rows of kept positions one sequence needs in `mode`: kPerHead one per KV head (the same for
/// every layer), kPerLayerPerHead one per (layer, KV head), kUnion one (every layer and head).
[[nodiscard]] TRIATTN_HOST_DEVICE int kept_rows(PruningMode mode, int num_layers, int num_kv_heads) {
  return mode == PruningMode::kPerHead ? num_kv_heads
         : mode == PruningMode::kPerLayerPerHead ? num_layers * num_kv_heads
                                                 : 1;
}

/// The (layer, KV head) whose keep set row r of a `rows`-row kept array describes: rows ==
/// num_layers * num_kv_heads is always allowed ((r / Hkv, r % Hkv)); rows == num_kv_heads means
/// (0, r) and stands for every layer; rows == 1 means (0, 0) and stands for all.
TRIATTN_HOST_DEVICE void kept_row_source(int r, int rows, int num_kv_heads, int* layer, int* head) {
  if (rows == 1) {
    *layer = 0;
    *head = 0;
  } else if (rows == num_kv_heads) {
    *layer = 0;
    *head = r;
  } else {
    *layer = r / num_kv_heads;
    *head = r % num_kv_heads;
  }
}

/// The protected prefix a round applies to a sequence of `length` slots whose first
/// `shared_blocks` table columns hold blocks another row also references: the caller's
/// `protected_prefix`, extended to cover those blocks whole (never past the length). One
/// definition for the host round and the device round.
[[nodiscard]] TRIATTN_HOST_DEVICE constexpr int effective_protected_prefix(int protected_prefix, int shared_blocks,
                                                                          int block_size, int length) noexcept {
  const long long shared = static_cast<long long>(shared_blocks) * block_size;
  const int covered = static_cast<int>(shared < length ? shared : length);
  return protected_prefix > covered ? protected_prefix : covered;
}

/// Per-sequence inputs of a round (arrays in the round's memory space). Same fields as
/// cuda::RoundBatch.
struct RoundBatch {
  const std::int32_t* seq_ids = nullptr;      ///< [batch] rows of the view (block table, seq_lens); no row twice
  const std::int64_t* t0 = nullptr;           ///< [batch] round start = logical position (tokens processed so far)
  const std::int32_t* prompt_lens = nullptr;  ///< [batch] prompt tokens still in place at slots [0, prompt_len)
  int batch = 0;
  int max_len = 0;  ///< >= every sequence's physical length (sizes the workspace)
  /// [batch] or null (none): leading slots the round neither selects away nor moves, e.g. a
  /// prefix shared with other sequences (KvCache::shared_prefix). Any count of slots: the round
  /// itself extends it over every leading block another table row references
  /// (effective_protected_prefix), and refuses a shared block that follows a private one.
  const std::int32_t* protected_prefix = nullptr;
};
static_assert(std::is_trivially_copyable_v<RoundBatch>);

/// Per-sequence outputs of a round (arrays in the round's memory space). Every entry of the
/// [batch] arrays is written for every sequence, whatever its status.
struct RoundOutputs {
  std::int32_t* new_lens = nullptr;     ///< [batch] physical length after the round (old length unless kCompressed)
  std::int32_t* status = nullptr;       ///< [batch] RoundStatus
  std::int32_t* freed_begin = nullptr;  ///< [batch] ceil(new_len / block_size)
  std::int32_t* freed_end = nullptr;    ///< [batch] ceil(old_len / block_size): table columns
                                        ///< [freed_begin, freed_end) hold blocks no longer used
  /// Optional [batch, kept_rows, max_keep]: kept[b, r, i] = original logical position of the token
  /// slot i of row r holds after the round, i < new_len[b] (entries past new_len are not written).
  /// Written for kCompressed sequences only. Null: not reported.
  std::int32_t* kept = nullptr;
  int kept_rows = 0;   ///< kept_rows(mode, L, Hkv) or L * Hkv (kept_row_source)
  int max_keep = 0;    ///< row capacity of kept; >= every kept count (host: validated)
  /// Optional input [batch, kept_rows, positions_stride]: the original logical position of slot j
  /// of row r of sequence b (j < its length), as reported by its previous rounds. Null: slot j
  /// holds position j (a sequence never compacted), and kept reports pre-round slots.
  const std::int32_t* slot_positions = nullptr;
  std::int64_t positions_stride = 0;  ///< >= batch.max_len when slot_positions is set
  /// Optional [batch]: first slot the round moved in any (layer, KV head) row; new_len when it
  /// moved none, the old length unless kCompressed. Slots below it still hold what they held
  /// (KvCache::commit_round needs it, or kept, to know which leading tokens stayed in place).
  std::int32_t* first_moved = nullptr;
};
static_assert(std::is_trivially_copyable_v<RoundOutputs>);

/// Host-owned output arrays of a round for `batch` sequences (the CPU path, or the host copy of a
/// device round's outputs). kept is allocated when kept_rows > 0.
struct RoundResult {
  std::vector<std::int32_t> new_lens, status, freed_begin, freed_end, first_moved, kept;
  int kept_rows = 0;
  int max_keep = 0;

  explicit RoundResult(int batch, int rows = 0, int max_keep_count = 0)
      : new_lens(static_cast<std::size_t>(batch > 0 ? batch : 0)), status(new_lens.size()),
        freed_begin(new_lens.size()), freed_end(new_lens.size()), first_moved(new_lens.size()),
        kept(rows > 0 && max_keep_count > 0 ? new_lens.size() * static_cast<std::size_t>(rows) *
                                                  static_cast<std::size_t>(max_keep_count)
                                            : 0),
        kept_rows(rows > 0 ? rows : 0), max_keep(max_keep_count > 0 ? max_keep_count : 0) {}

  /// The RoundOutputs pointing at these arrays (valid while *this lives and is not resized).
  [[nodiscard]] RoundOutputs outputs() {
    RoundOutputs o;
    o.new_lens = new_lens.data();
    o.status = status.data();
    o.freed_begin = freed_begin.data();
    o.freed_end = freed_end.data();
    o.first_moved = first_moved.data();
    o.kept = kept.empty() ? nullptr : kept.data();
    o.kept_rows = kept_rows;
    o.max_keep = max_keep;
    return o;
  }
  [[nodiscard]] RoundStatus status_of(int b) const { return static_cast<RoundStatus>(status.at(static_cast<std::size_t>(b))); }
  /// Kept positions of row r of batch entry b ([new_lens[b]] entries; kCompressed entries only).
  [[nodiscard]] std::span<const std::int32_t> kept_positions(int b, int r) const {
    TRIATTN_EXPECTS(!kept.empty() && b >= 0 && static_cast<std::size_t>(b) < new_lens.size() && r >= 0 && r < kept_rows,
                    "RoundResult::kept_positions: entry " + std::to_string(b) + ", row " + std::to_string(r) +
                        " is not held (kept_rows " + std::to_string(kept_rows) + ")");
    return {kept.data() + (static_cast<std::size_t>(b) * kept_rows + r) * max_keep,
            static_cast<std::size_t>(new_lens[static_cast<std::size_t>(b)])};
  }
};

/// Bytes of host workspace triattn::paged_round needs for a batch whose sequences are at most
/// max_len slots long: the raw scores of one sequence ([L, Hq, max_len] float), reused sequence
/// after sequence. (The host selection itself allocates its temporaries; the device round does not.)
[[nodiscard]] inline std::size_t paged_round_workspace_size(const ModelGeometry& g, int max_len) noexcept {
  const std::size_t T = static_cast<std::size_t>(max_len > 0 ? max_len : 0);
  const std::size_t L = static_cast<std::size_t>(g.num_layers > 0 ? g.num_layers : 0);
  const std::size_t Hq = static_cast<std::size_t>(g.num_q_heads > 0 ? g.num_q_heads : 0);
  return L * Hq * T * sizeof(float);
}

namespace detail {

/// One dimension of the lattice of head vectors: `count` positions `stride` elements apart.
struct StrideDim {
  std::int64_t stride;
  std::int64_t count;
  const char* name;
};

/// True when the dims nest: sorted by stride, each stride is at least the extent of everything
/// below it (head_dim, then the smaller dims), so no two head vectors share an element. Every
/// engine layout nests; dims of count 1 take no part. `bad` names the offending dim.
inline bool strides_nest(std::vector<StrideDim> dims, std::int64_t head_dim, std::string* bad) {
  dims.erase(std::remove_if(dims.begin(), dims.end(), [](const StrideDim& d) { return d.count <= 1; }), dims.end());
  std::sort(dims.begin(), dims.end(), [](const StrideDim& a, const StrideDim& b) { return a.stride < b.stride; });
  std::int64_t extent = head_dim;  // elements spanned by one position of the current dim
  for (const StrideDim& d : dims) {
    if (d.stride < extent) {
      *bad = std::string(d.name) + " stride " + std::to_string(d.stride) + " is smaller than the " +
             std::to_string(extent) + " elements the smaller strides span";
      return false;
    }
    extent += (d.count - 1) * d.stride;
  }
  return true;
}

template <class T, class Id>
std::vector<StrideDim> block_dims(const KvCacheView<T, Id>& v) {
  return {{v.block.stride_head, v.block.num_kv_heads, "head"},
          {v.block.stride_token, v.block.block_size, "token"},
          {v.block.stride_block, v.num_blocks, "block"}};
}

}  // namespace detail

namespace detail {

/// Calls f(column, block id) for the first ceil(seq_lens[s] / block_size) entries of row s of a
/// host-readable view, after checking the row's length (in [0, capacity]) and each id (in
/// [0, num_blocks)). @throws triattn::logic_error naming `what` and the bad entry.
template <class T, class Id, class F>
void for_each_row_block(const KvCacheView<T, Id>& view, int s, const std::string& what, F&& f) {
  const std::int64_t len = view.seq_lens[s];
  if (len < 0 || len > view.capacity_tokens())
    TRIATTN_FAIL(what + ": seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) + " is outside [0, capacity " +
                 std::to_string(view.capacity_tokens()) + " = max_blocks_per_seq * block_size]");
  const std::int64_t nb = ceil_div<std::int64_t>(len, view.block.block_size);
  const Id* row = view.table_row(s);
  for (std::int64_t j = 0; j < nb; ++j) {
    const std::int64_t id = row[j];
    if (id < 0 || id >= view.num_blocks)
      TRIATTN_FAIL(what + ": block_tables[" + std::to_string(s) + "][" + std::to_string(j) + "] = " +
                   std::to_string(id) + " is outside [0, num_blocks = " + std::to_string(view.num_blocks) +
                   ") (sequence length " + std::to_string(len) + ")");
    f(j, id);
  }
}

}  // namespace detail

/// Checks a view before anything reads or writes through it, host side. Structure (always):
/// positive sizes, non-null base/tables/lengths, non-negative strides that nest (no two (block,
/// token, head) vectors of one range share an element, and for a single-base view no two
/// (layer, K|V) ranges either). Contents (`contents` true, host-readable views only): the
/// `ranges` pointers are non-null and no two ranges overlap (except by an offset that nests, as
/// K and V interleaved per block do), and for every sequence s of `seqs`: s is a row of the
/// table, 0 <= seq_lens[s] <= capacity_tokens(), and the first ceil(seq_lens[s] / block_size)
/// entries of row s are distinct block ids in [0, num_blocks).
/// @throws triattn::logic_error naming `what` and the bad field.
template <class T, class Id>
void validate_view(const KvCacheView<T, Id>& view, std::span<const std::int32_t> seqs, bool contents,
                   const std::string& what = "KvCacheView") {
  const BlockLayout& b = view.block;
  const auto fail = [&](const std::string& msg) { TRIATTN_FAIL(what + ": " + msg); };
  const auto positive = [&](long long v, const char* name) {
    if (v <= 0) fail(std::string(name) + " = " + std::to_string(v) + " must be positive");
  };
  positive(view.num_layers, "num_layers");
  positive(view.num_blocks, "num_blocks");
  positive(view.max_seqs, "max_seqs");
  positive(view.max_blocks_per_seq, "max_blocks_per_seq");
  positive(b.block_size, "block.block_size");
  positive(b.num_kv_heads, "block.num_kv_heads");
  positive(b.head_dim, "block.head_dim");
  if (view.capacity_tokens() > std::numeric_limits<std::int32_t>::max())
    fail("max_blocks_per_seq * block_size = " + std::to_string(view.capacity_tokens()) + " overflows int32 slots");
  if (view.block_tables == nullptr) fail("block_tables is null");
  if (view.seq_lens == nullptr) fail("seq_lens is null");
  if (view.ranges == nullptr && view.data == nullptr) fail("data and ranges are both null");
  for (const auto& [v, name] : {std::pair{b.stride_block, "block.stride_block"}, std::pair{b.stride_token, "block.stride_token"},
                                std::pair{b.stride_head, "block.stride_head"}, std::pair{view.layer_stride, "layer_stride"},
                                std::pair{view.kind_stride, "kind_stride"}})
    if (v < 0) fail(std::string(name) + " = " + std::to_string(v) + " must be non-negative");
  std::vector<detail::StrideDim> dims = detail::block_dims(view);
  if (view.ranges == nullptr) {
    dims.push_back({view.kind_stride, 2, "kind"});
    dims.push_back({view.layer_stride, view.num_layers, "layer"});
  }
  std::string bad;
  if (!detail::strides_nest(dims, b.head_dim, &bad))
    fail("strides overlap: " + bad + " (block " + std::to_string(b.stride_block) + ", token " +
         std::to_string(b.stride_token) + ", head " + std::to_string(b.stride_head) + ", head_dim " +
         std::to_string(b.head_dim) +
         (view.ranges == nullptr ? ", kind " + std::to_string(view.kind_stride) + ", layer " +
                                       std::to_string(view.layer_stride)
                                 : std::string()) +
         ")");
  if (!contents) return;
  if (view.ranges != nullptr) {
    const std::int64_t extent = (view.num_blocks - 1) * b.stride_block + (b.block_size - 1) * b.stride_token +
                                (b.num_kv_heads - 1) * b.stride_head + b.head_dim;  // elements one range spans
    const int n = 2 * view.num_layers;
    for (int i = 0; i < n; ++i)
      if (view.ranges[i] == nullptr)
        fail("ranges[" + std::to_string(i) + "] (layer " + std::to_string(i / 2) + (i % 2 ? ", V" : ", K") + ") is null");
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j < n; ++j) {
        const auto pi = reinterpret_cast<std::uintptr_t>(view.ranges[i]);
        const auto pj = reinterpret_cast<std::uintptr_t>(view.ranges[j]);
        const std::uintptr_t lo = std::min(pi, pj), hi = std::max(pi, pj);
        const std::uintptr_t gap = hi - lo;
        if (gap >= static_cast<std::uintptr_t>(extent) * sizeof(T)) continue;  // disjoint spans
        std::vector<detail::StrideDim> d2 = detail::block_dims(view);
        d2.push_back({static_cast<std::int64_t>(gap / sizeof(T)), 2, "range offset"});
        std::string why;
        if (gap % sizeof(T) != 0 || !detail::strides_nest(d2, b.head_dim, &why))
          fail("ranges[" + std::to_string(i) + "] and ranges[" + std::to_string(j) + "] overlap (" +
               std::to_string(gap / sizeof(T)) + " elements apart, a range spans " + std::to_string(extent) + ")");
      }
  }
  std::vector<std::uint8_t> seen;  // per block id: used by the current row
  for (std::size_t k = 0; k < seqs.size(); ++k) {
    const int s = seqs[k];
    if (s < 0 || s >= view.max_seqs)
      fail("sequence " + std::to_string(s) + " (batch entry " + std::to_string(k) + ") is not a row of the table [0, " +
           std::to_string(view.max_seqs) + ")");
    seen.assign(static_cast<std::size_t>(view.num_blocks), 0);
    detail::for_each_row_block(view, s, what, [&](std::int64_t j, std::int64_t id) {
      if (seen[static_cast<std::size_t>(id)]++)
        fail("block_tables[" + std::to_string(s) + "][" + std::to_string(j) + "] = " + std::to_string(id) +
             " appears twice in the sequence's row");
    });
  }
}

namespace detail {

/// Block reference counts of a round, host side: refs[id] = entries naming block id over EVERY
/// row of the view's tables (each row up to its length), batch or not. Checks every row it reads
/// (length, block ids), so rows no sequence uses must have length 0.
/// @throws triattn::logic_error naming `what` and the bad entry.
template <class T, class Id>
std::vector<std::int32_t> count_block_refs(const KvCacheView<T, Id>& view, const std::string& what) {
  std::vector<std::int32_t> refs(static_cast<std::size_t>(view.num_blocks), 0);
  for (int s = 0; s < view.max_seqs; ++s)
    for_each_row_block(view, s, what, [&](std::int64_t, std::int64_t id) { ++refs[static_cast<std::size_t>(id)]; });
  return refs;
}

/// Leading table columns of sequence `seq` (batch entry `entry`) whose blocks another row also
/// references (refs from count_block_refs; the row was validated). Those columns are protected
/// whole; a shared block after a private one cannot be (compaction would move tokens across it).
/// @throws triattn::logic_error naming the block, its column and both sequences in that case.
template <class T, class Id>
int leading_shared_blocks(const KvCacheView<T, Id>& view, std::span<const std::int32_t> refs, int seq, int entry,
                          const std::string& what) {
  const Id* row = view.table_row(seq);
  const std::int64_t nb = ceil_div<std::int64_t>(view.seq_lens[seq], view.block.block_size);
  std::int64_t lead = 0;
  while (lead < nb && refs[static_cast<std::size_t>(row[lead])] > 1) ++lead;
  for (std::int64_t j = lead + 1; j < nb; ++j) {
    const std::int64_t id = row[j];
    if (refs[static_cast<std::size_t>(id)] <= 1) continue;
    int other = -1;  // another row naming the block (error path only: a scan of the tables)
    for (int s = 0; s < view.max_seqs && other < 0; ++s) {
      if (s == seq) continue;
      for_each_row_block(view, s, what, [&](std::int64_t, std::int64_t b) { other = b == id ? s : other; });
    }
    TRIATTN_FAIL(what + ": batch entry " + std::to_string(entry) + " (sequence " + std::to_string(seq) +
                 "): block_tables[" + std::to_string(seq) + "][" + std::to_string(j) + "] = " + std::to_string(id) +
                 " is shared with sequence " + std::to_string(other) + " but follows the private block " +
                 std::to_string(row[lead]) + " at column " + std::to_string(lead) +
                 "; compaction would move tokens across a block another sequence reads (copy it first, or leave "
                 "the sequence out of the round)");
  }
  return static_cast<int>(lead);
}

/// One byte range a round reads or writes (null or empty: none).
struct MemSpan {
  const void* p;
  std::size_t bytes;
  const char* name;
};

/// Element span of the view's K/V memory (a range per (layer, K|V) when `ranges` is readable
/// here, one span from `data` otherwise; none for a device pointer array).
template <class T, class Id>
std::vector<MemSpan> kv_spans(const KvCacheView<T, Id>& view, bool ranges_readable) {
  const BlockLayout& b = view.block;
  const std::int64_t extent = (view.num_blocks - 1) * b.stride_block + (b.block_size - 1) * b.stride_token +
                              (b.num_kv_heads - 1) * b.stride_head + b.head_dim;  // elements one range spans
  std::vector<MemSpan> spans;
  if (view.ranges == nullptr) {
    const std::int64_t all = (view.num_layers - 1) * view.layer_stride + view.kind_stride + extent;
    spans.push_back({view.data, sizeof(T) * static_cast<std::size_t>(all), "the view's K/V memory"});
  } else if (ranges_readable) {
    for (int i = 0; i < 2 * view.num_layers; ++i)
      spans.push_back({view.ranges[i], sizeof(T) * static_cast<std::size_t>(extent), "the view's K/V memory"});
  }
  return spans;
}

/// Refuses a round whose written spans (outputs, workspace, K/V) overlap each other or anything
/// it reads (tables, lengths, batch arrays, slot positions): a write there would change an input
/// of a later sequence mid-round. Read spans may overlap each other.
/// @throws triattn::logic_error naming `what` and both arrays.
inline void check_disjoint(std::span<const MemSpan> written, std::span<const MemSpan> read, const std::string& what) {
  const auto overlap = [](const MemSpan& a, const MemSpan& b) {
    if (a.p == nullptr || b.p == nullptr || a.bytes == 0 || b.bytes == 0) return false;
    const auto pa = reinterpret_cast<std::uintptr_t>(a.p), pb = reinterpret_cast<std::uintptr_t>(b.p);
    return pa < pb + b.bytes && pb < pa + a.bytes;
  };
  for (std::size_t i = 0; i < written.size(); ++i) {
    for (std::size_t j = i + 1; j < written.size(); ++j)
      if (overlap(written[i], written[j]) && std::string_view(written[i].name) != written[j].name)
        TRIATTN_FAIL(what + ": " + written[i].name + " overlaps " + written[j].name + " (both are written)");
    for (const MemSpan& r : read)
      if (overlap(written[i], r))
        TRIATTN_FAIL(what + ": " + written[i].name + " overlaps " + r.name + ", which the round reads");
  }
}

/// The spans a round over `view` writes and reads (batch.batch > 0; workspace_bytes: what the
/// round uses of it), checked with check_disjoint.
template <class T, class Id>
void check_round_aliasing(const KvCacheView<T, Id>& view, bool ranges_readable, const RoundBatch& batch,
                          const RoundOutputs& out, const void* workspace, std::size_t workspace_bytes,
                          const std::string& what) {
  const std::size_t B = static_cast<std::size_t>(batch.batch), i32 = sizeof(std::int32_t);
  const std::size_t kept_entries = B * static_cast<std::size_t>(out.kept_rows > 0 ? out.kept_rows : 0);
  std::vector<MemSpan> written{{out.new_lens, B * i32, "out.new_lens"},
                               {out.status, B * i32, "out.status"},
                               {out.freed_begin, B * i32, "out.freed_begin"},
                               {out.freed_end, B * i32, "out.freed_end"},
                               {out.kept, kept_entries * static_cast<std::size_t>(out.max_keep > 0 ? out.max_keep : 0) * i32,
                                "out.kept"},
                               {workspace, workspace_bytes, "the workspace"}};
  for (const MemSpan& m : kv_spans(view, ranges_readable)) written.push_back(m);
  const std::size_t table = static_cast<std::size_t>(view.max_seqs) * static_cast<std::size_t>(view.max_blocks_per_seq);
  const MemSpan read[] = {
      {view.block_tables, table * sizeof(Id), "view.block_tables"},
      {view.seq_lens, static_cast<std::size_t>(view.max_seqs) * sizeof(Id), "view.seq_lens"},
      {batch.seq_ids, B * i32, "batch.seq_ids"},
      {batch.t0, B * sizeof(std::int64_t), "batch.t0"},
      {batch.prompt_lens, B * i32, "batch.prompt_lens"},
      {batch.protected_prefix, B * i32, "batch.protected_prefix"},
      {out.slot_positions,
       out.slot_positions != nullptr ? kept_entries * static_cast<std::size_t>(out.positions_stride) * i32 : 0,
       "out.slot_positions"}};
  check_disjoint(written, read, what);
}

}  // namespace detail

namespace detail {

/// Plans the round of one sequence, writing nothing to the cache: scores its keys into `scores`
/// ([L, Hq, len]) and selects. Returns kNonFinite (plan untouched) when `params` is given with
/// NonFinitePolicy::kRefuse and a selectable score is not finite; else kCompressed with `plan`.
/// `select(scores, geometry, len, prompt_len)` returns the KeepPlan (selection::select_keep, or a
/// KvCache's selector policy) and must protect the same `protected_prefix`.
template <class T, class Id, class Scorer, class Select>
RoundStatus plan_round_one(const KvCacheView<T, Id>& view, Scorer& scorer, Select&& select,
                           const ValidSelectionParams* params, const ModelGeometry& g, int seq, int len, int prompt_len,
                           int protected_prefix, std::int64_t t0, std::span<float> scores, KeepPlan& plan) {
  const std::span<float> sc = scores.first(static_cast<std::size_t>(g.num_layers) * g.num_q_heads * len);
  scorer.score(view, seq, len, t0, sc);
  if (params != nullptr && params->nonfinite == NonFinitePolicy::kRefuse) {
    const KeepCounts kc = selection::keep_counts(len, prompt_len, *params, protected_prefix);
    if (!selection::selectable_scores_finite(sc.data(), static_cast<std::size_t>(g.num_layers) * g.num_q_heads, kc))
      return RoundStatus::kNonFinite;
  }
  plan = select(std::span<const float>(sc.data(), sc.size()), g, len, prompt_len);
  return RoundStatus::kCompressed;
}

/// Writes the outputs of batch entry b: lengths, status, freed columns, the first moved slot
/// (when asked for), and (kCompressed with out.kept set) the kept positions of every kept row.
inline void write_round_outputs(const RoundOutputs& out, int b, int block_size, int num_kv_heads, int old_len,
                                RoundStatus status, const KeepPlan* plan) {
  const int new_len = status == RoundStatus::kCompressed ? plan->keep : old_len;
  out.new_lens[b] = new_len;
  out.status[b] = static_cast<std::int32_t>(status);
  out.freed_begin[b] = static_cast<std::int32_t>(triattn::detail::ceil_div(new_len, block_size));
  out.freed_end[b] = static_cast<std::int32_t>(triattn::detail::ceil_div(old_len, block_size));
  if (out.first_moved != nullptr)
    out.first_moved[b] = status == RoundStatus::kCompressed ? plan->first_moved() : old_len;
  if (status != RoundStatus::kCompressed || out.kept == nullptr) return;
  for (int r = 0; r < out.kept_rows; ++r) {
    int l = 0, h = 0;
    kept_row_source(r, out.kept_rows, num_kv_heads, &l, &h);
    const std::int32_t* row = plan->row(l, h);
    std::int32_t* dst = out.kept + (static_cast<std::int64_t>(b) * out.kept_rows + r) * out.max_keep;
    const std::int32_t* pos = out.slot_positions == nullptr
                                  ? nullptr
                                  : out.slot_positions + (static_cast<std::int64_t>(b) * out.kept_rows + r) *
                                                             out.positions_stride;
    for (int i = 0; i < plan->keep; ++i) dst[i] = pos != nullptr ? pos[row[i]] : row[i];
  }
}

}  // namespace detail

/// The batched round over host memory (the CPU oracle of cuda::paged_round). Sequences are
/// processed one after another: score (scorer), select (selection::select_keep with `params`),
/// compact in place (host::compact), outputs.
///
/// @param view      paged cache in host memory; K/V of the batch's sequences are compacted in
///                  place, its tables and lengths are only read
/// @param scorer    a host scorer policy: scorer.score(view, seq, len, t0, std::span<float> [L, Hq, len])
///                  (TriAttentionScorer holds the calibrated statistics; any KvCache scorer works)
/// @param params    selection parameters (budget, slack, mode, protection, normalisation, nonfinite)
/// @param geometry  the model's attention shape (num_q_heads sizes the score rows; layers, KV
///                  heads and head_dim must match the view)
/// @param trigger   which sequences are compressed
/// @param batch     sequences of the round (host arrays)
/// @param out       per-sequence outputs (host arrays)
/// @param workspace caller-owned host memory of at least paged_round_workspace_size(geometry,
///                  batch.max_len) bytes, float-aligned
/// @return the number of sequences compressed
/// @throws triattn::logic_error (nothing written) on a bad view, batch, outputs, workspace or
///         params, a shared block after a private one, or outputs / workspace overlapping each
///         other or an input; a sequence with non-finite scores is reported, not thrown (kNonFinite).
template <class T, class Id, class Scorer>
int paged_round(const KvCacheView<T, Id>& view, Scorer& scorer, const ValidSelectionParams& params,
                const ModelGeometry& geometry, RoundTrigger trigger, const RoundBatch& batch, const RoundOutputs& out,
                void* workspace, std::size_t workspace_bytes) {
  const ModelGeometry& g = geometry;
  g.validate();
  TRIATTN_EXPECTS(trigger == RoundTrigger::kIfDue || trigger == RoundTrigger::kAlways,
                  "paged_round: trigger has invalid value " + std::to_string(static_cast<int>(trigger)));
  check_cache_geometry(cache_geometry(view), cache_geometry(g), "paged_round", "the model's");
  TRIATTN_EXPECTS(batch.batch >= 0 && batch.max_len >= 0,
                  "paged_round: batch = " + std::to_string(batch.batch) + " and max_len = " +
                      std::to_string(batch.max_len) + " must be non-negative");
  if (batch.batch == 0) return 0;
  TRIATTN_EXPECTS(batch.seq_ids != nullptr && batch.t0 != nullptr && batch.prompt_lens != nullptr,
                  "paged_round: batch.seq_ids, batch.t0 and batch.prompt_lens must not be null");
  TRIATTN_EXPECTS(out.new_lens != nullptr && out.status != nullptr && out.freed_begin != nullptr &&
                      out.freed_end != nullptr,
                  "paged_round: out.new_lens, out.status, out.freed_begin and out.freed_end must not be null");
  const std::span<const std::int32_t> ids(batch.seq_ids, static_cast<std::size_t>(batch.batch));
  validate_view(view, ids, true, "paged_round: view");
  const std::vector<std::int32_t> refs = detail::count_block_refs(view, "paged_round: view");
  std::vector<std::uint8_t> in_batch(static_cast<std::size_t>(view.max_seqs), 0);
  std::vector<std::int32_t> prefix(static_cast<std::size_t>(batch.batch), 0);  // effective protected prefix
  const int rows_mode = kept_rows(params.mode, g.num_layers, g.num_kv_heads);
  if (out.kept != nullptr)
    TRIATTN_EXPECTS(out.kept_rows == rows_mode || out.kept_rows == g.num_layers * g.num_kv_heads,
                    "paged_round: out.kept_rows = " + std::to_string(out.kept_rows) + " must be " +
                        std::to_string(rows_mode) + " (" + to_string(params.mode) + ") or layers * kv_heads = " +
                        std::to_string(g.num_layers * g.num_kv_heads));
  TRIATTN_EXPECTS(out.slot_positions == nullptr || (out.kept != nullptr && out.positions_stride >= batch.max_len),
                  "paged_round: out.slot_positions needs out.kept and positions_stride (" +
                      std::to_string(out.positions_stride) + ") >= batch.max_len (" + std::to_string(batch.max_len) + ")");
  std::vector<std::uint8_t> due(static_cast<std::size_t>(batch.batch), 0);
  for (int b = 0; b < batch.batch; ++b) {
    const int s = batch.seq_ids[b];
    const std::string who = "paged_round: batch entry " + std::to_string(b) + " (sequence " + std::to_string(s) + ")";
    TRIATTN_EXPECTS(!in_batch[static_cast<std::size_t>(s)]++, who + " appears twice in the batch");
    const int len = static_cast<int>(view.seq_lens[s]);
    const int pl = batch.prompt_lens[b];
    const int given = batch.protected_prefix != nullptr ? batch.protected_prefix[b] : 0;
    TRIATTN_EXPECTS(given >= 0, who + ": protected_prefix = " + std::to_string(given) + " must be >= 0");
    const int lead = detail::leading_shared_blocks(view, refs, s, b, "paged_round");
    const int pp = effective_protected_prefix(given, lead, view.block.block_size, len);
    prefix[static_cast<std::size_t>(b)] = pp;
    TRIATTN_EXPECTS(len <= batch.max_len, who + ": length " + std::to_string(len) + " exceeds batch.max_len = " +
                                              std::to_string(batch.max_len));
    TRIATTN_EXPECTS(pl >= 0 && pl <= len, who + ": prompt_len = " + std::to_string(pl) + " must be in [0, length " +
                                              std::to_string(len) + "]");
    TRIATTN_EXPECTS(batch.t0[b] >= len, who + ": t0 = " + std::to_string(batch.t0[b]) +
                                            " (tokens processed) is smaller than its cached length " +
                                            std::to_string(len));
    const bool fire = trigger == RoundTrigger::kAlways ||
                      CompressionTrigger::should_compress(CompressionTrigger::counted_length(len, pl, params), true, params);
    due[static_cast<std::size_t>(b)] = fire;
    if (fire && out.kept != nullptr) {
      const int keep = selection::keep_counts(len, pl, params, pp).keep;
      TRIATTN_EXPECTS(keep <= out.max_keep, who + ": keeps " + std::to_string(keep) + " slots, more than out.max_keep = " +
                                                std::to_string(out.max_keep));
    }
  }
  const std::size_t need = paged_round_workspace_size(g, batch.max_len);
  TRIATTN_EXPECTS(workspace_bytes >= need && (need == 0 || workspace != nullptr),
                  "paged_round: workspace of " + std::to_string(workspace_bytes) + " bytes" +
                      (workspace == nullptr ? " (null)" : "") + ", the round needs " + std::to_string(need) +
                      " (paged_round_workspace_size)");
  TRIATTN_EXPECTS(reinterpret_cast<std::uintptr_t>(workspace) % alignof(float) == 0,
                  "paged_round: workspace is not aligned for float");
  detail::check_round_aliasing(view, true, batch, out, workspace, need, "paged_round");
  // Everything is checked: from here on, per-sequence problems are reported, not thrown.
  const std::span<float> scores(static_cast<float*>(workspace), need / sizeof(float));
  int compressed = 0;
  KeepPlan plan;
  for (int b = 0; b < batch.batch; ++b) {
    const int s = batch.seq_ids[b];
    const int len = static_cast<int>(view.seq_lens[s]);
    const int pp = prefix[static_cast<std::size_t>(b)];
    RoundStatus st = RoundStatus::kNotDue;
    if (due[static_cast<std::size_t>(b)]) {
      const auto select = [&params, pp](std::span<const float> sc, const ModelGeometry& gm, int n, int pl) {
        return selection::select_keep(sc.data(), gm.num_layers, gm.num_q_heads, gm.num_kv_heads, n, pl, params, pp);
      };
      st = detail::plan_round_one(view, scorer, select, &params, g, s, len, batch.prompt_lens[b], pp, batch.t0[b],
                                  scores, plan);
      if (st == RoundStatus::kCompressed) {
        host::compact(view, s, plan);
        ++compressed;
      }
    }
    detail::write_round_outputs(out, b, view.block.block_size, g.num_kv_heads, len, st,
                                st == RoundStatus::kCompressed ? &plan : nullptr);
  }
  return compressed;
}

}  // namespace triattn
