// SPDX-License-Identifier: Apache-2.0
// Prefix protection for rounds over block tables an engine shares between sequences (prefix
// caching): a block another table row also references is never rewritten. A sequence's leading
// shared blocks are protected whole (effective_protected_prefix extends its protected_prefix over
// them); a shared block after a private one is refused, since compaction would move tokens
// across it. One definition for the host round, the device round and the Python bindings.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/config.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/kv_view.hpp>
#include <triattn/engine/view_checks.hpp>

namespace triattn {

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

}  // namespace detail

}  // namespace triattn
