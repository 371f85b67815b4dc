// SPDX-License-Identifier: Apache-2.0
// The batched round over engine-owned paged memory (engine/paged_round.hpp): for each engine layout
// (triattn's own NHD/HND, vLLM FlashAttention, vLLM FlashInfer NHD/HND, SGLang per-token slots,
// a TensorRT-LLM-style multi-layer pool), cache contents built in that layout from the same
// random K/V as a KvCache; one round over the view must give bitwise the KvCache path's kept K/V,
// kept positions and lengths (page sizes 1, 16, 64; every pruning mode; protection settings;
// ragged batches with sequences below the trigger), write nothing else, and a second round with
// the reported positions must keep reporting original positions. Bad views and bad batches are
// refused with a message before anything is written. A non-finite score in one sequence leaves
// that sequence unchanged and the others compressed (issue 38 item 2), or is evicted first.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <triattn/core/admission.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/host_compactor.hpp>
#include <triattn/core/policy/recency_scorer.hpp>
#include <triattn/core/policy/static_allocator.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/engine/layouts.hpp>
#include <triattn/engine/paged_round.hpp>

#include "common/round_settings.hpp"

using namespace triattn;
using triattn::test::kProtections;
using triattn::test::make_params;
using triattn::test::Protection;

namespace {

using T = bf16_storage;
using Cache = KvCache<StaticAllocator<HostBackend>, HostCompactor, TriAttentionScorer, TopKSelector>;

constexpr int kL = 2, kHq = 4, kHkv = 2, kD = 16;
constexpr int kMaxTokens = 96;  // capacity of every sequence

enum class Engine { kOwnNHD, kOwnHND, kVllmFlashAttn, kFlashInferNHD, kFlashInferHND, kSglang, kTrtPool };
constexpr Engine kEngines[] = {Engine::kOwnNHD,        Engine::kOwnHND,        Engine::kVllmFlashAttn, Engine::kFlashInferNHD,
                               Engine::kFlashInferHND, Engine::kSglang,        Engine::kTrtPool};
const char* engine_name(Engine e) {
  switch (e) {
    case Engine::kOwnNHD: return "triattn NHD";
    case Engine::kOwnHND: return "triattn HND";
    case Engine::kVllmFlashAttn: return "vLLM FlashAttention";
    case Engine::kFlashInferNHD: return "vLLM FlashInfer NHD";
    case Engine::kFlashInferHND: return "vLLM FlashInfer HND";
    case Engine::kSglang: return "SGLang";
    case Engine::kTrtPool: return "TensorRT-LLM pool";
  }
  return "?";
}

/// An engine's paged memory of element type T, allocated as that engine does, with its own block
/// ids (a permutation of the cache's) and a view over it. SGLang gets one slot per token (view
/// block_size 1) over the same pages.
template <class T>
struct EngineMem {
  Engine kind;
  int bs = 0, nb = 0, max_seqs = 0;
  std::vector<std::vector<T>> bufs;
  std::vector<T*> ranges;
  std::vector<std::int32_t> perm;  // cache block id -> engine block id
  std::vector<std::int32_t> table, lens;
  KvCacheView<T> view{};
  std::int64_t pad = 8;  // triattn layouts: padded range stride

  EngineMem(Engine e, int block_size, int num_blocks, int seqs, std::mt19937& rng)
      : kind(e), bs(block_size), nb(num_blocks), max_seqs(seqs) {
    const std::int64_t blk = static_cast<std::int64_t>(bs) * kHkv * kD;
    std::uniform_int_distribution<int> poison(0, 0xffff);
    const auto alloc = [&](std::int64_t n) {
      std::vector<T> b(static_cast<std::size_t>(n));
      for (T& x : b) x.bits = static_cast<decltype(x.bits)>(poison(rng));
      bufs.push_back(std::move(b));
    };
    perm.resize(static_cast<std::size_t>(nb));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const int cap_blocks = kMaxTokens / bs + (kMaxTokens % bs != 0);
    int rows_per_seq = cap_blocks;
    switch (e) {
      case Engine::kOwnNHD:
      case Engine::kOwnHND: {
        const std::int64_t rs = nb * blk + pad;
        alloc(2 * kL * rs);
        view = KvCacheView<T>::contiguous(bufs[0].data(), rs,
                                          BlockLayout(e == Engine::kOwnNHD ? KvLayout::kNHD : KvLayout::kHND, bs, kHkv, kD),
                                          kL, nb, max_seqs, cap_blocks, nullptr, nullptr);
        break;
      }
      case Engine::kVllmFlashAttn:
      case Engine::kFlashInferNHD:
      case Engine::kFlashInferHND: {
        const EngineLayout el = e == Engine::kVllmFlashAttn ? EngineLayout::vllm_flash_attn(nb, bs, kHkv, kD)
                                : e == Engine::kFlashInferNHD ? EngineLayout::vllm_flashinfer(bs, kHkv, kD)
                                                              : EngineLayout::vllm_flashinfer(bs, kHkv, kD, KvLayout::kHND);
        for (int l = 0; l < kL; ++l) alloc(2 * nb * blk);
        for (int l = 0; l < kL; ++l) {
          ranges.push_back(bufs[static_cast<std::size_t>(l)].data());
          ranges.push_back(bufs[static_cast<std::size_t>(l)].data() + el.kind_offset);
        }
        view.ranges = ranges.data();
        view.block = el.block;
        break;
      }
      case Engine::kSglang: {
        const EngineLayout el = EngineLayout::sglang(kHkv, kD);
        for (int r = 0; r < 2 * kL; ++r) alloc(nb * blk);  // K and V buffer per layer
        for (auto& b : bufs) ranges.push_back(b.data());
        view.ranges = ranges.data();
        view.block = el.block;
        rows_per_seq = kMaxTokens;
        break;
      }
      case Engine::kTrtPool: {
        const EngineLayout el = EngineLayout::trtllm_pool(kL, bs, kHkv, kD);
        alloc(nb * el.block.stride_block);
        view.data = bufs[0].data();
        view.layer_stride = 2 * el.kind_offset;
        view.kind_stride = el.kind_offset;
        view.block = el.block;
        break;
      }
    }
    view.num_layers = kL;
    view.num_blocks = e == Engine::kSglang ? nb * bs : nb;
    view.max_seqs = max_seqs;
    view.max_blocks_per_seq = rows_per_seq;
    table.assign(static_cast<std::size_t>(max_seqs) * rows_per_seq, -1);
    lens.assign(static_cast<std::size_t>(max_seqs), 0);
    view.block_tables = table.data();
    view.seq_lens = lens.data();
  }

  /// Where the engine's own tensor shapes put (layer, kind, engine block, slot in block, head),
  /// written from the engines' documented shapes, independently of BlockLayout.
  const T* expected(int l, int kv, std::int64_t b, int r, int h) const {
    const std::int64_t H = kHkv, D = kD, B = bs, N = nb;
    switch (kind) {
      case Engine::kOwnNHD: return bufs[0].data() + (2 * l + kv) * (N * B * H * D + pad) + ((b * B + r) * H + h) * D;
      case Engine::kOwnHND: return bufs[0].data() + (2 * l + kv) * (N * B * H * D + pad) + ((b * H + h) * B + r) * D;
      case Engine::kVllmFlashAttn: return bufs[static_cast<std::size_t>(l)].data() + ((kv * N + b) * B + r) * H * D + h * D;
      case Engine::kFlashInferNHD: return bufs[static_cast<std::size_t>(l)].data() + (((b * 2 + kv) * B + r) * H + h) * D;
      case Engine::kFlashInferHND: return bufs[static_cast<std::size_t>(l)].data() + (((b * 2 + kv) * H + h) * B + r) * D;
      case Engine::kSglang: return bufs[static_cast<std::size_t>(2 * l + kv)].data() + (b * H + h) * D;
      case Engine::kTrtPool: return bufs[0].data() + ((((b * kL + l) * 2 + kv) * H + h) * B + r) * D;
    }
    return nullptr;
  }

  /// Copies the cache's table row, lengths, K/V of `seq` and K/V scales into the engine's memory.
  void load(const Cache& c, SeqId seq) {
    const auto cv = c.template view<T>();
    view = view.with_scales(cv.scales, cv.scale_heads);
    const int len = c.physical_length(seq);
    lens[static_cast<std::size_t>(seq)] = len;
    const auto row = c.block_table(seq);
    std::int32_t* trow = table.data() + static_cast<std::size_t>(seq) * view.max_blocks_per_seq;
    std::fill(trow, trow + view.max_blocks_per_seq, -1);
    if (kind == Engine::kSglang) {
      for (int i = 0; i < len; ++i) trow[i] = perm[static_cast<std::size_t>(row[static_cast<std::size_t>(i / bs)])] * bs + i % bs;
    } else {
      for (std::size_t j = 0; j < row.size(); ++j) trow[j] = perm[static_cast<std::size_t>(row[j])];
    }
    for (int l = 0; l < kL; ++l)
      for (int kv = 0; kv < 2; ++kv)
        for (int i = 0; i < len; ++i)
          for (int h = 0; h < kHkv; ++h)
            std::memcpy(view.token(l, static_cast<KvKind>(kv), seq, i, h), cv.token(l, static_cast<KvKind>(kv), seq, i, h),
                        sizeof(T) * kD);
  }
};
using Standin = EngineMem<T>;

/// Per (layer, K|V, KV head) scales of the fp8 configurations: distinct, far from 1.
std::vector<float> fp8_scales() {
  std::vector<float> s(static_cast<std::size_t>(2 * kL * kHkv));
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = 0.0125f * static_cast<float>(i + 1);
  return s;
}

CacheConfig make_config(int bs, KvLayout layout, int max_seqs, DType dtype = DType::kBF16) {
  CacheConfig c;
  c.model = ModelGeometry{kL, kHq, kHkv, kD};
  c.block_size = bs;
  c.max_blocks_per_seq = kMaxTokens / bs + (kMaxTokens % bs != 0);
  c.num_blocks = max_seqs * c.max_blocks_per_seq + 3;
  c.max_seqs = max_seqs;
  c.layout = layout;
  c.dtype = dtype;
  if (dtype == DType::kFP8E4M3) c.kv_scales = fp8_scales();
  c.track_positions = true;  // the KvCache twins report kept positions to compare with
  return c;
}

const QueryStats& stats() {
  static const QueryStats s = [] {
    std::mt19937 rng(77);
    return random_query_stats(rng, kL, kHq, kD);
  }();
  return s;
}
TriAttentionScorer make_scorer() { return TriAttentionScorer(stats(), RopeConfig{}, ScoringParams{}, kHkv); }

/// Appends `n` random tokens (K and V [L, n, Hkv, D]) to `seq`, rounded to the cache's dtype.
void append_random(Cache& c, SeqId seq, int n, Phase phase, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> k(static_cast<std::size_t>(kL) * n * kHkv * kD), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  REQUIRE(c.append_values(seq, std::span<const float>(k), std::span<const float>(v), n, phase).ok());
}

/// Element masks of the engine's buffers covering slots [0, len) of `seq`.
template <class T>
void mark(const EngineMem<T>& e, std::vector<std::vector<std::uint8_t>>& masks, int seq, int len) {
  for (int l = 0; l < kL; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int i = 0; i < len; ++i)
        for (int h = 0; h < kHkv; ++h) {
          const T* p = e.view.token(l, static_cast<KvKind>(kv), seq, i, h);
          for (std::size_t b = 0; b < e.bufs.size(); ++b) {
            const T* lo = e.bufs[b].data();
            if (p >= lo && p < lo + e.bufs[b].size()) {
              std::fill_n(masks[b].begin() + (p - lo), kD, std::uint8_t{1});
              break;
            }
          }
        }
}

struct Outputs {
  std::vector<std::int32_t> new_lens, status, freed_begin, freed_end, kept;
  RoundOutputs out;
  Outputs(int batch, int rows, int max_keep)
      : new_lens(static_cast<std::size_t>(batch), -7), status(new_lens), freed_begin(new_lens), freed_end(new_lens),
        kept(static_cast<std::size_t>(batch) * rows * max_keep, -7) {
    out.new_lens = new_lens.data();
    out.status = status.data();
    out.freed_begin = freed_begin.data();
    out.freed_end = freed_end.data();
    out.kept = kept.data();
    out.kept_rows = rows;
    out.max_keep = max_keep;
  }
};

template <class T>
bool same_bufs(const std::vector<std::vector<T>>& a, const std::vector<std::vector<T>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t k = 0; k < a.size(); ++k)
    if (a[k].size() != b[k].size() || std::memcmp(a[k].data(), b[k].data(), a[k].size() * sizeof(T)) != 0) return false;
  return true;
}

/// Compares slots [0, len) of `seq` in the engine and in the cache, bit for bit.
template <class T>
bool same_kv(const EngineMem<T>& e, const Cache& c, SeqId seq, int len) {
  const auto cv = c.template view<T>();
  for (int l = 0; l < kL; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int i = 0; i < len; ++i)
        for (int h = 0; h < kHkv; ++h)
          if (std::memcmp(e.view.token(l, static_cast<KvKind>(kv), seq, i, h), cv.token(l, static_cast<KvKind>(kv), seq, i, h),
                          sizeof(T) * kD) != 0)
            return false;
  return true;
}

}  // namespace

TEST_SUITE("core") {

// The engine tests run for each element size: 2-byte bf16 and 1-byte fp8 e4m3 with scales.
TEST_CASE_TEMPLATE("paged round: engine views address the engine's own tensor elements", T, bf16_storage,
                   fp8_e4m3_storage) {
  std::mt19937 rng(5);
  for (int bs : {1, 16, 64})
    for (Engine e : kEngines) {
      CAPTURE(engine_name(e));
      CAPTURE(bs);
      const CacheConfig cfg = make_config(bs, KvLayout::kNHD, 3, dtype_of<T>);
      Cache c(cfg, make_scorer(), TopKSelector(SelectionParams{}));
      EngineMem<T> s(e, bs, cfg.num_blocks, cfg.max_seqs, rng);
      const SeqId q0 = c.add_sequence(), q1 = c.add_sequence();
      append_random(c, q0, 70, Phase::kPrefill, rng);
      append_random(c, q1, 33, Phase::kPrefill, rng);
      s.load(c, q0);
      s.load(c, q1);
      validate_view(s.view, std::vector<std::int32_t>{q0, q1}, true);
      bool ok = true;
      for (SeqId q : {q0, q1})
        for (int l = 0; l < kL; ++l)
          for (int kv = 0; kv < 2; ++kv)
            for (int i = 0; i < c.physical_length(q); ++i)
              for (int h = 0; h < kHkv; ++h) {
                const std::int32_t id = s.table[static_cast<std::size_t>(q) * s.view.max_blocks_per_seq +
                                                static_cast<std::size_t>(e == Engine::kSglang ? i : i / bs)];
                const T* want = s.expected(l, kv, id, e == Engine::kSglang ? 0 : i % bs, h);
                ok = ok && s.view.token(l, static_cast<KvKind>(kv), q, i, h) == want;
              }
      CHECK(ok);
    }
}

TEST_CASE_TEMPLATE("paged round: every engine layout gives the KvCache round bitwise over a ragged batch", T,
                   bf16_storage, fp8_e4m3_storage) {
  int cases = 0, compressed_total = 0, not_due_total = 0;
  for (int bs : {1, 16, 64})
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion})
      for (const Protection& prot : kProtections) {
        const SelectionParams sp = make_params(mode, prot);
        // prompt, decode tokens: ragged, two sequences below the trigger
        const int lens[][2] = {{10, 30}, {6, 14}, {12, 4}, {3, 60}, {20, 21}};
        const int nseq = 5;
        std::mt19937 rng(1000u + static_cast<unsigned>(bs) * 13u + static_cast<unsigned>(mode) * 7u +
                         static_cast<unsigned>(prot.prompt));
        const CacheConfig cfg = make_config(bs, bs == 16 ? KvLayout::kHND : KvLayout::kNHD, nseq + 1, dtype_of<T>);
        // Build the cache once per combination, then a fresh copy of its contents per engine.
        Cache ref_cache(cfg, make_scorer(), TopKSelector(sp));
        std::vector<SeqId> ids;
        for (int q = 0; q < nseq; ++q) {
          const SeqId s = ref_cache.add_sequence();
          ids.push_back(s);
          append_random(ref_cache, s, lens[q][0], Phase::kPrefill, rng);
          append_random(ref_cache, s, lens[q][1], Phase::kDecode, rng);
        }
        for (Engine e : kEngines) {
          CAPTURE(engine_name(e));
          CAPTURE(bs);
          CAPTURE(to_string(mode));
          CAPTURE(to_string(prot.prompt));
          EngineMem<T> st(e, bs, cfg.num_blocks, cfg.max_seqs, rng);
          for (SeqId q : ids) st.load(ref_cache, q);
          const std::vector<std::vector<T>> before = st.bufs;
          // Inputs of the engine's round, from the cache's bookkeeping before its round.
          std::vector<std::int64_t> t0;
          std::vector<std::int32_t> prompts, old_len;
          for (SeqId q : ids) {
            t0.push_back(ref_cache.logical_position(q));
            prompts.push_back(ref_cache.prompt_length(q));
            old_len.push_back(ref_cache.physical_length(q));
          }
          // The KvCache path, on a twin cache with the same contents.
          Cache twin(cfg, make_scorer(), TopKSelector(sp));
          {
            std::mt19937 rng2(1000u + static_cast<unsigned>(bs) * 13u + static_cast<unsigned>(mode) * 7u +
                              static_cast<unsigned>(prot.prompt));
            for (int q = 0; q < nseq; ++q) {
              const SeqId s = twin.add_sequence();
              REQUIRE(s == ids[static_cast<std::size_t>(q)]);
              append_random(twin, s, lens[q][0], Phase::kPrefill, rng2);
              append_random(twin, s, lens[q][1], Phase::kDecode, rng2);
            }
          }
          const std::vector<CompressionReport> reps = twin.compress_if_needed(ids);
          const int rows = kept_rows(mode, kL, kHkv);
          Outputs o(nseq, rows, kMaxTokens);
          TriAttentionScorer scorer = make_scorer();
          const RoundBatch rb{ids.data(), t0.data(), prompts.data(), nseq, kMaxTokens};
          std::vector<std::byte> ws(paged_round_workspace_size(cfg.model, kMaxTokens));
          const int n = paged_round(st.view, scorer, sp, cfg.model, RoundTrigger::kIfDue, rb, o.out, ws.data(), ws.size());
          CHECK(n == static_cast<int>(reps.size()));
          std::size_t r_i = 0;
          std::vector<std::vector<std::uint8_t>> masks;
          for (const auto& b : st.bufs) masks.emplace_back(b.size(), 0);
          for (int b = 0; b < nseq; ++b) {
            CAPTURE(b);
            const SeqId q = ids[static_cast<std::size_t>(b)];
            const bool due = r_i < reps.size() && reps[r_i].seq == q;
            const int ebs = e == Engine::kSglang ? 1 : bs;
            CHECK(o.freed_end[static_cast<std::size_t>(b)] == (old_len[static_cast<std::size_t>(b)] + ebs - 1) / ebs);
            if (!due) {
              ++not_due_total;
              CHECK(o.status[static_cast<std::size_t>(b)] == static_cast<int>(RoundStatus::kNotDue));
              CHECK(o.new_lens[static_cast<std::size_t>(b)] == old_len[static_cast<std::size_t>(b)]);
              CHECK(o.freed_begin[static_cast<std::size_t>(b)] == o.freed_end[static_cast<std::size_t>(b)]);
              CHECK(same_kv(st, twin, q, old_len[static_cast<std::size_t>(b)]));
              continue;
            }
            const CompressionReport& rep = reps[r_i++];
            ++compressed_total;
            REQUIRE(o.status[static_cast<std::size_t>(b)] == static_cast<int>(RoundStatus::kCompressed));
            REQUIRE(rep.status == RoundStatus::kCompressed);
            const int nl = o.new_lens[static_cast<std::size_t>(b)];
            CHECK(nl == rep.length_after);
            CHECK(nl < old_len[static_cast<std::size_t>(b)]);
            CHECK(o.freed_begin[static_cast<std::size_t>(b)] == (nl + ebs - 1) / ebs);
            if (e != Engine::kSglang)
              CHECK(o.freed_end[static_cast<std::size_t>(b)] - o.freed_begin[static_cast<std::size_t>(b)] == rep.blocks_freed);
            REQUIRE(rep.kept_rows == rows);
            bool pos_ok = true;
            for (int r = 0; r < rows; ++r)
              for (int i = 0; i < nl; ++i)
                pos_ok = pos_ok && o.kept[(static_cast<std::size_t>(b) * rows + r) * kMaxTokens + i] == rep.kept(r)[static_cast<std::size_t>(i)];
            CHECK(pos_ok);
            CHECK(same_kv(st, twin, q, nl));
            mark(st, masks, q, old_len[static_cast<std::size_t>(b)]);
          }
          // Nothing outside the compressed sequences' own slots changed.
          bool untouched = true;
          for (std::size_t k = 0; k < st.bufs.size(); ++k)
            for (std::size_t i = 0; i < st.bufs[k].size(); ++i)
              if (!masks[k][i] && st.bufs[k][i].bits != before[k][i].bits) untouched = false;
          CHECK(untouched);

          // Second round: the engine applies the outputs, both decode more, and the reported
          // positions (fed back as slot_positions) stay original positions.
          std::vector<std::int32_t> pos(static_cast<std::size_t>(nseq) * rows * kMaxTokens, -1);
          for (int b = 0; b < nseq; ++b) {
            const SeqId q = ids[static_cast<std::size_t>(b)];
            const int nl = o.new_lens[static_cast<std::size_t>(b)];
            for (int r = 0; r < rows; ++r)
              for (int i = 0; i < nl; ++i)
                pos[(static_cast<std::size_t>(b) * rows + r) * kMaxTokens + i] =
                    o.status[static_cast<std::size_t>(b)] == static_cast<int>(RoundStatus::kCompressed)
                        ? o.kept[(static_cast<std::size_t>(b) * rows + r) * kMaxTokens + i]
                        : i;
            std::mt19937 rng3(5u + static_cast<unsigned>(b));
            append_random(twin, q, 12, Phase::kDecode, rng3);
            st.lens[static_cast<std::size_t>(q)] = nl;  // the engine's own bookkeeping of the round
            st.load(twin, q);                           // its new tokens (and the table as the cache keeps it)
            for (int r = 0; r < rows; ++r)
              for (int i = nl; i < nl + 12; ++i)
                pos[(static_cast<std::size_t>(b) * rows + r) * kMaxTokens + i] = static_cast<std::int32_t>(t0[static_cast<std::size_t>(b)]) + (i - nl);
            t0[static_cast<std::size_t>(b)] = twin.logical_position(q);
            prompts[static_cast<std::size_t>(b)] = twin.prompt_length(q);
          }
          const std::vector<CompressionReport> reps2 = twin.compress_if_needed(ids);
          Outputs o2(nseq, rows, kMaxTokens);
          o2.out.slot_positions = pos.data();
          o2.out.positions_stride = kMaxTokens;
          (void)paged_round(st.view, scorer, sp, cfg.model, RoundTrigger::kIfDue, rb, o2.out, ws.data(), ws.size());
          std::size_t k2 = 0;
          bool second_ok = true;
          for (int b = 0; b < nseq; ++b) {
            const SeqId q = ids[static_cast<std::size_t>(b)];
            if (k2 >= reps2.size() || reps2[k2].seq != q) {
              second_ok = second_ok && o2.status[static_cast<std::size_t>(b)] == static_cast<int>(RoundStatus::kNotDue);
              continue;
            }
            const CompressionReport& rep = reps2[k2++];
            const int nl = o2.new_lens[static_cast<std::size_t>(b)];
            second_ok = second_ok && nl == rep.length_after && same_kv(st, twin, q, nl);
            for (int r = 0; r < rows; ++r)
              for (int i = 0; i < nl; ++i)
                second_ok = second_ok && o2.kept[(static_cast<std::size_t>(b) * rows + r) * kMaxTokens + i] ==
                                             rep.kept(r)[static_cast<std::size_t>(i)];
          }
          CHECK(k2 == reps2.size());
          CHECK(second_ok);
          ++cases;
        }
      }
  CHECK(cases == 3 * 3 * 3 * 7);
  CHECK(compressed_total > 0);
  CHECK(not_due_total > 0);
}

TEST_CASE("paged round: bad views and batches are refused before anything is written") {
  std::mt19937 rng(9);
  const SelectionParams sp = make_params(PruningMode::kPerHead, kProtections[0]);
  const CacheConfig cfg = make_config(16, KvLayout::kNHD, 3);
  Cache c(cfg, make_scorer(), TopKSelector(sp));
  const SeqId q0 = c.add_sequence(), q1 = c.add_sequence();
  append_random(c, q0, 8, Phase::kPrefill, rng);
  append_random(c, q0, 40, Phase::kDecode, rng);
  append_random(c, q1, 50, Phase::kPrefill, rng);
  append_random(c, q1, 1, Phase::kDecode, rng);
  const std::vector<SeqId> ids{q0, q1};
  std::vector<std::int64_t> t0{c.logical_position(q0), c.logical_position(q1)};
  std::vector<std::int32_t> prompts{c.prompt_length(q0), c.prompt_length(q1)};
  std::vector<std::byte> ws(paged_round_workspace_size(cfg.model, kMaxTokens));
  TriAttentionScorer scorer = make_scorer();

  // Runs the round on a fresh stand-in after `spoil` changed it; expects a throw naming `what`,
  // no byte of the cache changed and no output written.
  const auto refused = [&](Engine e, auto&& spoil, const char* what) {
    Standin st(e, 16, cfg.num_blocks, cfg.max_seqs, rng);
    st.load(c, q0);
    st.load(c, q1);
    std::vector<SeqId> bids = ids;
    std::vector<std::int64_t> bt0 = t0;
    std::vector<std::int32_t> bprompts = prompts;
    RoundBatch rb{bids.data(), bt0.data(), bprompts.data(), 2, kMaxTokens};
    Outputs o(2, kHkv, kMaxTokens);
    spoil(st, rb, o.out);
    const std::vector<std::vector<T>> before = st.bufs;
    const std::vector<std::int32_t> lens_before = st.lens, table_before = st.table;
    bool threw = false;
    std::string msg;
    try {
      (void)paged_round(st.view, scorer, sp, cfg.model, RoundTrigger::kIfDue, rb, o.out, ws.data(), ws.size());
    } catch (const logic_error& err) {
      threw = true;
      msg = err.what();
    }
    CAPTURE(msg);
    CAPTURE(std::string(what));
    CHECK(threw);
    CHECK(msg.find(what) != std::string::npos);
    CHECK(same_bufs(st.bufs, before));
    CHECK(st.lens == lens_before);
    CHECK(st.table == table_before);
    CHECK(std::all_of(o.new_lens.begin(), o.new_lens.end(), [](std::int32_t x) { return x == -7; }));
    CHECK(std::all_of(o.kept.begin(), o.kept.end(), [](std::int32_t x) { return x == -7; }));
  };
  // The unspoilt round runs (so each refusal below is down to its one change).
  {
    Standin st(Engine::kVllmFlashAttn, 16, cfg.num_blocks, cfg.max_seqs, rng);
    st.load(c, q0);
    st.load(c, q1);
    Outputs o(2, kHkv, kMaxTokens);
    const RoundBatch rb{ids.data(), t0.data(), prompts.data(), 2, kMaxTokens};
    CHECK(paged_round(st.view, scorer, sp, cfg.model, RoundTrigger::kIfDue, rb, o.out, ws.data(), ws.size()) == 2);
  }
  using RB = RoundBatch;
  using RO = RoundOutputs;
  refused(Engine::kOwnNHD, [](Standin& s, RB&, RO&) { s.view.data = nullptr; }, "data and ranges are both null");
  refused(Engine::kVllmFlashAttn, [](Standin& s, RB&, RO&) { s.ranges[3] = nullptr; }, "ranges[3] (layer 1, V) is null");
  refused(Engine::kOwnNHD, [](Standin& s, RB&, RO&) { s.view.block_tables = nullptr; }, "block_tables is null");
  refused(Engine::kOwnNHD, [](Standin& s, RB&, RO&) { s.view.seq_lens = nullptr; }, "seq_lens is null");
  refused(Engine::kOwnNHD, [](Standin& s, RB&, RO&) { s.view.block.stride_token = kD; }, "strides overlap");
  refused(Engine::kOwnHND, [](Standin& s, RB&, RO&) { s.view.block.stride_head = kD; }, "strides overlap");
  refused(Engine::kTrtPool, [](Standin& s, RB&, RO&) { s.view.layer_stride = s.view.kind_stride; }, "strides overlap");
  refused(Engine::kOwnNHD, [](Standin& s, RB&, RO&) { s.view.kind_stride = 100; }, "strides overlap");
  refused(Engine::kFlashInferNHD, [](Standin& s, RB&, RO&) { s.ranges[1] = s.ranges[0] + kD; }, "overlap");
  refused(Engine::kSglang, [](Standin& s, RB&, RO&) { s.ranges[2] = s.ranges[1]; }, "overlap");
  refused(Engine::kOwnNHD, [](Standin& s, RB&, RO&) { s.view.block.stride_block = -1; }, "must be non-negative");
  refused(Engine::kVllmFlashAttn, [&](Standin& s, RB&, RO&) { s.table[static_cast<std::size_t>(q1) * s.view.max_blocks_per_seq + 2] = cfg.num_blocks; },
          "is outside [0, num_blocks");
  refused(Engine::kVllmFlashAttn, [&](Standin& s, RB&, RO&) { s.table[static_cast<std::size_t>(q1) * s.view.max_blocks_per_seq] = -1; },
          "is outside [0, num_blocks");
  refused(Engine::kVllmFlashAttn, [&](Standin& s, RB&, RO&) {
            std::int32_t* row = s.table.data() + static_cast<std::size_t>(q1) * s.view.max_blocks_per_seq;
            row[1] = row[0];
          },
          "appears twice in the sequence's row");
  refused(Engine::kVllmFlashAttn, [&](Standin& s, RB&, RO&) { s.lens[static_cast<std::size_t>(q1)] = kMaxTokens + 1; }, "is outside [0, capacity");
  refused(Engine::kVllmFlashAttn, [&](Standin& s, RB&, RO&) { s.view.num_layers = kL + 1; }, "does not match the model");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB& rb, RO&) { const_cast<SeqId*>(rb.seq_ids)[1] = rb.seq_ids[0]; },
          "appears twice in the batch");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB& rb, RO&) { const_cast<SeqId*>(rb.seq_ids)[1] = 7; }, "is not a row of the table");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB& rb, RO&) { const_cast<std::int64_t*>(rb.t0)[1] = 3; }, "smaller than its cached length");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB& rb, RO&) { const_cast<std::int32_t*>(rb.prompt_lens)[0] = 1000; }, "prompt_len = 1000");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB& rb, RO&) { rb.max_len = 20; }, "exceeds batch.max_len");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB&, RO& o) { o.max_keep = 10; }, "more than out.max_keep");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB&, RO& o) { o.kept_rows = 3; }, "out.kept_rows = 3");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB&, RO& o) { o.status = nullptr; }, "must not be null");
  // Issue 45 item 1: a shared block after a private one cannot be protected (compaction would
  // move tokens across it): refused naming the block and both sequences, whether the other
  // sequence is in the batch or not.
  const auto share_col1 = [&](Standin& s) {  // q1's column 1 names q0's block at column 1
    s.table[static_cast<std::size_t>(q1) * s.view.max_blocks_per_seq + 1] =
        s.table[static_cast<std::size_t>(q0) * s.view.max_blocks_per_seq + 1];
  };
  const std::string shared_q0 = "is shared with sequence " + std::to_string(q0) + " but follows the private block";
  const std::string shared_q1 = "is shared with sequence " + std::to_string(q1) + " but follows the private block";
  refused(Engine::kVllmFlashAttn, [&](Standin& s, RB& rb, RO&) { share_col1(s); rb.batch = 1; }, shared_q1.c_str());
  refused(Engine::kSglang, [&](Standin& s, RB& rb, RO&) {
            std::int32_t* row = s.table.data() + static_cast<std::size_t>(q0) * s.view.max_blocks_per_seq;
            row[20] = s.table[static_cast<std::size_t>(q1) * s.view.max_blocks_per_seq + 20];
            rb.seq_ids += 1;  // the batch is q1 alone
            rb.t0 += 1;
            rb.prompt_lens += 1;
            rb.batch = 1;
          },
          shared_q0.c_str());
  refused(Engine::kTrtPool, [&](Standin& s, RB&, RO&) { share_col1(s); },
          ("block_tables[" + std::to_string(q0) + "][1]").c_str());
  // Every row the round reads is checked, in the batch or not.
  refused(Engine::kVllmFlashAttn, [&](Standin& s, RB& rb, RO&) { s.lens[static_cast<std::size_t>(q1)] = kMaxTokens + 1; rb.batch = 1; },
          "is outside [0, capacity");
  refused(Engine::kVllmFlashAttn, [&](Standin& s, RB& rb, RO&) { s.table[static_cast<std::size_t>(q1) * s.view.max_blocks_per_seq] = -1; rb.batch = 1; },
          "is outside [0, num_blocks");
  // Issue 45 item 3: outputs (and the workspace) overlapping each other, the K/V or an input are
  // refused before anything is written.
  refused(Engine::kVllmFlashAttn, [](Standin& s, RB&, RO& o) { o.new_lens = s.lens.data(); }, "out.new_lens overlaps view.seq_lens");
  refused(Engine::kOwnNHD, [](Standin& s, RB&, RO& o) { o.new_lens = s.lens.data() + 1; }, "out.new_lens overlaps view.seq_lens");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB& rb, RO& o) { o.status = const_cast<std::int32_t*>(rb.prompt_lens); },
          "out.status overlaps batch.prompt_lens");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB& rb, RO& o) { o.freed_end = const_cast<std::int32_t*>(rb.seq_ids); },
          "out.freed_end overlaps batch.seq_ids");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB& rb, RO& o) { o.new_lens = reinterpret_cast<std::int32_t*>(const_cast<std::int64_t*>(rb.t0)) + 1; },
          "out.new_lens overlaps batch.t0");
  refused(Engine::kVllmFlashAttn, [](Standin& s, RB&, RO& o) { o.freed_begin = s.table.data() + 5; }, "out.freed_begin overlaps view.block_tables");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB&, RO& o) { o.freed_end = o.freed_begin; }, "out.freed_begin overlaps out.freed_end");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB&, RO& o) { o.status = o.kept + 5; }, "out.status overlaps out.kept");
  refused(Engine::kVllmFlashAttn, [](Standin&, RB&, RO& o) {
            o.slot_positions = o.kept + 1;
            o.positions_stride = kMaxTokens;
          },
          "out.kept overlaps out.slot_positions");
  refused(Engine::kVllmFlashAttn, [&](Standin&, RB&, RO& o) { o.new_lens = reinterpret_cast<std::int32_t*>(ws.data()); },
          "out.new_lens overlaps the workspace");
  refused(Engine::kVllmFlashAttn, [](Standin& s, RB&, RO& o) { o.status = reinterpret_cast<std::int32_t*>(s.ranges[2] + 3); },
          "out.status overlaps the view's K/V memory");
  refused(Engine::kTrtPool, [](Standin& s, RB&, RO& o) { o.kept = reinterpret_cast<std::int32_t*>(s.bufs[0].data()) + 40; },
          "out.kept overlaps the view's K/V memory");
  {  // a short workspace
    Standin st(Engine::kOwnNHD, 16, cfg.num_blocks, cfg.max_seqs, rng);
    st.load(c, q0);
    st.load(c, q1);
    Outputs o(2, kHkv, kMaxTokens);
    const RoundBatch rb{ids.data(), t0.data(), prompts.data(), 2, kMaxTokens};
    CHECK_THROWS_WITH_AS((void)paged_round(st.view, scorer, sp, cfg.model, RoundTrigger::kIfDue, rb, o.out, ws.data(), ws.size() - 4),
                         doctest::Contains("paged_round_workspace_size"), logic_error);
  }
}

TEST_CASE("paged round: KvCache::compress_if_needed with a NaN key in one sequence of the batch (issue 38)") {
  // Reproduces issue 38 item 2: on main the call threw after the first sequence was compacted and
  // before the third ran. Now the batch completes, the NaN sequence is reported and unchanged.
  std::mt19937 rng(21);
  const SelectionParams sp = make_params(PruningMode::kPerHead, kProtections[0]);
  const CacheConfig cfg = make_config(16, KvLayout::kNHD, 4);
  Cache c(cfg, make_scorer(), TopKSelector(sp));
  Cache alone(cfg, make_scorer(), TopKSelector(sp));  // the healthy sequences compressed on their own
  std::vector<SeqId> ids;
  for (int q = 0; q < 3; ++q) {
    const SeqId s = c.add_sequence();
    REQUIRE(alone.add_sequence() == s);
    ids.push_back(s);
    std::mt19937 r1(100u + static_cast<unsigned>(q)), r2 = r1;
    append_random(c, s, 8, Phase::kPrefill, r1);
    append_random(c, s, 30, Phase::kDecode, r1);
    append_random(alone, s, 8, Phase::kPrefill, r2);
    append_random(alone, s, 30, Phase::kDecode, r2);
  }
  // A NaN in one key of sequence 1 (slot 20, selectable).
  const SeqId bad = ids[1];
  c.view<T>().token(1, KvKind::kKey, bad, 20, 0)[3] = from_float<T>(std::nanf(""));
  std::vector<T> bad_before;
  for (int i = 0; i < c.physical_length(bad); ++i)
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kHkv; ++h) {
        const T* p = c.view<T>().token(l, KvKind::kKey, bad, i, h);
        bad_before.insert(bad_before.end(), p, p + kD);
      }
  std::vector<CompressionReport> reps;
  CHECK_NOTHROW(reps = c.compress_if_needed(ids));
  REQUIRE(reps.size() == 3);
  CHECK(reps[0].status == RoundStatus::kCompressed);
  CHECK(reps[1].status == RoundStatus::kNonFinite);
  CHECK(reps[2].status == RoundStatus::kCompressed);
  CHECK(c.physical_length(ids[0]) == 24);
  CHECK(c.physical_length(bad) == 38);
  CHECK(reps[1].length_after == 38);
  CHECK(c.physical_length(ids[2]) == 24);
  std::vector<T> bad_after;
  for (int i = 0; i < c.physical_length(bad); ++i)
    for (int l = 0; l < kL; ++l)
      for (int h = 0; h < kHkv; ++h) {
        const T* p = c.view<T>().token(l, KvKind::kKey, bad, i, h);
        bad_after.insert(bad_after.end(), p, p + kD);
      }
  CHECK(std::memcmp(bad_after.data(), bad_before.data(), bad_before.size() * sizeof(T)) == 0);
  // The healthy ones are exactly what a round without the bad sequence gives.
  const SeqId healthy[] = {ids[0], ids[2]};
  const auto want = alone.compress_if_needed(healthy);
  REQUIRE(want.size() == 2);
  CHECK(want[0].kept_positions == reps[0].kept_positions);
  CHECK(want[1].kept_positions == reps[2].kept_positions);
  // Still refused (and still usable) on the next step; appending works.
  std::mt19937 r3(3);
  append_random(c, bad, 1, Phase::kDecode, r3);
  const SeqId just_bad[] = {bad};
  CHECK(c.compress_if_needed(just_bad).front().status == RoundStatus::kNonFinite);

  // The documented way forward: NonFinitePolicy::kEvictFirst ranks the NaN token lowest.
  SelectionParams ev = sp;
  ev.nonfinite = NonFinitePolicy::kEvictFirst;
  Cache c2(cfg, make_scorer(), TopKSelector(ev));
  const SeqId s2 = c2.add_sequence();
  std::mt19937 r4(100u + 1u);
  append_random(c2, s2, 8, Phase::kPrefill, r4);
  append_random(c2, s2, 30, Phase::kDecode, r4);
  c2.view<T>().token(1, KvKind::kKey, s2, 20, 0)[3] = from_float<T>(std::nanf(""));
  const SeqId one[] = {s2};
  const auto r2 = c2.compress_if_needed(one);
  REQUIRE(r2.size() == 1);
  CHECK(r2[0].status == RoundStatus::kCompressed);
  CHECK(c2.physical_length(s2) == 24);
  const auto kept0 = r2[0].kept(0);
  CHECK(std::find(kept0.begin(), kept0.end(), 20) == kept0.end());  // the NaN token went first
}

TEST_CASE("paged round: non-finite scores in one sequence of an engine batch") {
  std::mt19937 rng(31);
  for (NonFinitePolicy pol : {NonFinitePolicy::kRefuse, NonFinitePolicy::kEvictFirst})
    for (float poison : {std::nanf(""), std::numeric_limits<float>::infinity(), 1e30f}) {
      CAPTURE(to_string(pol));
      CAPTURE(poison);
      SelectionParams sp = make_params(PruningMode::kUnion, kProtections[1]);
      sp.nonfinite = pol;
      const CacheConfig cfg = make_config(16, KvLayout::kNHD, 3);
      Cache c(cfg, make_scorer(), TopKSelector(sp));
      const SeqId q0 = c.add_sequence(), q1 = c.add_sequence();
      for (SeqId q : {q0, q1}) {
        append_random(c, q, 6, Phase::kPrefill, rng);
        append_random(c, q, 40, Phase::kDecode, rng);
      }
      // 1e30 is finite in float but not in bf16 (inf): every case poisons a key.
      for (int e = 0; e < kD; ++e) c.view<T>().token(0, KvKind::kKey, q1, 15, 1)[e] = from_float<T>(poison);
      Standin st(Engine::kSglang, 16, cfg.num_blocks, cfg.max_seqs, rng);
      st.load(c, q0);
      st.load(c, q1);
      const std::vector<std::vector<T>> before = st.bufs;
      const std::vector<SeqId> ids{q0, q1};
      const std::vector<std::int64_t> t0{c.logical_position(q0), c.logical_position(q1)};
      const std::vector<std::int32_t> prompts{6, 6};
      Outputs o(2, 1, kMaxTokens);
      std::vector<std::byte> ws(paged_round_workspace_size(cfg.model, kMaxTokens));
      TriAttentionScorer scorer = make_scorer();
      const RoundBatch rb{ids.data(), t0.data(), prompts.data(), 2, kMaxTokens};
      int n = -1;
      CHECK_NOTHROW(n = paged_round(st.view, scorer, sp, cfg.model, RoundTrigger::kIfDue, rb, o.out, ws.data(), ws.size()));
      CHECK(o.status[0] == static_cast<int>(RoundStatus::kCompressed));
      const auto reps = c.compress_if_needed(ids);  // the KvCache path agrees
      REQUIRE(reps.size() == 2);
      CHECK(reps[1].status == static_cast<RoundStatus>(o.status[1]));
      if (pol == NonFinitePolicy::kRefuse) {
        CHECK(n == 1);
        CHECK(o.status[1] == static_cast<int>(RoundStatus::kNonFinite));
        CHECK(o.new_lens[1] == 46);
        CHECK(o.freed_begin[1] == o.freed_end[1]);
        // sequence 1's memory is exactly as it was
        std::vector<std::vector<std::uint8_t>> masks;
        for (const auto& b : st.bufs) masks.emplace_back(b.size(), 0);
        mark(st, masks, q1, 46);
        bool same = true;
        for (std::size_t k = 0; k < st.bufs.size(); ++k)
          for (std::size_t i = 0; i < st.bufs[k].size(); ++i)
            if (masks[k][i] && st.bufs[k][i].bits != before[k][i].bits) same = false;
        CHECK(same);
      } else {
        CHECK(n == 2);
        CHECK(o.status[1] == static_cast<int>(RoundStatus::kCompressed));
        const std::int32_t* kept = o.kept.data() + kMaxTokens;
        CHECK(std::find(kept, kept + o.new_lens[1], 15) == kept + o.new_lens[1]);
        CHECK(reps[1].kept_positions == std::vector<std::int32_t>(kept, kept + o.new_lens[1]));
        CHECK(same_kv(st, c, q1, o.new_lens[1]));
      }
    }
}

TEST_CASE("paged round: commit_round applies a round that ran elsewhere") {
  std::mt19937 rng(41);
  const SelectionParams sp = make_params(PruningMode::kPerLayerPerHead, kProtections[2]);
  const CacheConfig cfg = make_config(16, KvLayout::kHND, 3);
  Cache c(cfg, make_scorer(), TopKSelector(sp)), twin(cfg, make_scorer(), TopKSelector(sp));
  std::vector<SeqId> ids;
  for (int q = 0; q < 2; ++q) {
    const SeqId s = c.add_sequence();
    REQUIRE(twin.add_sequence() == s);
    ids.push_back(s);
    std::mt19937 r1(7u + static_cast<unsigned>(q)), r2 = r1;
    append_random(c, s, 5, Phase::kPrefill, r1);
    append_random(c, s, 35 + 10 * q, Phase::kDecode, r1);
    append_random(twin, s, 5, Phase::kPrefill, r2);
    append_random(twin, s, 35 + 10 * q, Phase::kDecode, r2);
  }
  // The round over c's own view, as a device round would run it, then the bookkeeping commit.
  std::vector<std::int64_t> t0;
  std::vector<std::int32_t> prompts;
  for (SeqId q : ids) {
    t0.push_back(c.logical_position(q));
    prompts.push_back(c.prompt_length(q));
  }
  Outputs o(2, kL * kHkv, kMaxTokens);
  std::vector<std::byte> ws(paged_round_workspace_size(cfg.model, kMaxTokens));
  const RoundBatch rb{ids.data(), t0.data(), prompts.data(), 2, kMaxTokens};
  REQUIRE(paged_round(c.view<T>(), c.scorer(), sp, cfg.model, RoundTrigger::kIfDue, rb, o.out, ws.data(), ws.size()) == 2);
  const auto got = c.commit_round(ids, o.out);
  const auto want = twin.compress_if_needed(ids);
  REQUIRE(got.size() == 2);
  REQUIRE(want.size() == 2);
  for (int b = 0; b < 2; ++b) {
    const SeqId q = ids[static_cast<std::size_t>(b)];
    CHECK(c.physical_length(q) == twin.physical_length(q));
    CHECK(c.prompt_length(q) == twin.prompt_length(q));
    CHECK(std::equal(c.block_table(q).begin(), c.block_table(q).end(), twin.block_table(q).begin(), twin.block_table(q).end()));
    CHECK(got[static_cast<std::size_t>(b)].blocks_freed == want[static_cast<std::size_t>(b)].blocks_freed);
    CHECK(got[static_cast<std::size_t>(b)].kept_positions.size() ==
          static_cast<std::size_t>(kL * kHkv) * static_cast<std::size_t>(c.physical_length(q)));
  }
  CHECK(c.memory().blocks_used == twin.memory().blocks_used);
  // An inconsistent kept row is refused before anything changes.
  Outputs bad(1, kL * kHkv, kMaxTokens);
  bad.new_lens[0] = 3;
  bad.status[0] = 0;
  std::fill(bad.kept.begin(), bad.kept.end(), 0);  // not ascending
  const int before = c.physical_length(ids[0]);
  CHECK_THROWS_AS((void)c.commit_round(std::span<const SeqId>(ids.data(), 1), bad.out), logic_error);
  CHECK(c.physical_length(ids[0]) == before);
}

TEST_CASE("paged round: protected_prefix keeps a shared prefix in place as KvCache::compress does") {
  for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
    CAPTURE(to_string(mode));
    std::mt19937 rng(91u + static_cast<unsigned>(mode));
    SelectionParams sp = make_params(mode, kProtections[2]);  // everything competes; sinks 4, window 8
    sp.budget = 48;
    const CacheConfig cfg = make_config(16, KvLayout::kNHD, 3);
    // Two sequences share their first two blocks (32 tokens) and continue privately.
    const auto build = [&](Cache& c, std::mt19937 r) {
      const SeqId a = c.add_sequence();
      append_random(c, a, 40, Phase::kPrefill, r);
      const SeqId b = c.fork_prefix(a, 32);
      append_random(c, a, 30, Phase::kDecode, r);
      append_random(c, b, 38, Phase::kDecode, r);
      return std::vector<SeqId>{a, b};
    };
    Cache c(cfg, make_scorer(), TopKSelector(sp)), twin(cfg, make_scorer(), TopKSelector(sp));
    const std::vector<SeqId> ids = build(c, rng), tids = build(twin, rng);
    REQUIRE(ids == tids);
    std::vector<std::int64_t> t0;
    std::vector<std::int32_t> prompts, shared;
    for (SeqId q : ids) {
      t0.push_back(c.logical_position(q));
      prompts.push_back(c.prompt_length(q));
      shared.push_back(c.shared_prefix(q));
    }
    REQUIRE(shared == std::vector<std::int32_t>{32, 32});
    const auto shared_block = c.block_table(ids[0])[0];
    std::vector<T> shared_before;
    for (int l = 0; l < kL; ++l)
      for (int i = 0; i < 16; ++i)
        for (int h = 0; h < kHkv; ++h)
          shared_before.insert(shared_before.end(), c.view<T>().token(l, KvKind::kKey, ids[0], i, h),
                               c.view<T>().token(l, KvKind::kKey, ids[0], i, h) + kD);
    const int rows = kept_rows(mode, kL, kHkv);
    std::vector<std::byte> ws(paged_round_workspace_size(cfg.model, kMaxTokens));

    // Without the protected prefix (on an engine copy, nothing of c changes) the round finds the
    // two shared blocks in the tables itself and keeps them in place: the same outputs as below.
    std::vector<std::int32_t> found_kept, found_lens;
    {
      Standin st(Engine::kVllmFlashAttn, 16, cfg.num_blocks, cfg.max_seqs, rng);
      for (SeqId q : ids) st.load(c, q);
      Outputs o(2, rows, kMaxTokens);
      const RoundBatch rb{ids.data(), t0.data(), prompts.data(), 2, kMaxTokens};
      REQUIRE(paged_round(st.view, c.scorer(), sp, cfg.model, RoundTrigger::kAlways, rb, o.out, ws.data(), ws.size()) == 2);
      bool moved = false;
      for (int b = 0; b < 2; ++b)
        for (int r = 0; r < rows; ++r)
          for (int i = 0; i < 32; ++i) moved = moved || o.kept[(static_cast<std::size_t>(b) * rows + r) * kMaxTokens + i] != i;
      CHECK_FALSE(moved);
      found_kept = o.kept;
      found_lens = o.new_lens;
    }
    // With it: the batched round over the cache's own view equals KvCache::compress bit for bit.
    Outputs o(2, rows, kMaxTokens);
    const RoundBatch rb{ids.data(), t0.data(), prompts.data(), 2, kMaxTokens, shared.data()};
    REQUIRE(paged_round(c.view<T>(), c.scorer(), sp, cfg.model, RoundTrigger::kAlways, rb, o.out, ws.data(), ws.size()) == 2);
    CHECK(o.kept == found_kept);
    CHECK(o.new_lens == found_lens);
    const auto got = c.commit_round(ids, o.out);
    const std::vector<CompressionReport> want{twin.compress(ids[0]), twin.compress(ids[1])};
    REQUIRE(got.size() == 2);
    REQUIRE(want.size() == 2);
    for (int b = 0; b < 2; ++b) {
      const SeqId q = ids[static_cast<std::size_t>(b)];
      CAPTURE(b);
      CHECK(o.new_lens[static_cast<std::size_t>(b)] == 48);
      CHECK(c.physical_length(q) == twin.physical_length(q));
      const CompressionReport &g = got[static_cast<std::size_t>(b)], &w = want[static_cast<std::size_t>(b)];
      REQUIRE(g.kept_rows == kL * kHkv);  // commit_round reports every (layer, KV head) row
      bool same_pos = true;
      for (int r = 0; r < g.kept_rows; ++r) {
        const int wr = w.kept_rows == 1 ? 0 : w.kept_rows == kHkv ? r % kHkv : r;
        same_pos = same_pos && std::ranges::equal(g.kept(r), w.kept(wr));
      }
      CHECK(same_pos);
      CHECK(c.block_table(q)[0] == shared_block);
      bool same = true;
      for (int l = 0; l < kL; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int i = 0; i < c.physical_length(q); ++i)
            for (int h = 0; h < kHkv; ++h)
              same = same && std::memcmp(c.view<T>().token(l, static_cast<KvKind>(kv), q, i, h),
                                         twin.view<T>().token(l, static_cast<KvKind>(kv), q, i, h), sizeof(T) * kD) == 0;
      CHECK(same);
    }
    std::size_t at = 0;
    bool untouched = true;
    for (int l = 0; l < kL; ++l)
      for (int i = 0; i < 16; ++i)
        for (int h = 0; h < kHkv; ++h, at += kD)
          untouched = untouched && std::memcmp(c.view<T>().token(l, KvKind::kKey, ids[0], i, h), shared_before.data() + at,
                                               sizeof(T) * kD) == 0;
    CHECK(untouched);
    // A negative protected prefix is refused with its entry named.
    std::vector<std::int32_t> neg{-1, 0};
    const RoundBatch bad{ids.data(), t0.data(), prompts.data(), 2, kMaxTokens, neg.data()};
    CHECK_THROWS_WITH_AS((void)paged_round(c.view<T>(), c.scorer(), sp, cfg.model, RoundTrigger::kAlways, bad, o.out,
                                           ws.data(), ws.size()),
                         doctest::Contains("protected_prefix = -1"), logic_error);
  }
}

TEST_CASE("paged round: blocks shared between sequences are never rewritten (issue 45 item 1)") {
  // Two sequences share their first blocks (prefix caching), a third is private. Whatever the
  // batch holds (one of the sharers, both, with a protected_prefix ending inside a shared block),
  // every byte of every shared block stays as it was, in every engine layout and page size, and
  // the round still compresses the private parts. On the old code the round selected inside the
  // shared blocks and rewrote them under the other sequence.
  int rounds = 0;
  for (int bs : {1, 16, 64})
    for (Engine e : kEngines) {
      CAPTURE(engine_name(e));
      CAPTURE(bs);
      const int S = bs == 64 ? 64 : 32;  // shared tokens, whole blocks
      SelectionParams sp = make_params(PruningMode::kPerHead, kProtections[2]);  // everything competes
      sp.budget = S + 16;
      const CacheConfig cfg = make_config(bs, KvLayout::kNHD, 4);
      std::mt19937 rng(4500u + static_cast<unsigned>(bs) * 11u + static_cast<unsigned>(e));
      Cache c(cfg, make_scorer(), TopKSelector(sp));
      const SeqId a = c.add_sequence();
      append_random(c, a, S + 8, Phase::kPrefill, rng);
      const SeqId b = c.fork_prefix(a, S);
      const SeqId p = c.add_sequence();
      append_random(c, a, 20, Phase::kDecode, rng);
      append_random(c, b, 28, Phase::kDecode, rng);
      append_random(c, p, 10, Phase::kPrefill, rng);
      append_random(c, p, S + 20, Phase::kDecode, rng);
      REQUIRE(c.shared_prefix(a) == S);
      REQUIRE(c.shared_prefix(b) == S);
      struct Batch {
        std::vector<SeqId> ids;
        std::vector<std::int32_t> prefix;  // empty: none
      };
      const Batch batches[] = {{{a}, {}}, {{b, p}, {}}, {{a, b, p}, {}}, {{p, b, a}, {S - 5, 0, S - 3}}};
      for (const Batch& bt : batches) {
        CAPTURE(bt.ids.size());
        CAPTURE(bt.prefix.size());
        Standin st(e, bs, cfg.num_blocks, cfg.max_seqs, rng);
        for (SeqId q : {a, b, p}) st.load(c, q);
        // The engine's shared blocks, found from its own tables, and their bytes (engine addressing).
        const int ebs = e == Engine::kSglang ? 1 : bs;
        std::vector<int> refs(static_cast<std::size_t>(st.view.num_blocks), 0);
        for (SeqId q : {a, b, p})
          for (int j = 0; j < (st.lens[static_cast<std::size_t>(q)] + ebs - 1) / ebs; ++j)
            ++refs[static_cast<std::size_t>(st.table[static_cast<std::size_t>(q) * st.view.max_blocks_per_seq + j])];
        const auto shared_bytes = [&] {
          std::vector<T> v;
          for (int id = 0; id < st.view.num_blocks; ++id)
            if (refs[static_cast<std::size_t>(id)] > 1)
              for (int l = 0; l < kL; ++l)
                for (int kv = 0; kv < 2; ++kv)
                  for (int r = 0; r < ebs; ++r)
                    for (int h = 0; h < kHkv; ++h) {
                      const T* x = st.expected(l, kv, id, r, h);
                      v.insert(v.end(), x, x + kD);
                    }
          return v;
        };
        const std::vector<T> before = shared_bytes();
        REQUIRE(before.size() == static_cast<std::size_t>(S / ebs) * ebs * kL * 2 * kHkv * kD);
        const int n = static_cast<int>(bt.ids.size());
        std::vector<std::int64_t> t0;
        std::vector<std::int32_t> prompts, old_len;
        for (SeqId q : bt.ids) {
          t0.push_back(c.logical_position(q));
          prompts.push_back(c.prompt_length(q));
          old_len.push_back(c.physical_length(q));
        }
        const int rows = kept_rows(sp.mode, kL, kHkv);
        Outputs o(n, rows, kMaxTokens);
        TriAttentionScorer scorer = make_scorer();
        const RoundBatch rb{bt.ids.data(), t0.data(), prompts.data(), n, kMaxTokens,
                            bt.prefix.empty() ? nullptr : bt.prefix.data()};
        std::vector<std::byte> ws(paged_round_workspace_size(cfg.model, kMaxTokens));
        CHECK(paged_round(st.view, scorer, sp, cfg.model, RoundTrigger::kAlways, rb, o.out, ws.data(), ws.size()) == n);
        const std::vector<T> after = shared_bytes();
        CHECK(std::memcmp(after.data(), before.data(), before.size() * sizeof(T)) == 0);
        for (int k = 0; k < n; ++k) {
          CAPTURE(k);
          const SeqId q = bt.ids[static_cast<std::size_t>(k)];
          CHECK(o.status[static_cast<std::size_t>(k)] == static_cast<int>(RoundStatus::kCompressed));
          CHECK(o.new_lens[static_cast<std::size_t>(k)] == sp.budget);
          CHECK(o.new_lens[static_cast<std::size_t>(k)] < old_len[static_cast<std::size_t>(k)]);
          if (q == p) continue;
          bool in_place = true;  // the shared slots keep their tokens
          for (int r = 0; r < rows; ++r)
            for (int i = 0; i < S; ++i)
              in_place = in_place && o.kept[(static_cast<std::size_t>(k) * rows + r) * kMaxTokens + i] == i;
          CHECK(in_place);
        }
        ++rounds;
      }
    }
  CHECK(rounds == 3 * 7 * 4);
}

TEST_CASE("paged round: the protected prefix a round applies covers leading shared blocks whole") {
  // effective_protected_prefix: the caller's prefix, extended over the shared blocks, never past
  // the length; a prefix longer than the shared blocks (ending inside a private block) is kept.
  CHECK(effective_protected_prefix(0, 2, 16, 70) == 32);
  CHECK(effective_protected_prefix(27, 2, 16, 70) == 32);  // ends inside a shared block: rounded up
  CHECK(effective_protected_prefix(40, 2, 16, 70) == 40);  // ends inside a private block: as given
  CHECK(effective_protected_prefix(5, 0, 16, 70) == 5);
  CHECK(effective_protected_prefix(0, 3, 16, 40) == 40);   // the last shared block is partly used
  CHECK(effective_protected_prefix(0, 1 << 20, 1 << 12, 100) == 100);  // no overflow
}

TEST_CASE("admission: max_resident_tokens is the simulated peak of every schedule") {
  using RecCache = KvCache<StaticAllocator<HostBackend>, HostCompactor, RecencyScorer, TopKSelector>;
  std::mt19937 rng(2024);
  std::uniform_int_distribution<int> u(0, 1 << 20);
  int checked = 0, compressing = 0;
  for (int k = 0; k < 300; ++k) {
    SelectionParams sp;
    sp.budget = 1 + u(rng) % 30;
    sp.divide_length = 1 + u(rng) % 9;
    sp.prompt = static_cast<PromptMode>(u(rng) % 3);
    sp.mode = static_cast<PruningMode>(u(rng) % 3);
    sp.n_sink = u(rng) % 3 == 0 ? u(rng) % 12 : 0;
    sp.window = u(rng) % 3 == 0 ? u(rng) % 12 : 0;
    sp.n_sink = std::min(sp.n_sink, sp.budget);  // sinks + window must fit the budget (validate)
    sp.window = std::min(sp.window, sp.budget - sp.n_sink);
    const int P = u(rng) % 50, N = u(rng) % 120;
    const int bs = 1 + u(rng) % 8;
    CAPTURE(k);
    CAPTURE(sp.budget);
    CAPTURE(sp.divide_length);
    CAPTURE(to_string(sp.prompt));
    CAPTURE(sp.n_sink);
    CAPTURE(sp.window);
    CAPTURE(P);
    CAPTURE(N);
    CacheConfig cfg;
    cfg.model = ModelGeometry{1, 1, 1, 2};
    cfg.block_size = bs;
    cfg.num_blocks = (P + N) / bs + 2;
    cfg.max_seqs = 1;
    cfg.dtype = DType::kF32;
    RecCache c(cfg, TopKSelector(sp));
    const SeqId s = c.add_sequence();
    std::vector<float> kv(2 * static_cast<std::size_t>(P > 0 ? P : 1), 0.5f);
    REQUIRE(c.append(s, std::span<const float>(kv.data(), static_cast<std::size_t>(2 * P)),
                     std::span<const float>(kv.data(), static_cast<std::size_t>(2 * P)), P, Phase::kPrefill)
                .ok());
    int peak = P;
    std::size_t peak_blocks = c.memory().blocks_used;
    int rounds = 0;
    const float one[2] = {0.25f, 0.75f};
    const SeqId ids[] = {s};
    for (int t = 0; t < N; ++t) {
      REQUIRE(c.append(s, std::span<const float>(one, 2), std::span<const float>(one, 2), 1, Phase::kDecode).ok());
      peak = std::max(peak, c.physical_length(s));
      peak_blocks = std::max(peak_blocks, c.memory().blocks_used);
      rounds += static_cast<int>(c.compress_if_needed(ids).size());
    }
    const RequestFootprint f = request_footprint(cfg, AdmissionRequest{P, N}, sp);
    CHECK(max_resident_tokens(P, N, sp) == peak);
    CHECK(f.max_tokens == peak);
    CHECK(f.max_blocks == static_cast<int>(peak_blocks));
    CHECK(f.kv_bytes == f.max_blocks * cfg.block_bytes_all_ranges());
    compressing += rounds > 0;
    ++checked;
  }
  CHECK(checked == 300);
  CHECK(compressing > 100);
}

TEST_CASE("admission: footprint and admissible_prefix") {
  CacheConfig cfg;
  cfg.model = ModelGeometry{36, 32, 8, 128};  // Qwen3-8B-like
  cfg.block_size = 16;
  cfg.num_blocks = 4096;
  cfg.max_blocks_per_seq = 1024;
  SelectionParams sp;
  sp.budget = 2048;
  sp.divide_length = 128;
  // A long generation holds budget + divide_length tokens at most, not prompt + max_new.
  const RequestFootprint f = request_footprint(cfg, AdmissionRequest{1000, 16000}, sp);
  CHECK(f.max_tokens == 2048 + 128);
  CHECK(f.max_blocks == (2048 + 128) / 16);
  CHECK(f.uncompressed_tokens == 17000);
  CHECK(f.round_workspace_bytes == paged_round_workspace_size(cfg.model, f.max_tokens));
  // A prompt over the budget: the prompt plus one decode token (pinned in budget, no window).
  CHECK(max_resident_tokens(3000, 100, sp) == 3001);
  CHECK(max_resident_tokens(3000, 0, sp) == 3000);
  CHECK(max_resident_tokens(10, 5, sp) == 15);
  const std::vector<AdmissionRequest> reqs{{1000, 16000}, {1000, 16000}, {100, 50}, {5000, 10}};
  // 136 + 136 + 10 + 313 blocks (the last: 5001 tokens)
  CHECK(request_footprint(cfg, reqs[3], sp).max_blocks == 313);
  CHECK(admissible_prefix(cfg, reqs, sp, 136 * 2 + 10 + 313) == 4);
  CHECK(admissible_prefix(cfg, reqs, sp, 136 * 2 + 10 + 312) == 3);
  CHECK(admissible_prefix(cfg, reqs, sp, 300, 28) == 2);
  CHECK(admissible_prefix(cfg, reqs, sp, 300, 29) == 1);
  CHECK(admissible_prefix(cfg, reqs, sp, 100) == 0);
  CHECK_THROWS_AS((void)request_footprint(cfg, AdmissionRequest{20000, 1}, sp), logic_error);
  CHECK_THROWS_AS((void)max_resident_tokens(-1, 1, sp), logic_error);
}

TEST_CASE("admission: at the same KV bytes an fp8 cache holds and admits twice the tokens of bf16") {
  CacheConfig bf16;
  bf16.model = ModelGeometry{36, 32, 8, 128};  // Qwen3-8B-like
  bf16.block_size = 16;
  bf16.num_blocks = 8192;
  bf16.max_blocks_per_seq = 1024;
  CacheConfig fp8 = bf16;
  fp8.dtype = DType::kFP8E4M3;
  CHECK(fp8.token_bytes() * 2 == bf16.token_bytes());
  CHECK(fp8.token_bytes() == 2LL * 36 * 8 * 128);  // one byte an element
  const std::int64_t bytes = 4LL << 30;            // 4 GiB of KV
  const std::int64_t b16 = blocks_for_kv_bytes(bf16, bytes), b8 = blocks_for_kv_bytes(fp8, bytes);
  CHECK(b16 == bytes / (2LL * 36 * 16 * 8 * 128 * 2));
  CHECK(b8 == 2 * b16);
  SelectionParams sp;
  sp.budget = 2048;
  sp.divide_length = 128;
  const std::vector<AdmissionRequest> reqs(400, AdmissionRequest{1000, 16000});  // 136 blocks each
  const std::size_t n16 = admissible_prefix(bf16, reqs, sp, b16), n8 = admissible_prefix(fp8, reqs, sp, b8);
  CHECK(n16 == static_cast<std::size_t>(b16 / 136));
  CHECK(n8 == static_cast<std::size_t>(b8 / 136));
  CHECK(n8 >= 2 * n16);
  CHECK(request_footprint(fp8, reqs[0], sp).kv_bytes * 2 == request_footprint(bf16, reqs[0], sp).kv_bytes);
  CHECK_THROWS_AS((void)blocks_for_kv_bytes(fp8, -1), logic_error);
}

}  // TEST_SUITE
