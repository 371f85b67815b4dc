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
// Errors (the same rule for every batch call): arguments are validated before anything is
// written (view, sequence ids, lengths, sizes) and a bad one throws triattn::logic_error naming
// it, the cache untouched. Per-sequence data problems never throw: a sequence whose scores are
// not finite is left unchanged with RoundStatus::kNonFinite (NonFinitePolicy::kRefuse, the
// default) and the other sequences complete; NonFinitePolicy::kEvictFirst ranks those scores
// below every finite one so the round proceeds and the sequence stays usable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include <triattn/core/cache_config.hpp>
#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/scoring_params.hpp>

namespace triattn {

/// Which sequences of a batch a round compresses.
enum class RoundTrigger : int {
  kIfDue = 0,   ///< only those whose counted length reached budget + divide_length (CompressionTrigger);
                ///< the others are reported kNotDue and left untouched. Call it between decode steps.
  kAlways = 1,  ///< every sequence is brought to ref::keep_counts(...).keep (KvCache::compress)
};

/// Outcome of one sequence of a round (RoundOutputs::status).
enum class RoundStatus : std::int32_t {
  kCompressed = 0,  ///< compacted to new_len slots (new_len may equal the old length when nothing is evicted)
  kNotDue = 1,      ///< kIfDue and the trigger did not fire: untouched, new_len = old length
  kNonFinite = 2,   ///< a score in the selectable range was NaN/±Inf under NonFinitePolicy::kRefuse: untouched
  kNoRoom = 3,      ///< the keep count exceeds RoundOutputs::max_keep (device rounds only; the host
                    ///< validates max_keep and throws): untouched
};

[[nodiscard]] inline const char* to_string(RoundStatus s) noexcept {
  switch (s) {
    case RoundStatus::kCompressed: return "compressed";
    case RoundStatus::kNotDue: return "not_due";
    case RoundStatus::kNonFinite: return "non_finite";
    case RoundStatus::kNoRoom: return "no_room";
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

/// Per-sequence inputs of a round (arrays in the round's memory space). Same fields as
/// cuda::RoundBatch.
struct RoundBatch {
  const std::int32_t* seq_ids = nullptr;      ///< [batch] rows of the view (block table, seq_lens); no row twice
  const std::int64_t* t0 = nullptr;           ///< [batch] round start = logical position (tokens processed so far)
  const std::int32_t* prompt_lens = nullptr;  ///< [batch] prompt tokens still in place at slots [0, prompt_len)
  int batch = 0;
  int max_len = 0;  ///< >= every sequence's physical length (sizes the workspace)
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
};
static_assert(std::is_trivially_copyable_v<RoundOutputs>);

/// Bytes of host workspace triattn::paged_round needs for a batch whose sequences are at most
/// max_len slots long: the raw scores of one sequence ([L, Hq, max_len] float) and its keep plan
/// ([L, Hkv, max_len] int32), reused sequence after sequence.
[[nodiscard]] inline std::size_t paged_round_workspace_size(const ModelGeometry& g, int max_len) noexcept {
  const std::size_t T = static_cast<std::size_t>(max_len > 0 ? max_len : 0);
  const std::size_t L = static_cast<std::size_t>(g.num_layers > 0 ? g.num_layers : 0);
  const std::size_t Hq = static_cast<std::size_t>(g.num_q_heads > 0 ? g.num_q_heads : 0);
  const std::size_t Hkv = static_cast<std::size_t>(g.num_kv_heads > 0 ? g.num_kv_heads : 0);
  const auto up = [](std::size_t x) { return (x + 255) / 256 * 256; };
  return up(L * Hq * T * sizeof(float)) + up(L * Hkv * T * sizeof(std::int32_t));
}

/// Checks a view before anything reads or writes through it, host side. Structure: non-null
/// pointers, positive sizes, block_size, head_dim, strides; no two (block, token, head) vectors
/// of one range overlap and K and V ranges of one layer do not overlap (for a single-base view).
/// Contents (host-readable views only, `contents` true): every block id the first
/// ceil(seq_lens[s] / block_size) entries of each row in `seqs` hold is in [0, num_blocks), and
/// seq_lens[s] <= capacity_tokens(). @throws triattn::logic_error naming `what` and the bad field.
template <class T, class Id>
void validate_view(const KvCacheView<T, Id>& view, std::span<const std::int32_t> seqs, bool contents,
                   const std::string& what = "KvCacheView");

/// The batched round over host memory (the CPU oracle of cuda::paged_round).
///
/// @param view      paged cache in host memory; K/V of the batch's sequences are compacted in place,
///                  its tables and lengths are only read
/// @param scorer    a host scorer policy: scorer.score(view, seq, len, t0, std::span<float> [L, Hq, len])
///                  (TriAttentionScorer holds the calibrated statistics; any KvCache scorer works)
/// @param params    selection parameters (budget, slack, mode, protection, normalisation, nonfinite)
/// @param geometry  the model's attention shape (num_q_heads for the score rows; layers, KV heads
///                  and head_dim must match the view)
/// @param trigger   which sequences are compressed
/// @param batch     sequences of the round (host arrays)
/// @param out       per-sequence outputs (host arrays)
/// @param workspace caller-owned host memory of at least paged_round_workspace_size(geometry, batch.max_len) bytes
/// @return the number of sequences compressed
/// @throws triattn::logic_error (nothing written) on a bad view, batch, outputs, workspace or params.
template <class T, class Id, class Scorer>
int paged_round(const KvCacheView<T, Id>& view, Scorer& scorer, const SelectionParams& params,
                const ModelGeometry& geometry, RoundTrigger trigger, const RoundBatch& batch, const RoundOutputs& out,
                void* workspace, std::size_t workspace_bytes);

}  // namespace triattn
