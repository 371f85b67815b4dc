// SPDX-License-Identifier: Apache-2.0
// The compression round's shared types: which sequences a round compresses (RoundTrigger), how
// each fared (RoundStatus), its per-sequence inputs and outputs (RoundBatch, RoundOutputs,
// RoundResult) and the planning of one sequence (score, then select). KvCache's rounds and the
// engine-layout round (engine/paged_round.hpp, cuda/engine/paged_round.cuh) both speak them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <triattn/core/cache_geometry.hpp>
#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/selection.hpp>

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

}  // namespace detail

}  // namespace triattn
