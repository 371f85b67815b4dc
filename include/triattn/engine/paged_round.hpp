// SPDX-License-Identifier: Apache-2.0
// The engine-layout round, host entry point: the batched compression round over any paged cache
// a KvCacheView describes (triattn's own KvCache or an engine's tensors): for every sequence of
// the batch, score every cached key, normalise, select the keep set (SelectionParams,
// PruningMode), compact the kept K/V in place into slots [0, new_len), and report per sequence
// the new length, the kept tokens' original logical positions, which block-table columns are now
// free, and a status. The device entry point is cuda/engine/paged_round.cuh.
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

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/cache_geometry.hpp>
#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/host_kv_ops.hpp>
#include <triattn/core/keep_plan.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/round_types.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/selection.hpp>
#include <triattn/core/trigger.hpp>
#include <triattn/engine/prefix_protection.hpp>
#include <triattn/engine/view_checks.hpp>

namespace triattn {

namespace detail {

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
