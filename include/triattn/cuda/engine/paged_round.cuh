// SPDX-License-Identifier: Apache-2.0
// cuda::paged_round: the batched compression round (engine/paged_round.hpp) over any paged cache a
// KvCacheView describes, in device memory, on one stream:
//   device checks and block reference counts → shared leading blocks, which sequences take part →
//   score → row statistics (or a non-finite scan) →
//   normalise + reduce → top-k select → outputs (status, new length, freed table columns, kept
//   logical positions) → in-place compaction of the sequences that completed.
// No allocation, no host synchronisation, no host read of device data: a round can be captured in
// a CUDA graph and replayed. The view's block tables and lengths are only read; the caller applies
// RoundOutputs once the round is done (an event recorded behind it), never earlier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <triattn/core/cache_geometry.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/core/round_types.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/cuda/algorithms/compression_round.cuh>
#include <triattn/cuda/dispatch.cuh>
#include <triattn/cuda/error.cuh>
#include <triattn/cuda/kernels/paged_round_kernel.cuh>
#include <triattn/cuda/launch.cuh>
#include <triattn/cuda/tuning/select.cuh>
#include <triattn/engine/view_checks.hpp>

namespace triattn::cuda {

namespace detail {

/// Carves paged_round's workspace: the RoundError record (offset 0, 256 bytes), the keep plan
/// whose memory first holds the block reference counts ([num_blocks]: they are done with before
/// selection writes the plan), compression_round's buffers, then the rest of PagedRoundScratch.
/// Returns the bytes used (base = nullptr only measures); *clear_bytes = the leading bytes each
/// round zeroes (the record and the reference counts).
inline std::size_t carve_paged_round_workspace(void* base, const RoundShape& s, PruningMode mode, int batch,
                                               int max_len, int max_seqs, int num_blocks, RoundWorkspace* ws,
                                               PagedRoundScratch* scratch, std::size_t* clear_bytes = nullptr) noexcept {
  constexpr std::size_t kRecord = 256;
  const std::size_t B = static_cast<std::size_t>(batch > 0 ? batch : 0);
  const std::size_t S = static_cast<std::size_t>(max_seqs > 0 ? max_seqs : 0);
  const std::size_t NB = static_cast<std::size_t>(num_blocks > 0 ? num_blocks : 0);
  const std::size_t plan = B * static_cast<std::size_t>(s.num_layers) * static_cast<std::size_t>(s.num_kv_heads) *
                           static_cast<std::size_t>(max_len > 0 ? max_len : 0);
  const std::size_t plan_bytes = round_up_256(4 * (plan > NB ? plan : NB));
  char* p = static_cast<char*>(base);
  const std::size_t front =
      carve_round_workspace(p != nullptr ? p + kRecord + plan_bytes : nullptr, s, mode, batch, max_len, ws);
  constexpr int kArrays = 8;
  const std::size_t sizes[kArrays] = {S * 4, B * 4, B * 4, B * 4, B * 4, B * 4, B * 4, B * 4};
  std::size_t off[kArrays], total = kRecord + plan_bytes + front;
  for (int i = 0; i < kArrays; ++i) {
    off[i] = total;
    total += round_up_256(sizes[i]);
  }
  if (clear_bytes != nullptr) *clear_bytes = kRecord + 4 * NB;
  if (p != nullptr && scratch != nullptr) {
    const auto at = [p](std::size_t o) { return reinterpret_cast<std::int32_t*>(p + o); };
    scratch->error = reinterpret_cast<RoundError*>(p);
    scratch->plan_kept = at(kRecord);
    scratch->block_refs = at(kRecord);
    scratch->eff_lens = at(off[0]);
    scratch->nonfinite = at(off[1]);
    scratch->plan_keep = at(off[2]);
    scratch->apply_keep = at(off[3]);
    scratch->safe_ids = at(off[4]);
    scratch->prefix = at(off[5]);
    scratch->first_private = at(off[6]);
    scratch->last_shared = at(off[7]);
  }
  return total;
}

inline std::string paged_round_what(const char* field) { return std::string("cuda::paged_round: ") + field; }

}  // namespace detail

/// Bytes of device workspace cuda::paged_round needs for `batch` sequences of at most `max_len`
/// slots in a view of `max_seqs` rows and `num_blocks` blocks (scores [batch, L, Hq, max_len]
/// float dominate). The block reference counts share the keep plan's memory, so num_blocks only
/// matters past batch * L * Hkv * max_len blocks; 0 sizes for that case (the round refuses a
/// workspace too short for its view).
[[nodiscard]] inline std::size_t paged_round_workspace_size(const RoundShape& shape, PruningMode mode, int batch,
                                                            int max_len, int max_seqs, int num_blocks = 0) noexcept {
  return detail::carve_paged_round_workspace(nullptr, shape, mode, batch, max_len, max_seqs, num_blocks, nullptr,
                                             nullptr);
}

/// The error record of the last round run with `workspace` (device memory, offset 0): copy it to
/// the host after an event recorded behind the round and pass it to check_round_error.
[[nodiscard]] inline const RoundError* paged_round_error(const void* workspace) noexcept {
  return static_cast<const RoundError*>(workspace);
}

/// What a round's error record says, naming the input ("" when code is kNone).
[[nodiscard]] inline std::string describe(const RoundError& e) {
  const std::string entry = "batch entry " + std::to_string(e.entry) + " (sequence " + std::to_string(e.seq) + "): ";
  const std::string v = std::to_string(e.value);
  const std::string cell = "block_tables[" + std::to_string(e.seq) + "][" + std::to_string(e.column) + "] = " + v;
  switch (static_cast<RoundErrorCode>(e.code)) {
    case RoundErrorCode::kNone: return {};
    case RoundErrorCode::kSeqId: return "batch.seq_ids[" + std::to_string(e.entry) + "] = " + v + " is not a row of the table";
    case RoundErrorCode::kDuplicateSeq:
      return entry + "appears twice in the batch (also batch entry " + std::to_string(e.other) + ")";
    case RoundErrorCode::kLength: return "seq_lens[" + std::to_string(e.seq) + "] = " + v + " is outside [0, capacity]";
    case RoundErrorCode::kBlockId: return cell + " is outside [0, num_blocks)";
    case RoundErrorCode::kMaxLen: return entry + "length " + v + " exceeds batch.max_len";
    case RoundErrorCode::kPromptLen: return entry + "prompt_len = " + v + " is outside [0, length]";
    case RoundErrorCode::kT0: return entry + "t0 = " + v + " (tokens processed) is smaller than its cached length";
    case RoundErrorCode::kProtectedPrefix: return entry + "protected_prefix = " + v + " must be >= 0";
    case RoundErrorCode::kSharedBlock:
      return entry + cell +
             (e.other == e.seq ? " appears twice in the sequence's row"
                               : " is shared with sequence " + std::to_string(e.other)) +
             " but follows a private block; compaction would move tokens across it";
  }
  return "unknown RoundError code " + std::to_string(e.code);
}

/// Throws triattn::logic_error naming the bad input when a round's error record (host copy) is set.
inline void check_round_error(const RoundError& e) {
  if (e.code != 0) TRIATTN_FAIL("cuda::paged_round refused its inputs on the device: " + describe(e));
}

/// The batched round over device memory (the device twin of triattn::paged_round, its oracle).
///
/// @param view      paged cache in device memory (any layout KvCacheView describes); the K/V of
///                  the sequences that complete are compacted in place, tables and lengths are
///                  only read. A `ranges` pointer array must hold 16-byte aligned bases.
/// @param model     per-model constants in device memory (TriAttentionDeviceScorer::device_model())
/// @param params    selection parameters (by value: nothing is read from the host later)
/// @param trigger   kIfDue: sequences below budget + divide_length are reported kNotDue, untouched
/// @param batch     device arrays seq_ids, t0, prompt_lens [batch] and optional protected_prefix
///                  [batch] (slots [0, p) neither selected away nor moved); max_len >= every length
/// @param out       device arrays [batch] (every entry written) and optional kept positions
/// @param workspace caller-owned device memory (256-byte aligned) of at least
///                  paged_round_workspace_size(shape, params.mode, batch.batch, batch.max_len, view.max_seqs)
/// @throws logic_error naming the argument (nothing launched) on a bad view, model, batch, output
///         or workspace, or 16-byte alignment the kernels need; unsupported for an uncompiled
///         head_dim; cuda_error when a launch fails.
/// @note asynchronous on `stream`: allocates nothing, never synchronises; capturable in a CUDA
///       graph. A sequence with a non-finite score in its selectable range is left untouched with
///       RoundStatus::kNonFinite under NonFinitePolicy::kRefuse; the others complete.
/// @note the data the host cannot read is checked on the device: every table row's length and
///       block ids (all max_seqs rows, each up to its length), the batch's ids (in range, no
///       duplicate), lengths (<= max_len), prompt lengths, t0 and protected prefixes, and shared
///       blocks (as the host round: leading ones protected whole, one after a private block
///       refused). On a failure the round writes nothing to the cache, every status is
///       RoundStatus::kInvalid (new_lens = the current length, no freed columns: applying them is
///       a no-op), and the RoundError record at workspace offset 0 (paged_round_error) names the
///       input; copy it after an event behind the round and call check_round_error.
/// @throws also logic_error when outputs or the workspace overlap each other or an input array
///         (tables, lengths, batch arrays, slot positions; the K/V too for a single-base view).
template <class T, class Id, class Policy = tuning::Selected>
void paged_round(const KvCacheView<T, Id>& view, const ScoreModelView& model, const ValidSelectionParams& params,
                 RoundTrigger trigger, const RoundBatch& batch, const RoundOutputs& out, void* workspace,
                 std::size_t workspace_bytes, cudaStream_t stream) {
  paged_round<T, Id, IdentityAgreement, Policy>(view, model, params, trigger, batch, out, workspace, workspace_bytes,
                                                IdentityAgreement{}, stream);
}

/// paged_round(...) on one tensor-parallel rank (see compression_round::plan with an agreement):
/// `view` holds this rank's KV heads, `model` its query heads' statistics; union rounds call
/// `agreement` between their two phases so every rank keeps the tp = 1 set. Every rank must run
/// the same batch. The non-finite check is rank-local (a rank whose own scores are finite
/// completes the round).
template <class T, class Id, UnionAgreement Agreement, class Policy = tuning::Selected>
void paged_round(const KvCacheView<T, Id>& view, const ScoreModelView& model, const ValidSelectionParams& params,
                 RoundTrigger trigger, const RoundBatch& batch, const RoundOutputs& out, void* workspace,
                 std::size_t workspace_bytes, Agreement&& agreement, cudaStream_t stream) {
  using detail::paged_round_what;
  const RoundShape shape{model.num_layers, model.num_q_heads, model.num_kv_heads};
  TRIATTN_EXPECTS(shape.valid(), paged_round_what("model") + " has " + std::to_string(model.num_layers) +
                                     " layers, " + std::to_string(model.num_q_heads) + " query / " +
                                     std::to_string(model.num_kv_heads) + " KV heads (whole GQA groups needed)");
  check_cache_geometry(cache_geometry(view), {model.num_layers, model.num_kv_heads, model.head_dim},
                       "cuda::paged_round", "the model's");
  TRIATTN_EXPECTS(batch.batch >= 0 && batch.batch <= 65535,
                  paged_round_what("batch.batch") + " = " + std::to_string(batch.batch) + " must be in [0, 65535]");
  TRIATTN_EXPECTS(batch.max_len >= 0, paged_round_what("batch.max_len") + " must be >= 0");
  if (batch.batch == 0) return;
  validate_view(view, {}, false, "cuda::paged_round: view");
  TRIATTN_EXPECTS(head_vectors_aligned(view, 16),
                  paged_round_what("view") + ": head vectors must start on 16-byte boundaries (base, layer / K|V, "
                  "block, token and head strides; the kernels load 16 bytes at a time)");
  dispatch_head_dim(view.block.head_dim, [](auto) {});  // throws unsupported naming the compiled list
  TRIATTN_EXPECTS(batch.seq_ids != nullptr && batch.t0 != nullptr && batch.prompt_lens != nullptr,
                  paged_round_what("batch") + ": seq_ids, t0 and prompt_lens must be device arrays, not null");
  TRIATTN_EXPECTS(batch.batch <= view.max_seqs,
                  paged_round_what("batch.batch") + " = " + std::to_string(batch.batch) + " exceeds view.max_seqs = " +
                      std::to_string(view.max_seqs) + " (the batch's sequences are distinct rows)");
  TRIATTN_EXPECTS(batch.max_len <= view.capacity_tokens(),
                  paged_round_what("batch.max_len") + " = " + std::to_string(batch.max_len) +
                      " exceeds the view's capacity per sequence (" + std::to_string(view.capacity_tokens()) + ")");
  TRIATTN_EXPECTS(out.new_lens != nullptr && out.status != nullptr && out.freed_begin != nullptr &&
                      out.freed_end != nullptr,
                  paged_round_what("out") + ": new_lens, status, freed_begin and freed_end must not be null");
  if (out.kept != nullptr) {
    const int natural = kept_rows(params.mode, view.num_layers, view.block.num_kv_heads);
    const int all = view.num_layers * view.block.num_kv_heads;
    TRIATTN_EXPECTS(out.kept_rows == natural || out.kept_rows == all,
                    paged_round_what("out.kept_rows") + " = " + std::to_string(out.kept_rows) + " must be " +
                        std::to_string(natural) + " (" + to_string(params.mode) + ") or " + std::to_string(all));
    TRIATTN_EXPECTS(out.max_keep >= 0, paged_round_what("out.max_keep") + " must be >= 0");
    TRIATTN_EXPECTS(out.slot_positions == nullptr || out.positions_stride >= batch.max_len,
                    paged_round_what("out.positions_stride") + " = " + std::to_string(out.positions_stride) +
                        " must be >= batch.max_len = " + std::to_string(batch.max_len));
  }
  TRIATTN_EXPECTS(workspace != nullptr && is_aligned(workspace, 256),
                  paged_round_what("workspace") + " must be a 256-byte aligned device pointer");
  RoundWorkspace ws;
  PagedRoundScratch scratch;
  std::size_t clear = 0;
  const std::size_t need = detail::carve_paged_round_workspace(workspace, shape, params.mode, batch.batch,
                                                               batch.max_len, view.max_seqs, view.num_blocks, &ws,
                                                               &scratch, &clear);
  TRIATTN_EXPECTS(need <= workspace_bytes, paged_round_what("workspace_bytes") + " = " +
                                               std::to_string(workspace_bytes) + ", the round needs " +
                                               std::to_string(need) + " (paged_round_workspace_size with view.num_blocks = " +
                                               std::to_string(view.num_blocks) + ")");
  triattn::detail::check_round_aliasing(view, false, batch, out, workspace, need, "cuda::paged_round");

  PagedRoundParams p;
  p.select = params;
  p.if_due = trigger == RoundTrigger::kIfDue;
  p.refuse_nonfinite = params.nonfinite == NonFinitePolicy::kRefuse;
  p.num_layers = shape.num_layers;
  p.num_q_heads = shape.num_q_heads;
  p.num_kv_heads = shape.num_kv_heads;
  p.plan_capacity = batch.max_len;
  p.max_seqs = view.max_seqs;

  // Device checks of everything the round reads, block reference counts over every table row,
  // then per sequence its shared leading blocks and whether it takes part (none on an error).
  constexpr int kThreads = Policy::PagedRound::kCheckThreads;
  constexpr int kSlotThreads = Policy::PagedRound::kThreads;
  TRIATTN_CUDA_TRY(cudaMemsetAsync(workspace, 0, clear, stream));
  paged_round_check_kernel<T, Id><<<static_cast<unsigned>(view.max_seqs), kThreads, 0, stream>>>(view, batch, scratch);
  TRIATTN_CUDA_TRY(check_launch(stream));
  const int max_cols = (batch.max_len + view.block.block_size - 1) / view.block.block_size;
  paged_round_share_kernel<T, Id><<<dim3(static_cast<unsigned>(max_cols > 0 ? (max_cols + kThreads - 1) / kThreads : 1),
                                         static_cast<unsigned>(batch.batch)),
                                    kThreads, 0, stream>>>(view, batch, scratch, p);
  TRIATTN_CUDA_TRY(check_launch(stream));
  // Scoring and selection see the checked ids, the effective lengths (0 for sequences that do not
  // take part) and the effective protected prefixes.
  const KvCacheView<T, Id> eff = view.with_tables(view.block_tables, reinterpret_cast<const Id*>(scratch.eff_lens));
  static_assert(sizeof(Id) == sizeof(std::int32_t), "paged_round: 32-bit block ids and lengths");
  const RoundSeqs<Id> seqs{scratch.safe_ids, eff.seq_lens, batch.prompt_lens, batch.batch, batch.max_len,
                           scratch.prefix};
  TRIATTN_CUDA_TRY(
      (score<T, Id, typename Policy::Score>(eff, model, ScoreBatch{scratch.safe_ids, batch.t0, batch.batch,
                                                                   batch.max_len},
                                            ws.scores, stream)));
  const long long rows = static_cast<long long>(batch.batch) * shape.num_layers * shape.num_q_heads;
  if (params.nonfinite == NonFinitePolicy::kEvictFirst && batch.max_len > 0) {
    mark_broken_slots_kernel<Id><<<dim3(static_cast<unsigned>((batch.max_len + kSlotThreads - 1) / kSlotThreads),
                                        static_cast<unsigned>(batch.batch)),
                                   kSlotThreads, 0, stream>>>(ws.scores, seqs, p);
    TRIATTN_CUDA_TRY(check_launch(stream));
  }
  if (params.normalize) {
    TRIATTN_CUDA_TRY((row_stats<Id, typename Policy::Normalize>(ws.scores, ws.stats, seqs, p.select, shape, stream)));
  } else {
    nonfinite_scan_kernel<Id><<<static_cast<unsigned>(rows), kSlotThreads, 0, stream>>>(ws.scores, seqs, scratch, p);
    TRIATTN_CUDA_TRY(check_launch(stream));
  }
  TRIATTN_CUDA_TRY((gqa_reduce<Id, typename Policy::Normalize>(ws.scores, ws.stats, ws.reduced, ws.flags, seqs,
                                                               p.select, shape, stream)));
  const DeviceKeepPlanView plan{scratch.plan_kept, scratch.plan_keep, batch.max_len};
  if (params.mode != PruningMode::kUnion || std::is_same_v<std::remove_cvref_t<Agreement>, IdentityAgreement>) {
    TRIATTN_CUDA_TRY((select_keep<Id, typename Policy::Select>(ws.scores, ws.reduced, ws.flags, plan, seqs, p.select,
                                                               shape, stream)));
  } else {
    TRIATTN_CUDA_TRY(
        (select_union_candidates<Id, typename Policy::Select>(ws.scores, ws.reduced, ws.flags, ws.vmax, seqs,
                                                              p.select, shape, stream)));
    TRIATTN_CUDA_TRY(agreement(ws.flags, ws.vmax, batch.batch, batch.max_len, stream));
    TRIATTN_CUDA_TRY((select_union_finish<Id, typename Policy::Select>(ws.flags, ws.vmax, plan, seqs, p.select, shape,
                                                                       stream)));
  }
  const int chunks = out.kept != nullptr ? (out.kept_rows < 64 ? out.kept_rows : 64) : 1;
  paged_round_outputs_kernel<Id><<<dim3(static_cast<unsigned>(batch.batch), static_cast<unsigned>(chunks)),
                                   kSlotThreads, 0, stream>>>(view.seq_lens, view.block.block_size, batch, out, scratch,
                                             params.normalize ? ws.stats : nullptr, p);
  TRIATTN_CUDA_TRY(check_launch(stream));
  TRIATTN_CUDA_TRY((compact::run<T, Id, typename Policy::Compact>(
      view, CompactParams{scratch.plan_kept, scratch.apply_keep, scratch.safe_ids, batch.max_len}, batch.batch,
      stream)));
}

}  // namespace triattn::cuda
