// SPDX-License-Identifier: Apache-2.0
// Decode steps under CUDA graphs for a few batch-size buckets (cuda_step_recorder.cuh captures,
// this file pads). A graph bakes in every launch's shape, so a step of n rows replays only a
// graph of n rows; as sequences finish, each new batch size would cost a capture. Instead a
// decode step of n rows is padded to its bucket B (the next power of two) before its graph is
// looked up, and one graph per bucket serves every batch in (B/2, B]. The B - n padding rows
//   * embed token 0 at position 0, run through the matmuls (weight-bound at decode batches: the
//     extra rows cost little) and are never read back (the classifier picks the real rows),
//   * write no K/V: their slot is -1, which triattn's append kernel (and the RoPE kernel's direct
//     write) skips,
//   * attend a sequence slot of length 0 (the "spare" slot the attention op names: an inactive
//     or empty sequence of the cache), which the decode-attention kernel answers with zeros
//     without reading a key.
// The step's per-row arrays are rebuilt in the arena at fixed offsets for the bucket (tokens,
// positions, sequences, slots, slot mapping), so every step of a bucket has the same op list.
// A step that cannot be padded (no spare slot, a buffer without room for B rows, an attention
// that is not triattn's decode kernel, tensor parallelism) keeps its exact graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/cuda/algorithms/decode_attention.cuh>

namespace triattn_example::cuda_detail {

/// The bucket of a decode step of n rows: the next power of two (1, 2, 4, ..., 65,536).
[[nodiscard]] inline int decode_bucket(int n) noexcept {
  int b = 1;
  while (b < n && b < (1 << 16)) b *= 2;
  return b;
}

/// Device buffers the backend handed out (start -> bytes): a padded op may only touch rows that
/// lie inside one of them.
class BufferMap {
 public:
  void add(const void* p, std::size_t bytes) { bytes_[reinterpret_cast<std::uintptr_t>(p)] = bytes; }
  void remove(const void* p) noexcept { bytes_.erase(reinterpret_cast<std::uintptr_t>(p)); }
  /// Whether [p, p + bytes) lies inside one buffer.
  [[nodiscard]] bool holds(const void* p, std::size_t bytes) const {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = bytes_.upper_bound(a);
    if (it == bytes_.begin()) return false;
    --it;
    return a + bytes <= it->first + it->second;
  }

 private:
  std::map<std::uintptr_t, std::size_t> bytes_;
};

/// Rewrites the recorder's op list of a decode step (one token per sequence, n rows) to `bucket`
/// rows, with the per-row arrays rebuilt in a reset arena. Returns false, leaving the step as it
/// was, when it cannot be padded (see the file comment). Recorder: cuda_step_recorder.cuh's
/// StepRecorder (ops, arena, buffers, scratch(), resident_ctas<T>(), the per-step memos).
template <class Recorder>
[[nodiscard]] bool pad_decode_step(Recorder& r, int n, int bucket) {
  std::vector<Op>& ops = r.ops;
  const int B = bucket;
  if (B <= n || B > 65535 || ops.empty() || ops.front().kind != OpKind::kEmbed || ops.front().n != n) return false;
  const auto rows_in = [&](const void* p, long long floats) {
    return r.buffers.holds(p, static_cast<std::size_t>(floats) * sizeof(float));
  };
  // 1. The step's per-row data, read back from the arena's host staging.
  const Op* first_rope = nullptr;
  const Op* first_attn = nullptr;
  std::size_t first_write = ops.size();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const Op& o = ops[i];
    if (o.kind == OpKind::kAllReduce) return false;
    if (o.kind == OpKind::kRope && first_rope == nullptr) first_rope = &o;
    if (o.kind == OpKind::kWriteKv && first_write == ops.size()) first_write = i;
    if (o.kind == OpKind::kAttention) {
      if (o.flag != kAttnDecode || o.n != n || o.spare_seq < 0) return false;
      if (first_attn == nullptr) first_attn = &o;
    }
  }
  if (first_rope == nullptr || first_attn == nullptr || first_rope->n != n || first_write + n > ops.size()) return false;
  std::vector<long long> slot_offs;  // slot-mapping offset of each row's write_kv (every layer reuses them)
  for (int k = 0; k < n; ++k) {
    const Op& w = ops[first_write + static_cast<std::size_t>(k)];
    if (w.kind != OpKind::kWriteKv || w.n != 1) return false;
    slot_offs.push_back(w.arena_a);
  }
  std::vector<int> tokens(static_cast<std::size_t>(B), 0);
  std::vector<long long> pos(static_cast<std::size_t>(B), 0);
  std::vector<std::int32_t> seq(static_cast<std::size_t>(B), first_attn->spare_seq), slot(static_cast<std::size_t>(B), 0);
  std::vector<std::int64_t> slot_map(static_cast<std::size_t>(B), -1);
  std::memcpy(tokens.data(), r.arena.template host<int>(ops.front().arena_a), sizeof(int) * static_cast<std::size_t>(n));
  std::memcpy(pos.data(), r.arena.template host<long long>(first_rope->arena_a), sizeof(long long) * static_cast<std::size_t>(n));
  std::memcpy(seq.data(), r.arena.template host<std::int32_t>(first_attn->arena_a), sizeof(std::int32_t) * static_cast<std::size_t>(n));
  std::memcpy(slot.data(), r.arena.template host<std::int32_t>(first_attn->arena_b), sizeof(std::int32_t) * static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    slot_map[static_cast<std::size_t>(i)] = *r.arena.template host<std::int64_t>(slot_offs[static_cast<std::size_t>(i)]);

  // 2. The op list at B rows (every member checked; any surprise leaves the step exact).
  std::vector<Op> out;
  out.reserve(ops.size());
  std::vector<std::size_t> attn_at;
  for (std::size_t i = 0; i < ops.size();) {
    Op o = ops[i];
    switch (o.kind) {
      case OpKind::kEmbed:
      case OpKind::kRmsNorm:
      case OpKind::kBias:
        if (o.n != n || !rows_in(o.y, static_cast<long long>(B) * o.a) ||
            (o.kind == OpKind::kRmsNorm && !rows_in(o.x, static_cast<long long>(B) * o.a)))
          return false;
        o.n = B;
        break;
      case OpKind::kMatmul:
        if (o.n != n || !rows_in(o.y, static_cast<long long>(B) * o.a) || !rows_in(o.x, static_cast<long long>(B) * o.b))
          return false;
        o.n = B;
        break;
      case OpKind::kRope:
        if (o.n != n || o.arena_a != first_rope->arena_a || !rows_in(o.y, static_cast<long long>(B) * o.a * o.b)) return false;
        o.n = B;
        break;
      case OpKind::kAdd:
      case OpKind::kSwiglu: {
        if (o.count % n != 0) return false;
        const long long cnt = o.count / n * B;
        if (!rows_in(o.y, cnt) || !rows_in(o.x2, cnt)) return false;
        o.count = cnt;
        break;
      }
      case OpKind::kWriteKv: {
        // The n one-row writes of a layer (rows in order, consecutive k / v rows) -> one of B rows.
        if (i + static_cast<std::size_t>(n) > ops.size()) return false;
        for (int k = 0; k < n; ++k) {
          const Op& w = ops[i + static_cast<std::size_t>(k)];
          if (w.kind != OpKind::kWriteKv || w.n != 1 || w.layer != o.layer || w.x != o.x + static_cast<long long>(k) * o.a ||
              w.x2 != o.x2 + static_cast<long long>(k) * o.a || w.arena_a != slot_offs[static_cast<std::size_t>(k)] ||
              std::memcmp(&w.view, &o.view, sizeof w.view) != 0)
            return false;
        }
        if (!rows_in(o.x, static_cast<long long>(B) * o.a) || !rows_in(o.x2, static_cast<long long>(B) * o.a)) return false;
        o.n = B;
        out.push_back(o);
        i += static_cast<std::size_t>(n);
        continue;
      }
      case OpKind::kAttention:
        if (o.arena_a != first_attn->arena_a || o.arena_b != first_attn->arena_b ||
            !rows_in(o.y, static_cast<long long>(B) * o.a * o.d) || !rows_in(o.x, static_cast<long long>(B) * o.a * o.d))
          return false;
        o.n = B;
        attn_at.push_back(out.size());
        break;
      case OpKind::kAllReduce: return false;
    }
    out.push_back(o);
    ++i;
  }
  // 3. Decode-attention plans, workspace and q scratch for B rows (every layer shares them).
  void* workspace = nullptr;
  void* q_t = nullptr;
  std::size_t ws_bytes = 0;
  for (std::size_t k = 0; k < attn_at.size(); ++k) {
    Op& a = out[attn_at[k]];
    const auto dt = static_cast<triattn::DType>(a.dtype);
    int ctas = 0;
    dispatch_cache_type(dt, [&](auto st, auto) { ctas = r.template resident_ctas<typename decltype(st)::type>(a.d); });
    a.plan = triattn::cuda::decode_attention::make_plan(dt, B, a.b, a.a / a.b, static_cast<int>(a.count), ctas);
    a.workspace_bytes = triattn::cuda::decode_attention::workspace_size(a.plan, B, a.a, a.d);
    if (k == 0 || a.workspace_bytes > ws_bytes) {
      ws_bytes = a.workspace_bytes;
      workspace = ws_bytes > 0 ? r.scratch(Recorder::kWorkspace, ws_bytes) : nullptr;
      if (converts_query(dt))  // 16-bit caches; fp32 and fp8 take the float q
        q_t = r.scratch(Recorder::kQt, static_cast<std::size_t>(B) * a.a * a.d * triattn::dtype_size(dt));
    }
  }
  for (std::size_t k : attn_at) {
    Op& a = out[k];
    a.workspace = a.workspace_bytes > 0 ? workspace : nullptr;
    if (a.workspace != nullptr) a.workspace_bytes = ws_bytes;
    a.q_t = converts_query(static_cast<triattn::DType>(a.dtype)) ? q_t : nullptr;
  }
  // 4. The per-row arrays at fixed offsets; the step's memos pointed into the old arena.
  r.arena.reset();
  const long long tok_off = r.arena.push(tokens.data(), tokens.size() * sizeof(int), 16, r.stream);
  const long long pos_off = r.arena.push(pos.data(), pos.size() * sizeof(long long), 16, r.stream);
  const long long seq_off = r.arena.push(seq.data(), seq.size() * sizeof(std::int32_t), 16, r.stream);
  const long long slot_off = r.arena.push(slot.data(), slot.size() * sizeof(std::int32_t), 16, r.stream);
  const long long map_off = r.arena.push(slot_map.data(), slot_map.size() * sizeof(std::int64_t), 16, r.stream);
  for (Op& o : out) {
    if (o.kind == OpKind::kEmbed) o.arena_a = tok_off;
    if (o.kind == OpKind::kRope) o.arena_a = pos_off;
    if (o.kind == OpKind::kWriteKv) o.arena_a = map_off;
    if (o.kind == OpKind::kAttention) {
      o.arena_a = seq_off;
      o.arena_b = slot_off;
    }
  }
  r.forget_row_memos();
  ops = std::move(out);
  return true;
}

}  // namespace triattn_example::cuda_detail
