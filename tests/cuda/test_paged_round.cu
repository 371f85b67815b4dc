// SPDX-License-Identifier: Apache-2.0
// cuda::paged_round (the batched round over any paged cache a KvCacheView describes) against
// its CPU oracle triattn::paged_round, on the memory layouts engines use:
//   vLLM FlashAttention  per layer [2, blocks, bs, H, D]      (a pointer per (layer, K|V))
//   vLLM FlashInfer      per layer [blocks, 2, bs, H, D] / HND (block stride spans K and V)
//   SGLang               per layer K and V buffers [slots, H, D], page size 1
//   TensorRT-LLM style   one pool [blocks, L, 2, H, bs, D]     (one base, layer / K|V strides)
//   KvCache's own        KvCacheView::contiguous
// Both rounds run on the same bytes (random, gaps between vectors included) and the same raw
// scores (the CPU oracle's scorer hands it the device scorer's output, which is also checked
// against ref::score_sequence), so every output must be bitwise equal: statuses, new lengths,
// freed table columns, kept logical positions and the whole compacted memory. Outputs and
// workspace are poisoned before each launch. Ragged batches with sequences below the trigger,
// a non-finite key (its sequence is left untouched, the others complete), slot positions from
// earlier rounds, and one round captured in a CUDA graph and replayed (equal to the eager one).
// fp8 caches carry per-head K and V scales (the reference scores the dequantised keys).
#include <doctest/doctest.h>

#include "cuda_test_utils.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/ref/score.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/cuda/engine/paged_round.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>
#include <triattn/engine/layouts.hpp>
#include <triattn/engine/paged_round.hpp>

using namespace triattn;

namespace {

enum class Engine { kVllmFlashAttn, kVllmFlashInfer, kVllmFlashInferHnd, kSglang, kTrtllmPool, kKvCache };

const char* engine_name(Engine e) {
  switch (e) {
    case Engine::kVllmFlashAttn: return "vllm_flash_attn";
    case Engine::kVllmFlashInfer: return "vllm_flashinfer";
    case Engine::kVllmFlashInferHnd: return "vllm_flashinfer_hnd";
    case Engine::kSglang: return "sglang";
    case Engine::kTrtllmPool: return "trtllm_pool";
    case Engine::kKvCache: return "kvcache";
  }
  return "?";
}

struct Case {
  Engine engine = Engine::kKvCache;
  int L = 3, Hq = 8, Hkv = 2, d = 128, bs = 16;
  Aggregation agg = Aggregation::kMean;
  std::vector<int> lens{600, 333, 257, 41};
  std::vector<int> prompts{40, 0, 257, 10};
  SelectionParams sp;
  RoundTrigger trigger = RoundTrigger::kAlways;
  bool positions = false;   ///< pass slot_positions (as from earlier rounds)
  int nan_seq = -1;         ///< batch entry whose one key is NaN
  bool all_rows = false;    ///< kept rows L * Hkv instead of kept_rows(mode)
  std::vector<int> shared;  ///< protected (shared) prefix per entry; empty = none (null pointer)
  /// > 0: entry 1's first share_tokens / bs columns name entry 0's blocks, and a row outside the
  /// batch names entry 2's (prefix caching; whole blocks)
  int share_tokens = 0;

  std::string name() const {
    char buf[320];
    std::snprintf(buf, sizeof buf, "%s L=%d Hq=%d Hkv=%d d=%d bs=%d %s budget=%d slack=%d mode=%s prompt=%s sink=%d "
                  "window=%d trigger=%s positions=%d nan_seq=%d all_rows=%d normalize=%d nonfinite=%s shared=%d share_tokens=%d",
                  engine_name(engine), L, Hq, Hkv, d, bs, to_string(agg), sp.budget, sp.divide_length,
                  to_string(sp.mode), to_string(sp.prompt), sp.n_sink, sp.window,
                  trigger == RoundTrigger::kIfDue ? "if_due" : "always", positions, nan_seq, all_rows,
                  sp.normalize, to_string(sp.nonfinite), !shared.empty(), share_tokens);
    return buf;
  }
};

/// The CPU oracle's scorer: the device scorer's raw scores of each sequence (downloaded).
struct GivenScores {
  const std::vector<float>* scores = nullptr;  // [batch, L, Hq, max_len]
  std::vector<int> batch_of;                   // sequence slot -> batch entry
  int rows = 0, max_len = 0;
  template <class T, class Id>
  void score(const KvCacheView<T, Id>&, int seq, int len, std::int64_t, std::span<float> out) const {
    const int b = batch_of.at(static_cast<std::size_t>(seq));
    REQUIRE(b >= 0);
    REQUIRE(out.size() == static_cast<std::size_t>(rows) * len);
    for (int r = 0; r < rows; ++r)
      std::copy_n(scores->data() + (static_cast<std::size_t>(b) * rows + r) * max_len, len,
                  out.data() + static_cast<std::size_t>(r) * len);
  }
};

/// One engine's memory: an arena with the (layer, K|V) range bases at element offsets, the same
/// bytes on the host and the device, and views over either.
template <class T>
struct Arena {
  BlockLayout block;
  bool use_ranges = false;
  std::vector<std::int64_t> base;  // [2L] element offset of range (l, kind)
  std::int64_t layer_stride = 0, kind_stride = 0;
  std::size_t elems = 0;
  std::vector<T> host;
  test::DeviceBuffer<T> dev;
  std::vector<T*> host_ranges;
  test::DeviceBuffer<T*> dev_ranges;

  Arena(Engine e, int L, int Hkv, int d, int bs, int num_blocks) {
    const std::int64_t one = static_cast<std::int64_t>(bs) * Hkv * d;  // a dense block of one range
    base.resize(static_cast<std::size_t>(2 * L));
    switch (e) {
      case Engine::kVllmFlashAttn: {  // a tensor per layer, 64 elements of padding between tensors
        const EngineLayout el = EngineLayout::vllm_flash_attn(num_blocks, bs, Hkv, d);
        block = el.block;
        use_ranges = true;
        const std::int64_t tensor = 2 * num_blocks * one + 64;
        for (int l = 0; l < L; ++l) {
          base[2 * l] = l * tensor;
          base[2 * l + 1] = l * tensor + el.kind_offset;
        }
        elems = static_cast<std::size_t>(L * tensor);
        break;
      }
      case Engine::kVllmFlashInfer:
      case Engine::kVllmFlashInferHnd: {
        const EngineLayout el = EngineLayout::vllm_flashinfer(
            bs, Hkv, d, e == Engine::kVllmFlashInfer ? KvLayout::kNHD : KvLayout::kHND);
        block = el.block;
        use_ranges = true;
        const std::int64_t tensor = num_blocks * el.block.stride_block;
        for (int l = 0; l < L; ++l) {  // layers in reverse order: bases need not ascend
          base[2 * l] = (L - 1 - l) * tensor;
          base[2 * l + 1] = (L - 1 - l) * tensor + el.kind_offset;
        }
        elems = static_cast<std::size_t>(L * tensor);
        break;
      }
      case Engine::kSglang: {  // separate K and V buffers per layer, one slot per token
        const EngineLayout el = EngineLayout::sglang(Hkv, d);
        block = el.block;
        use_ranges = true;
        const std::int64_t buf = static_cast<std::int64_t>(num_blocks) * Hkv * d + 8 * d;
        for (int r = 0; r < 2 * L; ++r) base[r] = (r % 2 ? L + r / 2 : r / 2) * buf;  // all K, then all V
        elems = static_cast<std::size_t>(2 * L * buf);
        break;
      }
      case Engine::kTrtllmPool: {
        const EngineLayout el = EngineLayout::trtllm_pool(L, bs, Hkv, d);
        block = el.block;
        layer_stride = 2 * el.kind_offset;
        kind_stride = el.kind_offset;
        for (int r = 0; r < 2 * L; ++r) base[r] = (r / 2) * layer_stride + (r % 2) * kind_stride;
        elems = static_cast<std::size_t>(num_blocks * el.block.stride_block);
        break;
      }
      case Engine::kKvCache: {
        block = BlockLayout{KvLayout::kNHD, bs, Hkv, d};
        const std::int64_t range = static_cast<std::int64_t>(num_blocks) * one;
        layer_stride = 2 * range;
        kind_stride = range;
        for (int r = 0; r < 2 * L; ++r) base[r] = r * range;
        elems = static_cast<std::size_t>(2 * L * range);
        break;
      }
    }
  }

  KvCacheView<T, int> view(T* mem, T* const* ranges, int L, int num_blocks, int max_seqs, int max_blocks,
                           const int* tables, const int* lens) const {
    KvCacheView<T, int> v = KvCacheView<T, int>::contiguous(mem, kind_stride, block, L, num_blocks, max_seqs,
                                                            max_blocks, tables, lens);
    v.layer_stride = layer_stride;
    if (use_ranges) {
      v.data = nullptr;
      v.ranges = ranges;
    }
    return v;
  }
};

template <class T>
struct Outputs {
  int batch, rows, max_keep;
  std::vector<std::int32_t> new_lens, status, fb, fe, fm, kept;
  test::DeviceBuffer<std::int32_t> d_new_lens, d_status, d_fb, d_fe, d_fm, d_kept;
  Outputs(int b, int r, int mk)
      : batch(b), rows(r), max_keep(mk), new_lens(b, -7), status(b, -7), fb(b, -7), fe(b, -7), fm(b, -7),
        kept(static_cast<std::size_t>(b) * r * mk, -7), d_new_lens(b), d_status(b), d_fb(b), d_fe(b), d_fm(b),
        d_kept(static_cast<std::size_t>(b) * r * mk) {}
  RoundOutputs host(const std::int32_t* pos, std::int64_t stride) {
    RoundOutputs o{new_lens.data(), status.data(), fb.data(), fe.data(), kept.data(), rows, max_keep, pos, stride};
    o.first_moved = fm.data();
    return o;
  }
  RoundOutputs device(const std::int32_t* pos, std::int64_t stride) const {
    RoundOutputs o{d_new_lens.get(), d_status.get(), d_fb.get(), d_fe.get(), d_kept.get(), rows, max_keep, pos, stride};
    o.first_moved = d_fm.get();
    return o;
  }
  void poison_device() {
    for (auto* b : {&d_new_lens, &d_status, &d_fb, &d_fe, &d_fm, &d_kept}) b->poison();
  }
};

/// Runs the case on the device (eagerly, then optionally from a graph) and on the CPU; compares.
template <class T>
void check_case(const Case& c, std::uint32_t seed, bool graph = false) {
  INFO("seed ", seed, " (set TRIATTN_TEST_SEED to replay): ", c.name(), " dtype ", dtype_name(dtype_of<T>));
  std::mt19937 rng(seed);
  const int batch = static_cast<int>(c.lens.size());
  const int max_seqs = batch + 2;
  std::vector<int> slots(static_cast<std::size_t>(max_seqs));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  const std::vector<int> seq_ids(slots.begin(), slots.begin() + batch);
  int need = 0, max_blocks = 1, max_len = 1;
  for (int len : c.lens) {
    need += (len + c.bs - 1) / c.bs;
    max_blocks = std::max(max_blocks, (len + c.bs - 1) / c.bs + 1);
    max_len = std::max(max_len, len);
  }
  const int num_blocks = need + 3;
  std::vector<int> ids(static_cast<std::size_t>(num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int> tables(static_cast<std::size_t>(max_seqs) * max_blocks, -1), lens(max_seqs, 0);
  int next = 0;
  const int share_cols = c.share_tokens / c.bs;
  for (int b = 0; b < batch; ++b) {
    lens[seq_ids[b]] = c.lens[b];
    for (int j = 0; j < (c.lens[b] + c.bs - 1) / c.bs; ++j)
      tables[static_cast<std::size_t>(seq_ids[b]) * max_blocks + j] =
          b == 1 && j < share_cols ? tables[static_cast<std::size_t>(seq_ids[0]) * max_blocks + j] : ids[next++];
  }
  if (share_cols > 0) {  // a sequence outside the batch holds entry 2's first blocks
    REQUIRE(batch >= 3);
    const int outside = slots[static_cast<std::size_t>(batch)];
    lens[outside] = c.share_tokens;
    for (int j = 0; j < share_cols; ++j)
      tables[static_cast<std::size_t>(outside) * max_blocks + j] = tables[static_cast<std::size_t>(seq_ids[2]) * max_blocks + j];
  }
  // Blocks more than one row names (every row up to its length).
  std::vector<int> refs(static_cast<std::size_t>(num_blocks), 0);
  for (int r = 0; r < max_seqs; ++r)
    for (int j = 0; j < (lens[r] + c.bs - 1) / c.bs; ++j) ++refs[tables[static_cast<std::size_t>(r) * max_blocks + j]];
  std::vector<std::int64_t> t0(batch);
  for (int b = 0; b < batch; ++b) t0[b] = c.lens[b] + std::uniform_int_distribution<int>(0, 200000)(rng);

  Arena<T> arena(c.engine, c.L, c.Hkv, c.d, c.bs, num_blocks);
  arena.host.resize(arena.elems);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (T& x : arena.host) x = from_float<T>(nd(rng));
  for (int r = 0; r < 2 * c.L; ++r) arena.host_ranges.push_back(arena.host.data() + arena.base[r]);
  std::vector<float> scales;  // fp8: per-head K and V scales, distinct per (layer, kind, head)
  if constexpr (is_scaled_dtype<T>) {
    std::uniform_real_distribution<float> u(0.25f, 4.0f);
    scales.resize(static_cast<std::size_t>(2 * c.L * c.Hkv));
    for (float& x : scales) x = u(rng);
  }
  const test::DeviceBuffer<float> d_scales(scales.empty() ? std::vector<float>{1.0f} : scales);
  const KvCacheView<T, int> hview0 =
      arena.view(arena.host.data(), arena.host_ranges.data(), c.L, num_blocks, max_seqs, max_blocks, tables.data(),
                 lens.data())
          .with_scales(scales.empty() ? nullptr : scales.data(), c.Hkv);
  if (c.nan_seq >= 0) {  // one key in the selectable middle of the sequence, layer 1 (or 0), head 0
    const int b = c.nan_seq, slot = c.prompts[b] + (c.lens[b] - c.prompts[b]) / 2;
    T* k = hview0.token(c.L > 1 ? 1 : 0, KvKind::kKey, seq_ids[b], slot, 0);
    k[3] = from_float<T>(std::numeric_limits<float>::quiet_NaN());
  }
  const std::vector<T> original = arena.host;
  arena.dev.reset(arena.elems);
  arena.dev.upload(arena.host);
  std::vector<T*> dev_ptrs;
  for (int r = 0; r < 2 * c.L; ++r) dev_ptrs.push_back(arena.dev.get() + arena.base[r]);
  arena.dev_ranges.reset(dev_ptrs.size());
  arena.dev_ranges.upload(dev_ptrs);

  test::DeviceBuffer<int> d_tables(tables), d_lens(lens), d_seq(seq_ids), d_prompts(c.prompts);
  test::DeviceBuffer<int> d_shared(c.shared.empty() ? std::vector<int>{0} : c.shared);
  const std::int32_t* h_shared = c.shared.empty() ? nullptr : c.shared.data();
  test::DeviceBuffer<std::int64_t> d_t0(t0);
  const KvCacheView<T, int> dview = arena.view(arena.dev.get(), arena.dev_ranges.get(), c.L, num_blocks, max_seqs,
                                               max_blocks, d_tables.get(), d_lens.get())
                                        .with_scales(scales.empty() ? nullptr : d_scales.get(), c.Hkv);

  RopeConfig rope;
  rope.theta = 1e6;
  ScoringParams scp;
  scp.aggregation = c.agg;
  cuda::TriAttentionDeviceScorer scorer(random_query_stats(rng, c.L, c.Hq, c.d, RopeStyle::kHalf), rope, scp, c.Hkv);

  // The device scorer's raw scores over this layout (deterministic: bitwise those of the round),
  // checked against ref::score_sequence on the host bytes.
  const std::size_t rows = static_cast<std::size_t>(c.L) * c.Hq;
  test::DeviceBuffer<float> d_scores(static_cast<std::size_t>(batch) * rows * max_len);
  d_scores.poison();
  TRIATTN_TEST_CUDA(cuda::score(dview, scorer.device_model(), cuda::ScoreBatch{d_seq.get(), d_t0.get(), batch, max_len},
                                d_scores.get()));
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<float> gpu_scores = d_scores.download();
  std::vector<float> key(static_cast<std::size_t>(c.d));
  for (int b = 0; b < batch; ++b) {
    if (b == c.nan_seq) continue;
    const int n = c.lens[b];
    std::vector<float> want(rows * n);
    ref::score_sequence(
        scorer.model(), t0[b],
        [&](int l, int g, int j) -> const float* {
          const T* k = hview0.token(l, KvKind::kKey, seq_ids[b], j, g);
          for (int e = 0; e < c.d; ++e) key[e] = dequantize(k[e], hview0.scale(l, KvKind::kKey, g));
          return key.data();
        },
        n, want.data());
    double e2 = 0, r2 = 0;
    for (std::size_t r = 0; r < rows; ++r)
      for (int j = 0; j < n; ++j) {
        const double g = gpu_scores[(static_cast<std::size_t>(b) * rows + r) * max_len + j], w = want[r * n + j];
        e2 += (g - w) * (g - w);
        r2 += w * w;
      }
    CHECK_MESSAGE(std::sqrt(e2 / (r2 > 0 ? r2 : 1)) <= 1e-5, "batch entry ", b, ": device scores off the CPU by ",
                  std::sqrt(e2 / (r2 > 0 ? r2 : 1)));
  }

  // Slot positions as earlier rounds would report them: ascending, gaps, per kept row.
  const int krows = c.all_rows ? c.L * c.Hkv : kept_rows(c.sp.mode, c.L, c.Hkv);
  std::vector<std::int32_t> pos;
  test::DeviceBuffer<std::int32_t> d_pos;
  if (c.positions) {
    pos.resize(static_cast<std::size_t>(batch) * krows * max_len);
    for (std::size_t r = 0; r < static_cast<std::size_t>(batch) * krows; ++r) {
      std::int32_t p = std::uniform_int_distribution<int>(0, 5)(rng);
      for (int j = 0; j < max_len; ++j) pos[r * max_len + j] = p += 1 + std::uniform_int_distribution<int>(0, 3)(rng);
    }
    d_pos.reset(pos.size());
    d_pos.upload(pos);
  }
  const std::int32_t* hpos = c.positions ? pos.data() : nullptr;
  const std::int32_t* dpos = c.positions ? d_pos.get() : nullptr;

  // Device round.
  const int max_keep = max_len;
  Outputs<T> out(batch, krows, max_keep);
  const cuda::RoundShape shape{c.L, c.Hq, c.Hkv};
  const std::size_t ws_bytes =
      cuda::paged_round_workspace_size(shape, c.sp.mode, batch, max_len, max_seqs, dview.num_blocks);
  test::DeviceBuffer<char> d_ws(ws_bytes);
  const RoundBatch dbatch{d_seq.get(), d_t0.get(), d_prompts.get(), batch, max_len,
                          c.shared.empty() ? nullptr : d_shared.get()};
  cudaStream_t stream;
  TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  out.poison_device();
  d_ws.poison();
  cuda::paged_round(dview, scorer.device_model(), c.sp, c.trigger, dbatch, out.device(dpos, max_len), d_ws.get(),
                    ws_bytes, stream);
  TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
  const std::vector<std::int32_t> g_new = out.d_new_lens.download(), g_status = out.d_status.download(),
                                  g_fb = out.d_fb.download(), g_fe = out.d_fe.download(), g_fm = out.d_fm.download(),
                                  g_kept = out.d_kept.download();
  const std::vector<T> g_mem = arena.dev.download();

  if (graph) {  // the same round captured once and replayed on the original bytes: equal outputs
    arena.dev.upload(original);
    out.poison_device();
    d_ws.poison();
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    TRIATTN_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    cuda::paged_round(dview, scorer.device_model(), c.sp, c.trigger, dbatch, out.device(dpos, max_len), d_ws.get(),
                      ws_bytes, stream);
    TRIATTN_TEST_CUDA(cudaStreamEndCapture(stream, &g));
    TRIATTN_TEST_CUDA(cudaGraphInstantiate(&exec, g, 0));
    TRIATTN_TEST_CUDA(cudaGraphLaunch(exec, stream));
    TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
    test::require_bitwise_equal(out.d_new_lens.download(), g_new, "graph new_lens");
    test::require_bitwise_equal(out.d_status.download(), g_status, "graph status");
    test::require_bitwise_equal(out.d_fb.download(), g_fb, "graph freed_begin");
    test::require_bitwise_equal(out.d_fe.download(), g_fe, "graph freed_end");
    test::require_bitwise_equal(out.d_fm.download(), g_fm, "graph first_moved");
    test::require_bitwise_equal(arena.dev.download(), g_mem, "graph compacted memory");
    std::vector<std::int32_t> gk = out.d_kept.download();
    for (int b = 0; b < batch; ++b)
      for (int r = 0; r < krows; ++r)
        for (int i = 0; i < (g_status[b] == 0 ? g_new[b] : 0); ++i) {
          const std::size_t at = (static_cast<std::size_t>(b) * krows + r) * max_keep + i;
          REQUIRE_MESSAGE(gk[at] == g_kept[at], "graph kept position (", b, ", ", r, ", ", i, ")");
        }
    TRIATTN_TEST_CUDA(cudaGraphExecDestroy(exec));
    TRIATTN_TEST_CUDA(cudaGraphDestroy(g));
  }
  {  // kept positions are optional: without them, the same lengths, first moved slots and bytes
    arena.dev.upload(original);
    out.poison_device();
    d_ws.poison();
    RoundOutputs lean = out.device(nullptr, 0);
    lean.kept = nullptr;
    lean.kept_rows = 0;
    lean.max_keep = 0;
    cuda::paged_round(dview, scorer.device_model(), c.sp, c.trigger, dbatch, lean, d_ws.get(), ws_bytes, stream);
    TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
    test::require_bitwise_equal(out.d_new_lens.download(), g_new, "new_lens without kept");
    test::require_bitwise_equal(out.d_status.download(), g_status, "status without kept");
    test::require_bitwise_equal(out.d_fm.download(), g_fm, "first_moved without kept");
    test::require_bitwise_equal(arena.dev.download(), g_mem, "compacted memory without kept");
    const std::vector<std::int32_t> untouched = out.d_kept.download();
    CHECK_MESSAGE(std::all_of(untouched.begin(), untouched.end(), [&](std::int32_t x) { return x == untouched[0]; }),
                  "kept was written although it was not asked for");
  }
  TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));

  // CPU oracle on the host bytes with the device's raw scores.
  GivenScores given;
  given.scores = &gpu_scores;
  given.batch_of.assign(static_cast<std::size_t>(max_seqs), -1);
  for (int b = 0; b < batch; ++b) given.batch_of[seq_ids[b]] = b;
  given.rows = static_cast<int>(rows);
  given.max_len = max_len;
  const ModelGeometry geom{c.L, c.Hq, c.Hkv, c.d};
  std::vector<char> hws(paged_round_workspace_size(geom, max_len) + 256);
  void* hws_p = hws.data() + (256 - reinterpret_cast<std::uintptr_t>(hws.data()) % 256) % 256;
  const RoundBatch hbatch{seq_ids.data(), t0.data(), c.prompts.data(), batch, max_len, h_shared};
  paged_round(hview0, given, c.sp, geom, c.trigger, hbatch, out.host(hpos, max_len), hws_p,
              paged_round_workspace_size(geom, max_len));

  int compressed = 0;
  for (int b = 0; b < batch; ++b) {
    INFO("batch entry ", b, " (sequence ", seq_ids[b], ", length ", c.lens[b], ", prompt ", c.prompts[b], ")");
    CHECK_EQ(g_status[b], out.status[b]);
    CHECK_EQ(g_new[b], out.new_lens[b]);
    CHECK_EQ(g_fb[b], out.fb[b]);
    CHECK_EQ(g_fe[b], out.fe[b]);
    CHECK_EQ(g_fm[b], out.fm[b]);
    if (b == c.nan_seq)
      CHECK_EQ(g_status[b], static_cast<int>(c.sp.nonfinite == NonFinitePolicy::kRefuse ? RoundStatus::kNonFinite
                                                                                        : RoundStatus::kCompressed));
    if (g_status[b] != static_cast<int>(RoundStatus::kCompressed) || g_status[b] != out.status[b]) continue;
    ++compressed;
    long long differ = 0;
    for (int r = 0; r < krows; ++r)
      for (int i = 0; i < g_new[b]; ++i) {
        const std::size_t at = (static_cast<std::size_t>(b) * krows + r) * max_keep + i;
        differ += g_kept[at] != out.kept[at];
      }
    CHECK_MESSAGE(differ == 0, differ, " kept positions differ from the CPU oracle");
    if (!c.shared.empty() && !c.positions) {  // the protected prefix stays where it was
      long long moved = 0;
      for (int r = 0; r < krows; ++r)
        for (int i = 0; i < std::min(c.shared[b], g_new[b]); ++i)
          moved += g_kept[(static_cast<std::size_t>(b) * krows + r) * max_keep + i] != i;
      CHECK_MESSAGE(moved == 0, moved, " slots of the protected prefix were not kept in place");
    }
  }
  if (c.trigger == RoundTrigger::kAlways)
    CHECK_GE(compressed, batch - (c.nan_seq >= 0 && c.sp.nonfinite == NonFinitePolicy::kRefuse ? 1 : 0));
  test::require_bitwise_equal(g_mem, arena.host, "compacted memory (device vs CPU oracle)");
  if (share_cols > 0) {  // every byte of every shared block, K and V of every layer, as it was
    long long blocks = 0, changed = 0;
    std::vector<T*> g_ranges, o_ranges;
    std::vector<T> g_copy = g_mem, o_copy = original;
    for (int r = 0; r < 2 * c.L; ++r) {
      g_ranges.push_back(g_copy.data() + arena.base[r]);
      o_ranges.push_back(o_copy.data() + arena.base[r]);
    }
    const KvCacheView<T, int> gv = arena.view(g_copy.data(), g_ranges.data(), c.L, num_blocks, max_seqs, max_blocks,
                                              tables.data(), lens.data());
    const KvCacheView<T, int> ov = arena.view(o_copy.data(), o_ranges.data(), c.L, num_blocks, max_seqs, max_blocks,
                                              tables.data(), lens.data());
    for (int r = 0; r < max_seqs; ++r)
      for (int j = 0; j < (lens[r] + c.bs - 1) / c.bs; ++j) {
        if (refs[tables[static_cast<std::size_t>(r) * max_blocks + j]] < 2) continue;
        ++blocks;
        for (int l = 0; l < c.L; ++l)
          for (int kind = 0; kind < 2; ++kind)
            for (int i = j * c.bs; i < (j + 1) * c.bs; ++i)  // whole blocks, past the length too
              for (int h = 0; h < c.Hkv; ++h)
                changed += std::memcmp(gv.token(l, static_cast<KvKind>(kind), r, i, h),
                                       ov.token(l, static_cast<KvKind>(kind), r, i, h), sizeof(T) * c.d) != 0;
      }
    CHECK_EQ(blocks, 4LL * share_cols);  // entries 0 and 1, entry 2 and the outside row
    CHECK_MESSAGE(changed == 0, changed, " head vectors of shared blocks changed");
  }
  // The round changed something (a test of a no-op would pass vacuously).
  CHECK(std::memcmp(arena.host.data(), original.data(), original.size() * sizeof(T)) != 0);
}

SelectionParams sel(int budget, PruningMode mode, PromptMode prompt, int sink, int window);

/// Inputs of a small valid round in the vLLM FlashAttention layout (3 sequences of 5 rows, one
/// row outside the batch holding a private block), which `poison` then spoils; the round must
/// write nothing to the cache, report kInvalid for every entry and set the error record.
struct Poisoned {
  static constexpr int L = 2, Hq = 4, Hkv = 2, d = 128, bs = 16, batch = 3, max_seqs = 5, max_len = 300;
  static constexpr int max_blocks = max_len / bs + 2;
  std::vector<int> seq_ids{3, 0, 2}, lens{200, 0, 100, 300, 16}, prompts{0, 0, 0}, prefix{0, 0, 0};
  std::vector<int> tables;
  std::vector<std::int64_t> t0{1300, 1200, 1100};
  int num_blocks = 0;
  Poisoned() {
    tables.assign(static_cast<std::size_t>(max_seqs) * max_blocks, -1);
    for (int r = 0; r < max_seqs; ++r)
      for (int j = 0; j < (lens[r] + bs - 1) / bs; ++j) tables[static_cast<std::size_t>(r) * max_blocks + j] = num_blocks++;
    num_blocks += 2;
  }
  int& cell(int row, int col) { return tables[static_cast<std::size_t>(row) * max_blocks + col]; }
};

/// Runs the (possibly poisoned) round on the device; returns the error record, checks the outputs.
cuda::RoundError run_poisoned(const Poisoned& in, std::uint32_t seed, bool expect_failure) {
  using T = bf16_storage;
  std::mt19937 rng(seed);
  Arena<T> arena(Engine::kVllmFlashAttn, in.L, in.Hkv, in.d, in.bs, in.num_blocks);
  arena.host.resize(arena.elems);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (T& x : arena.host) x = from_float<T>(nd(rng));
  arena.dev.reset(arena.elems);
  arena.dev.upload(arena.host);
  std::vector<T*> dev_ptrs;
  for (int r = 0; r < 2 * in.L; ++r) dev_ptrs.push_back(arena.dev.get() + arena.base[r]);
  arena.dev_ranges.reset(dev_ptrs.size());
  arena.dev_ranges.upload(dev_ptrs);
  test::DeviceBuffer<int> d_tables(in.tables), d_lens(in.lens), d_seq(in.seq_ids), d_prompts(in.prompts),
      d_prefix(in.prefix);
  test::DeviceBuffer<std::int64_t> d_t0(in.t0);
  const KvCacheView<T, int> dview = arena.view(arena.dev.get(), arena.dev_ranges.get(), in.L, in.num_blocks,
                                               in.max_seqs, in.max_blocks, d_tables.get(), d_lens.get());
  RopeConfig rope;
  cuda::TriAttentionDeviceScorer scorer(random_query_stats(rng, in.L, in.Hq, in.d, RopeStyle::kHalf), rope,
                                        ScoringParams{}, in.Hkv);
  const SelectionParams sp = sel(64, PruningMode::kPerHead, PromptMode::kPinnedInBudget, 0, 0);
  Outputs<T> out(in.batch, in.Hkv, in.max_len);
  out.poison_device();
  const cuda::RoundShape shape{in.L, in.Hq, in.Hkv};
  const std::size_t ws_bytes =
      cuda::paged_round_workspace_size(shape, sp.mode, in.batch, in.max_len, in.max_seqs, in.num_blocks);
  test::DeviceBuffer<char> d_ws(ws_bytes);
  d_ws.poison();  // the round clears its error record itself
  const RoundBatch rb{d_seq.get(), d_t0.get(), d_prompts.get(), in.batch, in.max_len, d_prefix.get()};
  cuda::paged_round(dview, scorer.device_model(), sp, RoundTrigger::kAlways, rb, out.device(nullptr, 0), d_ws.get(),
                    ws_bytes, nullptr);
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  cuda::RoundError err{};
  TRIATTN_TEST_CUDA(cudaMemcpy(&err, cuda::paged_round_error(d_ws.get()), sizeof err, cudaMemcpyDeviceToHost));
  const std::vector<std::int32_t> status = out.d_status.download(), nl = out.d_new_lens.download(),
                                  fb = out.d_fb.download(), fe = out.d_fe.download();
  const std::vector<T> mem = arena.dev.download();
  if (!expect_failure) {
    CHECK_EQ(err.code, 0);
    for (int b = 0; b < in.batch; ++b) CHECK_EQ(status[b], static_cast<int>(RoundStatus::kCompressed));
    CHECK(std::memcmp(mem.data(), arena.host.data(), mem.size() * sizeof(T)) != 0);  // it compacted
    return err;
  }
  CHECK_NE(err.code, 0);
  CHECK_THROWS_AS(cuda::check_round_error(err), logic_error);
  for (int b = 0; b < in.batch; ++b) {
    INFO("batch entry ", b);
    CHECK_EQ(status[b], static_cast<int>(RoundStatus::kInvalid));
    const int raw = in.seq_ids[b];
    CHECK_EQ(nl[b], raw >= 0 && raw < in.max_seqs ? in.lens[raw] : 0);
    CHECK_EQ(fb[b], 0);
    CHECK_EQ(fe[b], 0);
  }
  test::require_bitwise_equal(mem, arena.host, "cache memory after a refused round");
  return err;
}

SelectionParams sel(int budget, PruningMode mode, PromptMode prompt, int sink, int window) {
  SelectionParams p;
  p.budget = budget;
  p.mode = mode;
  p.prompt = prompt;
  p.n_sink = sink;
  p.window = window;
  return p;
}

constexpr Engine kEngines[] = {Engine::kVllmFlashAttn, Engine::kVllmFlashInfer, Engine::kVllmFlashInferHnd,
                               Engine::kSglang,        Engine::kTrtllmPool,     Engine::kKvCache};

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE_TEMPLATE("paged_round: every engine layout and selection mode equals the CPU oracle", T, float,
                     f16_storage, bf16_storage, fp8_e4m3_storage) {
    test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (Engine e : kEngines)
      for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
        Case c;
        c.engine = e;
        const PromptMode prompt = combo % 3 == 0   ? PromptMode::kPinnedInBudget
                                  : combo % 3 == 1 ? PromptMode::kPinnedOnTop
                                                   : PromptMode::kCompete;
        c.sp = sel(combo % 2 ? 200 : 96, mode, prompt, combo % 3 == 1 ? 4 : 0, combo % 3 == 2 ? 32 : 0);
        c.bs = e == Engine::kSglang ? 1 : (combo % 2 ? 64 : 16);
        c.positions = combo % 2 == 1;
        c.all_rows = combo % 5 == 2;
        check_case<T>(c, seed + static_cast<std::uint32_t>(combo++));
      }
  }

  TEST_CASE("paged_round: ragged batch with the trigger - sequences below it untouched") {
    test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (Engine e : kEngines) {
      Case c;
      c.engine = e;
      c.bs = e == Engine::kSglang ? 1 : 16;
      c.lens = {700, 90, 512, 130, 33};
      c.prompts = {20, 10, 0, 100, 0};
      c.sp = sel(128, PruningMode::kPerHead, combo % 2 ? PromptMode::kPinnedOnTop : PromptMode::kPinnedInBudget, 2, 8);
      c.sp.divide_length = 32;
      c.trigger = RoundTrigger::kIfDue;
      check_case<bf16_storage>(c, seed + static_cast<std::uint32_t>(combo++));
    }
  }

  TEST_CASE("paged_round: a non-finite key is refused (sequence untouched while the others complete) or evicted first") {
    test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (Engine e : {Engine::kVllmFlashAttn, Engine::kSglang, Engine::kKvCache})
      for (bool normalize : {true, false})
        for (NonFinitePolicy nf : {NonFinitePolicy::kRefuse, NonFinitePolicy::kEvictFirst}) {
        Case c;
        c.engine = e;
        c.bs = e == Engine::kSglang ? 1 : 16;
        c.sp = sel(128, combo % 2 ? PruningMode::kUnion : PruningMode::kPerLayerPerHead, PromptMode::kPinnedInBudget, 0, 0);
        c.sp.normalize = normalize;
        c.sp.nonfinite = nf;
        c.nan_seq = 1;
        check_case<bf16_storage>(c, seed + static_cast<std::uint32_t>(combo++));
      }
  }

  TEST_CASE("paged_round: a protected (shared) prefix is neither selected away nor moved") {
    test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (Engine e : {Engine::kVllmFlashAttn, Engine::kSglang, Engine::kKvCache})
      for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
        Case c;
        c.engine = e;
        c.bs = e == Engine::kSglang ? 1 : 16;
        c.lens = {600, 333, 257, 41};
        c.prompts = {0, 10, 0, 0};
        c.shared = {256, 64, 512, 16};  // the third covers its whole sequence, the last most of it
        c.sp = sel(combo % 2 ? 200 : 96, mode, combo % 2 ? PromptMode::kCompete : PromptMode::kPinnedOnTop,
                   combo % 3 == 1 ? 4 : 0, 16);
        check_case<bf16_storage>(c, seed + static_cast<std::uint32_t>(combo++));
      }
  }

  TEST_CASE("paged_round: blocks shared between sequences are never rewritten (issue 45)") {
    // Entries 0 and 1 share 128 tokens of blocks, entry 2 shares them with a row outside the
    // batch; half the cases also pass a protected prefix ending inside a shared block. Device
    // round = CPU oracle bitwise, and no byte of a shared block changes.
    test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (Engine e : kEngines)
      for (int bs : {1, 16, 64}) {
        if (e == Engine::kSglang && bs != 1) continue;
        Case c;
        c.engine = e;
        c.bs = bs;
        c.lens = {600, 333, 257, 41};
        c.prompts = {0, 10, 0, 0};
        c.share_tokens = 128;
        if (combo % 2) c.shared = {100, 0, 37, 0};
        c.sp = sel(200, combo % 3 == 0 ? PruningMode::kUnion : PruningMode::kPerHead, PromptMode::kCompete, 4, 16);
        check_case<bf16_storage>(c, seed + static_cast<std::uint32_t>(combo++));
      }
  }

  TEST_CASE("paged_round: poisoned ids and lengths and block ids are refused on the device (issue 45)") {
    // On the old code these reads went unchecked (an illegal address, or another sequence's
    // memory rewritten). Now nothing is written, every status is kInvalid, and the error record
    // names the input. A clean round on the same workspace afterwards completes.
    test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    using Code = cuda::RoundErrorCode;
    struct Spoil {
      const char* name;
      Code code;
      int seq, column;  // expected record fields (-2: not checked)
      void (*apply)(Poisoned&);
    };
    const Spoil spoils[] = {
        {"seq id past the rows", Code::kSeqId, 7, -1, [](Poisoned& p) { p.seq_ids[1] = 7; }},
        {"negative seq id", Code::kSeqId, -1, -1, [](Poisoned& p) { p.seq_ids[1] = -1; }},
        {"seq id twice", Code::kDuplicateSeq, 3, -1, [](Poisoned& p) { p.seq_ids[2] = 3; }},
        {"length past capacity", Code::kLength, 0, -1, [](Poisoned& p) { p.lens[0] = Poisoned::max_blocks * Poisoned::bs + 1; }},
        {"negative length", Code::kLength, 2, -1, [](Poisoned& p) { p.lens[2] = -5; }},
        {"bad length outside the batch", Code::kLength, 1, -1, [](Poisoned& p) { p.lens[1] = 1 << 30; }},
        {"block id past num_blocks", Code::kBlockId, 3, 4, [](Poisoned& p) { p.cell(3, 4) = p.num_blocks; }},
        {"block id -1 inside the length", Code::kBlockId, 2, 6, [](Poisoned& p) { p.cell(2, 6) = -1; }},
        {"bad block id outside the batch", Code::kBlockId, 4, 0, [](Poisoned& p) { p.cell(4, 0) = 1 << 30; }},
        {"length over max_len", Code::kMaxLen, 3, -1, [](Poisoned& p) { p.lens[3] = 301; }},
        {"prompt longer than the sequence", Code::kPromptLen, 0, -1, [](Poisoned& p) { p.prompts[1] = 500; }},
        {"t0 below the length", Code::kT0, 0, -1, [](Poisoned& p) { p.t0[1] = 3; }},
        {"negative protected prefix", Code::kProtectedPrefix, 2, -1, [](Poisoned& p) { p.prefix[2] = -1; }},
        {"shared block after a private one, outside row", Code::kSharedBlock, 3, 5,
         [](Poisoned& p) { p.cell(4, 0) = p.cell(3, 5); }},
        {"block twice in one row after a private one", Code::kSharedBlock, 2, 5,
         [](Poisoned& p) { p.cell(2, 5) = p.cell(2, 1); }},
    };
    int n = 0;
    for (const Spoil& sp : spoils) {
      INFO(sp.name);
      Poisoned in;
      sp.apply(in);
      const cuda::RoundError e = run_poisoned(in, seed + static_cast<std::uint32_t>(n++), true);
      CHECK_EQ(e.code, static_cast<int>(sp.code));
      CHECK_EQ(e.seq, sp.seq);
      CHECK_EQ(e.column, sp.column);
      if (sp.code == Code::kSharedBlock)
        CHECK_EQ(e.other, sp.seq == 3 ? 4 : 2);  // the outside row; the row itself for a repeat
    }
    // Two batch sequences sharing a block after their private ones: either is named, with the other.
    Poisoned both;
    both.cell(0, 2) = both.cell(3, 2);
    const cuda::RoundError e = run_poisoned(both, seed + 100u, true);
    CHECK_EQ(e.code, static_cast<int>(Code::kSharedBlock));
    CHECK_EQ(e.column, 2);
    CHECK(((e.seq == 3 && e.other == 0) || (e.seq == 0 && e.other == 3)));
    CHECK_EQ(e.value, both.cell(3, 2));
    // The clean inputs complete (the record of the refused rounds does not stick).
    (void)run_poisoned(Poisoned{}, seed + 200u, false);
  }

  TEST_CASE("paged_round: Qwen3-8B-like heads with max aggregation and head_dim 64") {
    test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (Engine e : {Engine::kVllmFlashAttn, Engine::kSglang, Engine::kTrtllmPool}) {
      Case c;
      c.engine = e;
      c.L = 2;
      c.Hq = 32;
      c.Hkv = 8;
      c.lens = {700, 512, 1000};
      c.prompts = {100, 0, 0};
      c.bs = e == Engine::kSglang ? 1 : 16;
      c.sp = sel(512, PruningMode::kPerHead, PromptMode::kPinnedInBudget, 0, 64);
      c.agg = combo % 2 ? Aggregation::kMax : Aggregation::kMean;
      c.d = combo == 2 ? 64 : 128;
      check_case<bf16_storage>(c, seed + static_cast<std::uint32_t>(combo++));
    }
  }

  TEST_CASE("paged_round: a round captured in a CUDA graph and replayed equals the eager round") {
    test::require_device();
    const std::uint32_t seed = test::fresh_seed32();
    int combo = 0;
    for (Engine e : {Engine::kVllmFlashAttn, Engine::kSglang}) {
      Case c;
      c.engine = e;
      c.bs = e == Engine::kSglang ? 1 : 16;
      c.sp = sel(200, PruningMode::kPerHead, PromptMode::kPinnedInBudget, 4, 16);
      c.positions = true;
      check_case<bf16_storage>(c, seed + static_cast<std::uint32_t>(combo++), /*graph=*/true);
    }
  }
}

TEST_CASE("paged_round: bad arguments are refused before anything is launched (no device needed)") {
  alignas(256) static bf16_storage mem[4 * 2 * 16 * 2 * 64];  // 2 layers x K|V x 2 blocks
  static const int table[4] = {0, 1, -1, -1}, lens[2] = {20, 0};
  static const std::int32_t ids[1] = {0}, prompts[1] = {0};
  static const std::int64_t t0s[1] = {20};
  static std::int32_t o[4][1];
  const BlockLayout bl{KvLayout::kNHD, 16, 2, 64};
  auto v = KvCacheView<bf16_storage, int>::contiguous(mem, 2 * bl.block_elems(), bl, 2, 2, 2, 2, table, lens);
  cuda::ScoreModelView m;
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  SelectionParams sp;
  sp.budget = 8;
  const RoundBatch rb{ids, t0s, prompts, 1, 20};
  const RoundOutputs out{o[0], o[1], o[2], o[3]};
  alignas(256) static char ws[256];
  const auto run = [&](const KvCacheView<bf16_storage, int>& view, const cuda::ScoreModelView& model,
                       const RoundBatch& b, const RoundOutputs& ro, void* w, std::size_t bytes) {
    cuda::paged_round(view, model, sp, RoundTrigger::kAlways, b, ro, w, bytes, nullptr);
  };
  // geometry mismatch
  cuda::ScoreModelView m2 = m;
  m2.num_kv_heads = 4;
  CHECK_THROWS_WITH_AS(run(v, m2, rb, out, ws, sizeof ws), doctest::Contains("model"), logic_error);
  // misaligned token stride (16-byte loads)
  auto bad = v;
  bad.block.stride_token += 1;
  CHECK_THROWS_AS(run(bad, m, rb, out, ws, sizeof ws), logic_error);
  // null outputs
  CHECK_THROWS_WITH_AS(run(v, m, rb, RoundOutputs{}, ws, sizeof ws), doctest::Contains("out"), logic_error);
  // short workspace
  CHECK_THROWS_WITH_AS(run(v, m, rb, out, ws, sizeof ws), doctest::Contains("workspace_bytes"), logic_error);
  // kept rows that fit no mode
  RoundOutputs k = out;
  k.kept = o[0];
  k.kept_rows = 3;
  k.max_keep = 1;
  CHECK_THROWS_WITH_AS(run(v, m, rb, k, ws, sizeof ws), doctest::Contains("kept_rows"), logic_error);
  // outputs over an input, over each other or over the workspace (issue 45 item 3)
  const std::size_t need = cuda::paged_round_workspace_size(cuda::RoundShape{2, 4, 2}, sp.mode, 1, 20, 2, 2);
  std::vector<char> big(need + 256);
  void* wsb = big.data() + (256 - reinterpret_cast<std::uintptr_t>(big.data()) % 256) % 256;
  RoundOutputs a = out;
  a.new_lens = const_cast<int*>(lens);
  CHECK_THROWS_WITH_AS(run(v, m, rb, a, wsb, need), doctest::Contains("out.new_lens overlaps view.seq_lens"), logic_error);
  a = out;
  a.status = const_cast<std::int32_t*>(prompts);
  CHECK_THROWS_WITH_AS(run(v, m, rb, a, wsb, need), doctest::Contains("out.status overlaps batch.prompt_lens"), logic_error);
  a = out;
  a.freed_end = a.freed_begin;
  CHECK_THROWS_WITH_AS(run(v, m, rb, a, wsb, need), doctest::Contains("out.freed_begin overlaps out.freed_end"), logic_error);
  a = out;
  a.freed_begin = static_cast<std::int32_t*>(wsb) + 3;
  CHECK_THROWS_WITH_AS(run(v, m, rb, a, wsb, need), doctest::Contains("out.freed_begin overlaps the workspace"), logic_error);
  a = out;
  a.status = reinterpret_cast<std::int32_t*>(mem + 100);
  CHECK_THROWS_WITH_AS(run(v, m, rb, a, wsb, need), doctest::Contains("out.status overlaps the view's K/V memory"), logic_error);
  // a workspace sized without the view's blocks, when they outnumber the keep plan's entries
  static bf16_storage* const fake_ranges[4] = {mem, mem, mem, mem};  // a device array in a real call: never read here
  auto many = v;
  many.data = nullptr;
  many.ranges = fake_ranges;
  many.num_blocks = 1 << 20;
  CHECK_THROWS_WITH_AS(run(many, m, rb, out, wsb, need), doctest::Contains("view.num_blocks"), logic_error);
  // an empty batch launches nothing and succeeds
  CHECK_NOTHROW(run(v, m, RoundBatch{nullptr, nullptr, nullptr, 0, 0}, RoundOutputs{}, nullptr, 0));
}
