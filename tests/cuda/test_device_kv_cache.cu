// SPDX-License-Identifier: Apache-2.0
// End to end through the KvCache API on the GPU:
//  * KvCache<StaticAllocator<cuda::DeviceBackend>, cuda::DeviceCompactor> (host tables in the
//    view) against a host KvCache doing the same operations: prefill, decode, compaction with
//    adversarial plans, release and reuse of blocks. Tables, lengths and the whole memory pool
//    must match bitwise.
//  * cuda::DeviceKvCache<> (published device tables): append_tokens, compaction through device
//    tables, decode attention on cache.view() against ref::attention on the host twin.
//  * cuda::DeviceRounds over sequences that share prefix blocks (fork_prefix): the shared prefix
//    stays in place and untouched, the private parts are compacted as the host cache compacts
//    them with the same plans (issue 36).
// Plus DeviceBackend / DeviceTables basics.
#include "cuda_test_utils.cuh"

#include <limits>
#include <map>

#include <triattn/core/keep_counts.hpp>
#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/ref/attention.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/cuda/algorithms/append.cuh>
#include <triattn/cuda/algorithms/decode_attention.cuh>
#include <triattn/cuda/backend/device_backend.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/tuning/select.cuh>
#include <triattn/cuda/device_tables.cuh>
#include <triattn/cuda/policy/device_compactor.cuh>
#include <triattn/cuda/policy/triattention_device_scorer.cuh>

namespace {

using namespace triattn;
using test::DeviceBuffer;

static_assert(BlockAllocator<StaticAllocator<cuda::DeviceBackend>>);
static_assert(BlockAllocator<cuda::DeviceAllocator>);
static_assert(std::is_nothrow_move_constructible_v<cuda::DeviceBackend>);
static_assert(std::is_nothrow_move_constructible_v<cuda::DeviceCompactor>);
static_assert(std::is_nothrow_move_constructible_v<cuda::DeviceTables>);
// DeviceRounds (and KvCache::compress's device round) take any cache these concepts accept.
static_assert(cuda::DeviceScorer<cuda::TriAttentionDeviceScorer>);
static_assert(!cuda::DeviceScorer<NoScorer>);
static_assert(cuda::DeviceRoundCache<cuda::DeviceKvCache<cuda::TriAttentionDeviceScorer, TopKSelector>>);
static_assert(!cuda::DeviceRoundCache<cuda::DeviceKvCache<>>);
static_assert(!cuda::DeviceRoundCache<KvCache<StaticAllocator<cuda::DeviceBackend>, cuda::DeviceCompactor,
                                              cuda::TriAttentionDeviceScorer, TopKSelector>>);  // no device tables

/// Spins until *flag is set (holds a stream back until another stream sets the flag).
__global__ void spin_until_set(const volatile int* flag) {
  while (*flag == 0) __nanosleep(256);
}

using HostCache = KvCache<>;
using DevCache = KvCache<StaticAllocator<cuda::DeviceBackend>, cuda::DeviceCompactor>;

/// fp8 configs: per-head K and V scales, distinct per (layer, kind, head); other dtypes: none.
void set_test_scales(CacheConfig& cfg) {
  cfg.kv_scales.clear();
  if (cfg.dtype != DType::kFP8E4M3) return;
  cfg.kv_scales.resize(static_cast<std::size_t>(cfg.model.num_layers) * 2 * cfg.model.num_kv_heads);
  for (std::size_t i = 0; i < cfg.kv_scales.size(); ++i) cfg.kv_scales[i] = 0.5f + 0.125f * static_cast<float>(i * 5 % 13);
}

CacheConfig make_config(DType dtype, KvLayout layout) {
  CacheConfig cfg;
  cfg.model = ModelGeometry{3, 8, 2, 128};
  cfg.block_size = 7;  // not a power of two
  cfg.num_blocks = 60;
  cfg.max_seqs = 4;
  cfg.max_blocks_per_seq = 30;
  cfg.layout = layout;
  cfg.dtype = dtype;
  set_test_scales(cfg);
  return cfg;
}

/// K or V of n tokens for all layers: [num_layers, n, num_kv_heads, head_dim].
template <class T>
std::vector<T> tokens(std::mt19937_64& rng, const CacheConfig& cfg, int n) {
  return test::random_values<T>(rng, static_cast<std::size_t>(cfg.model.num_layers) * n * cfg.model.num_kv_heads *
                                         cfg.model.head_dim);
}

/// Appends n tokens to both caches: host through KvCache::append, device through extend + a
/// slot mapping built from the device cache's (host) block table + cuda::append::run_slots.
template <class T>
void append_both(std::mt19937_64& rng, HostCache& host, DevCache& dev, SeqId seq, int n, Phase phase) {
  const auto k = tokens<T>(rng, host.config(), n);
  const auto v = tokens<T>(rng, host.config(), n);
  const AppendResult hr = host.append<T>(seq, k, v, n, phase);
  const AppendResult dr = dev.extend(seq, n, phase);
  REQUIRE(hr.ok());
  REQUIRE(dr.ok());
  REQUIRE(hr.first_slot == dr.first_slot);
  std::vector<std::int64_t> slots(static_cast<std::size_t>(n));
  REQUIRE(cuda::append::host_slot_mapping(dev.block_table(seq), dev.config().block_size, dr.first_slot, n, slots.data()));
  DeviceBuffer<T> dk(k), dv(v);
  DeviceBuffer<std::int64_t> ds(slots);
  TRIATTN_TEST_CUDA(cuda::append::run_slots(dev.view<T>(), 0, dev.config().model.num_layers, dk.get(), dv.get(),
                                            ds.get(), n, dev.compactor().stream()));
  TRIATTN_TEST_CUDA(cudaStreamSynchronize(dev.compactor().stream()));
}

/// Tables, lengths and the whole pool must match.
template <class T, class H, class D>
void require_same(const H& host, D& dev) {
  REQUIRE(std::equal(host.host_block_tables().begin(), host.host_block_tables().end(),
                     dev.host_block_tables().begin(), dev.host_block_tables().end()));
  REQUIRE(std::equal(host.host_lengths().begin(), host.host_lengths().end(), dev.host_lengths().begin(),
                     dev.host_lengths().end()));
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  const std::size_t bytes = dev.allocator().bytes_resident();
  REQUIRE(bytes == host.allocator().bytes_resident());
  std::vector<T> got(bytes / sizeof(T));
  TRIATTN_TEST_CUDA(cudaMemcpy(got.data(), dev.allocator().data(), bytes, cudaMemcpyDeviceToHost));
  const T* hp = static_cast<const T*>(host.allocator().data());
  test::require_bitwise_equal(got, std::vector<T>(hp, hp + got.size()), "device pool vs host pool");
}

KeepPlan every_other(const ModelGeometry& g, int len) {
  KeepPlan p(g.num_layers, g.num_kv_heads, (len + 1) / 2);
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h)
      for (int i = 0; i < p.keep; ++i) p.row(l, h)[i] = 2 * i;
  return p;
}
KeepPlan all_but_first(const ModelGeometry& g, int len) {
  KeepPlan p(g.num_layers, g.num_kv_heads, len - 1);
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h)
      for (int i = 0; i < p.keep; ++i) p.row(l, h)[i] = i + 1;
  return p;
}
KeepPlan random_plan(std::mt19937_64& rng, const ModelGeometry& g, int len, int keep) {
  KeepPlan p(g.num_layers, g.num_kv_heads, keep);
  std::vector<std::int32_t> all(static_cast<std::size_t>(len));
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h) {
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      std::sort(all.begin(), all.begin() + keep);
      std::copy_n(all.begin(), keep, p.row(l, h));
    }
  return p;
}

}  // namespace

TEST_CASE("device kv cache: policy types compose (no device needed)") {
  cuda::DeviceCompactor c;  // no CUDA call until the first apply
  CHECK(c.stream() == nullptr);
  cuda::DeviceCompactor moved(std::move(c));
  cuda::DeviceBackend empty;
  CHECK(empty.data() == nullptr);
  CHECK(DevCache::memory_space == MemorySpace::kDevice);
  CHECK(cuda::DeviceKvCache<>::memory_space == MemorySpace::kDevice);
}

TEST_CASE("tuning: sm_90's policies are selected and another architecture is refused by name") {
  static_assert(std::is_same_v<cuda::tuning::Selected::Score, cuda::tuning::sm90::Score>);
  static_assert(std::is_same_v<cuda::tuning::Selected::DecodeAttention, cuda::tuning::sm90::DecodeAttention>);
  CHECK_NOTHROW(cuda::tuning::require_arch(0, 9, 0));
  CHECK_THROWS_WITH_AS(cuda::tuning::require_arch(1, 8, 0), doctest::Contains("device 1 has compute capability 8.0"),
                       unsupported);
  CHECK_THROWS_WITH_AS(cuda::tuning::require_arch(0, 10, 0), doctest::Contains("compute capability 10.0"), unsupported);
}

TEST_CASE("device dtype dispatch: fp8 reaches the kernels and paths without scales refuse it by name (no device needed)") {
  CHECK(cuda::dispatch_dtype(DType::kFP8E4M3, [](auto t) { return sizeof(cuda::device_type_t<typename decltype(t)::type>); }) == 1);
  CHECK(cuda::dispatch_dtype(DType::kBF16, [](auto t) { return sizeof(cuda::device_type_t<typename decltype(t)::type>); }) == 2);
  bool called = false;
  CHECK_THROWS_WITH_AS(
      cuda::dispatch_dtype(unscaled_storage_types{}, DType::kFP8E4M3, "the Python CUDA round", [&](auto) { called = true; }),
      "triattn: fp8_e4m3 KV is not supported by the Python CUDA round on the GPU yet", unsupported);
  CHECK_FALSE(called);
}

TEST_SUITE("gpu") {
  TEST_CASE("tuning: the device's architecture has the build's policies (DeviceRounds' check passes)") {
    CHECK_NOTHROW(cuda::tuning::require_device_arch());
  }

  TEST_CASE("device backend: zeroed or poisoned allocation then move and free") {
    test::require_device();
    cuda::DeviceBackend a(4096);
    std::vector<unsigned char> h(4096, 1);
    TRIATTN_TEST_CUDA(cudaMemcpy(h.data(), a.data(), 4096, cudaMemcpyDeviceToHost));
    CHECK(std::all_of(h.begin(), h.end(), [](unsigned char x) { return x == 0; }));
    cuda::DeviceBackend b(1000, cuda::DeviceBackend::Fill::kPoison);
    std::vector<unsigned char> g(1000, 0);
    TRIATTN_TEST_CUDA(cudaMemcpy(g.data(), b.data(), 1000, cudaMemcpyDeviceToHost));
    CHECK(std::all_of(g.begin(), g.end(), [](unsigned char x) { return x == 0xFF; }));
    void* p = a.data();
    cuda::DeviceBackend c(std::move(a));
    CHECK(c.data() == p);
    CHECK(a.data() == nullptr);
    c = std::move(b);
    CHECK(c.bytes() == 1000);
    CHECK_THROWS_AS(cuda::DeviceBackend(std::size_t{1} << 62), cuda_error);  // out of memory -> cuda_error
  }

  TEST_CASE("device tables: publish mirrors the host tables including cleared columns") {
    test::require_device();
    cuda::DeviceTables t(3, 10);
    std::vector<std::int32_t> tables(30, -1), lens(3, 0);
    auto check = [&] {
      TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
      std::vector<std::int32_t> dt(30), dl(3);
      TRIATTN_TEST_CUDA(cudaMemcpy(dt.data(), t.tables(), 30 * 4, cudaMemcpyDeviceToHost));
      TRIATTN_TEST_CUDA(cudaMemcpy(dl.data(), t.lengths(), 3 * 4, cudaMemcpyDeviceToHost));
      CHECK(dt == tables);
      CHECK(dl == lens);
    };
    check();  // fresh: -1 tables, zero lengths
    for (int j = 0; j < 7; ++j) tables[10 + j] = 20 + j;
    lens[1] = 4 * 7 - 2;  // 7 blocks of 4
    t.publish(tables, lens, 4, nullptr);
    check();
    for (int j = 2; j < 7; ++j) tables[10 + j] = -1;  // shrink to 2 blocks
    lens[1] = 5;
    tables[0] = 3;
    lens[0] = 1;
    t.publish(tables, lens, 4, nullptr);
    check();
    CHECK_THROWS_AS(t.publish(std::span<const std::int32_t>(tables).first(29), lens, 4, nullptr), logic_error);
  }

  TEST_CASE_TEMPLATE("device kv cache: StaticAllocator<DeviceBackend> with DeviceCompactor matches the host cache",
                     T, float, bf16_storage, fp8_e4m3_storage) {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed, " (set TRIATTN_TEST_SEED to replay)");
    for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
      CAPTURE(seed);
      CAPTURE(layout_name(layout));
      std::mt19937_64 rng(seed ^ test::dtype_salt<T>() ^ static_cast<std::uint64_t>(layout));
      const CacheConfig cfg = make_config(dtype_of<T>, layout);
      HostCache host(cfg);
      cudaStream_t stream = nullptr;
      TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      {
        DevCache dev(cfg, cuda::DeviceCompactor(stream));
        const SeqId a = host.add_sequence(), b = host.add_sequence();
        REQUIRE(dev.add_sequence() == a);
        REQUIRE(dev.add_sequence() == b);
        append_both<T>(rng, host, dev, a, 40, Phase::kPrefill);
        append_both<T>(rng, host, dev, b, 25, Phase::kPrefill);
        for (int step = 0; step < 9; ++step) {
          append_both<T>(rng, host, dev, a, 1, Phase::kDecode);
          append_both<T>(rng, host, dev, b, 1, Phase::kDecode);
        }
        require_same<T>(host, dev);

        const KeepPlan pa = every_other(cfg.model, host.physical_length(a));
        const KeepPlan pb = random_plan(rng, cfg.model, host.physical_length(b), 20);
        host.apply_keep_plan(a, pa);
        dev.apply_keep_plan(a, pa);
        host.apply_keep_plan(b, pb);
        dev.apply_keep_plan(b, pb);
        dev.compactor().synchronize();
        CHECK(dev.memory().blocks_free == host.memory().blocks_free);
        require_same<T>(host, dev);

        // Freed tail blocks get reused by a new sequence; then compact again with the
        // adversarial "all but first" plan.
        for (int step = 0; step < 5; ++step) append_both<T>(rng, host, dev, a, 1, Phase::kDecode);
        host.release(b);
        dev.release(b);
        const SeqId c = host.add_sequence();
        REQUIRE(dev.add_sequence() == c);
        append_both<T>(rng, host, dev, c, 33, Phase::kPrefill);
        const KeepPlan pc = all_but_first(cfg.model, host.physical_length(c));
        const KeepPlan pa2 = random_plan(rng, cfg.model, host.physical_length(a), host.physical_length(a) - 3);
        host.apply_keep_plan(c, pc);
        dev.apply_keep_plan(c, pc);
        host.apply_keep_plan(a, pa2);
        dev.apply_keep_plan(a, pa2);
        append_both<T>(rng, host, dev, c, 4, Phase::kDecode);
        require_same<T>(host, dev);
      }
      TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
    }
  }

  TEST_CASE_TEMPLATE("device kv cache: DeviceKvCache with published tables - append_tokens then compaction then attention", T,
                     float, bf16_storage, fp8_e4m3_storage) {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed);
    std::mt19937_64 rng(seed ^ test::dtype_salt<T>() ^ 99);
    const CacheConfig cfg = make_config(dtype_of<T>, KvLayout::kNHD);
    HostCache host(cfg);
    cuda::DeviceKvCache<> dev(cfg);
    const cudaStream_t stream = dev.compactor().stream();
    // fp8: float K and V, quantised by the device append with the device copy of the scales and
    // by the host's append_values; the pools must agree bitwise.
    using In = std::conditional_t<is_scaled_dtype<T>, float, T>;
    auto add = [&](SeqId s, int n, Phase phase) {
      auto k = tokens<In>(rng, cfg, n);
      auto v = tokens<In>(rng, cfg, n);
      if constexpr (is_scaled_dtype<T>) {
        for (std::size_t i = 0; i < k.size(); i += 5) k[i] *= 600.0f, v[i] *= 600.0f;  // saturates some
        REQUIRE(host.append_values(s, k, v, n, phase).ok());
      } else {
        REQUIRE(host.append<T>(s, k, v, n, phase).ok());
      }
      DeviceBuffer<In> dk(k), dv(v);
      REQUIRE(cuda::append_tokens(dev, s, dk.get(), dv.get(), n, stream, phase).ok());
      TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
    };
    const SeqId a = host.add_sequence(), b = host.add_sequence(), c = host.add_sequence();
    REQUIRE(dev.add_sequence() == a);
    REQUIRE(dev.add_sequence() == b);
    REQUIRE(dev.add_sequence() == c);
    add(a, 50, Phase::kPrefill);
    add(b, 13, Phase::kPrefill);
    add(c, 120, Phase::kPrefill);
    for (int i = 0; i < 6; ++i) add(a, 1, Phase::kDecode), add(c, 1, Phase::kDecode);
    const KeepPlan pc = random_plan(rng, cfg.model, host.physical_length(c), 70);
    host.apply_keep_plan(c, pc);
    dev.apply_keep_plan(c, pc);  // compactor reads the published (device) tables
    const KeepPlan pa = all_but_first(cfg.model, host.physical_length(a));
    host.apply_keep_plan(a, pa);
    dev.apply_keep_plan(a, pa);
    cuda::publish(dev, stream);
    require_same<T>(host, dev);
    {
      std::vector<std::int32_t> dt(host.host_block_tables().size());
      TRIATTN_TEST_CUDA(cudaMemcpy(dt.data(), dev.allocator().published_tables(), dt.size() * 4, cudaMemcpyDeviceToHost));
      CHECK(std::equal(dt.begin(), dt.end(), host.host_block_tables().begin()));
    }

    // Decode attention over the device view vs the reference over the host cache.
    const int hq = cfg.model.num_q_heads, d = cfg.model.head_dim;
    const std::vector<int> seqs{c, a, b};
    const auto q = test::random_values<cuda::query_type_t<T>>(rng, seqs.size() * hq * d, 2.0f);
    for (int layer = 0; layer < cfg.model.num_layers; ++layer) {
      CAPTURE(layer);
      std::vector<float> want(q.size());
      ref::attention(host.view<T>(), layer, std::span<const int>(seqs), q.data(), hq, want.data(),
                     ref::default_sm_scale(d));
      int resident = 0;
      TRIATTN_TEST_CUDA(cuda::decode_attention::resident_ctas<T>(d, &resident));
      const auto plan = cuda::decode_attention::make_plan(dtype_of<T>, 3, cfg.model.num_kv_heads,
                                                          cfg.model.group_size(), 200, resident);
      DeviceBuffer<cuda::query_type_t<T>> dq(q);
      DeviceBuffer<std::int32_t> dids(std::vector<std::int32_t>(seqs.begin(), seqs.end()));
      DeviceBuffer<float> out(q.size());
      out.poison();
      const std::size_t ws_bytes = cuda::decode_attention::workspace_size(plan, 3, hq, d);
      DeviceBuffer<unsigned char> ws(ws_bytes);
      TRIATTN_TEST_CUDA(cuda::decode_attention::run(plan, dev.view<T>(), layer, dq.get(), out.get(), 3, hq, dids.get(),
                                                    ref::default_sm_scale(d), ws.get(), ws_bytes, stream));
      TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
      const auto got = out.download();
      double num = 0, den = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        REQUIRE(std::isfinite(got[i]));
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += static_cast<double>(want[i]) * want[i];
      }
      // fp8 runs the fp32 kernel, which applies the K/V scales in another order than the reference's
      // dequantised cache: measured 1.003e-5 on one H100 (2026-12-07), hence a 5e-5 bound.
      CHECK(std::sqrt(num / den) <= (std::is_same_v<T, float> ? 1e-5 : is_scaled_dtype<T> ? 5e-5 : 1e-3));
    }
  }

  // The device's tracked positions of the last round (DeviceRounds::kept_positions) against the host
  // twin's (KvCache::positions after the same plans): every row of every compressed sequence.
  template <class Rounds, class Host>
  void require_same_positions(const Rounds& rounds, const Host& host, std::span<const SeqId> seqs) {
    const auto kp = rounds.kept_positions();
    REQUIRE(kp.batch == static_cast<int>(seqs.size()));
    std::vector<std::int32_t> got(static_cast<std::size_t>(kp.batch) * kp.rows * kp.max_keep);
    TRIATTN_TEST_CUDA(cudaMemcpy(got.data(), kp.positions, got.size() * 4, cudaMemcpyDeviceToHost));
    const ModelGeometry& g = host.config().model;
    REQUIRE(kp.rows == g.num_layers * g.num_kv_heads);
    long long differ = 0, checked = 0;
    for (std::size_t b = 0; b < seqs.size(); ++b)
      for (int l = 0; l < g.num_layers; ++l)
        for (int h = 0; h < g.num_kv_heads; ++h) {
          const std::vector<std::int32_t> want = host.positions(seqs[b], l, h);
          const std::int32_t* row = got.data() + (b * kp.rows + static_cast<std::size_t>(l * g.num_kv_heads + h)) * kp.max_keep;
          for (std::size_t i = 0; i < want.size(); ++i, ++checked) differ += row[i] != want[i];
        }
    CHECK(checked > 0);
    CHECK_MESSAGE(differ == 0, differ, " of ", checked, " kept positions differ from the host twin's");
  }

  TEST_CASE("device rounds: sequences sharing prefix blocks compress only their private part") {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed);
    std::mt19937_64 rng(seed ^ 0x5eedULL);
    using T = bf16_storage;
    CacheConfig cfg;
    cfg.model = ModelGeometry{2, 8, 2, 64};
    cfg.block_size = 16;
    cfg.num_blocks = 40;
    cfg.max_seqs = 4;
    cfg.max_blocks_per_seq = 12;
    cfg.dtype = DType::kBF16;
    cfg.track_positions = true;  // rounds.last_plan and kept_positions; the host twin tracks them too
    for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kUnion}) {
      CAPTURE(to_string(mode));
      SelectionParams sp;
      sp.budget = 64;
      sp.divide_length = 16;
      sp.prompt = PromptMode::kCompete;
      sp.window = 8;
      sp.mode = mode;
      cudaStream_t stream = nullptr;
      TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      {
        std::mt19937 srng(static_cast<unsigned>(seed));
        const QueryStats stats = random_query_stats(srng, cfg.model.num_layers, cfg.model.num_q_heads, cfg.model.head_dim);
        cuda::DeviceKvCache<cuda::TriAttentionDeviceScorer, TopKSelector> dev(
            cfg, cuda::DeviceCompactor(stream),
            cuda::TriAttentionDeviceScorer(stats, RopeConfig{}, ScoringParams{}, cfg.model.num_kv_heads, stream),
            TopKSelector(sp));
        HostCache host(cfg);
        auto add = [&](SeqId s, int n, Phase phase) {
          const auto k = tokens<T>(rng, cfg, n);
          const auto v = tokens<T>(rng, cfg, n);
          REQUIRE(host.append<T>(s, k, v, n, phase).ok());
          DeviceBuffer<T> dk(k), dv(v);
          REQUIRE(cuda::append_tokens(dev, s, dk.get(), dv.get(), n, stream, phase).ok());
          TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
        };
        const SeqId a = host.add_sequence();
        REQUIRE(dev.add_sequence() == a);
        add(a, 40, Phase::kPrefill);
        const SeqId b = host.fork_prefix(a, 32);  // blocks 0 and 1 shared
        REQUIRE(dev.fork_prefix(a, 32) == b);
        const SeqId c = host.add_sequence();  // private only
        REQUIRE(dev.add_sequence() == c);
        add(a, 60, Phase::kDecode);
        add(b, 75, Phase::kDecode);
        add(c, 90, Phase::kPrefill);
        REQUIRE(dev.shared_prefix(a) == 32);
        REQUIRE(dev.shared_prefix(b) == 32);
        REQUIRE(dev.shared_prefix(c) == 0);
        const std::vector<SeqId> seqs{a, b, c};
        std::vector<int> want_keep;
        for (SeqId s : seqs)
          want_keep.push_back(
              keep_counts_unchecked(dev.physical_length(s), dev.prompt_length(s), sp, dev.shared_prefix(s)).keep);
        const std::vector<std::int32_t> shared_blocks(dev.block_table(a).begin(), dev.block_table(a).begin() + 2);
        cuda::publish(dev, stream);
        require_same<T>(host, dev);

        cuda::DeviceRounds<decltype(dev)> rounds(dev);
        rounds.launch(seqs, stream);  // refused a shared block before issue 36
        const std::vector<CompressionReport> done = rounds.wait();
        REQUIRE(done.size() == seqs.size());
        for (std::size_t i = 0; i < seqs.size(); ++i) {
          CAPTURE(i);
          REQUIRE(done[i].status == RoundStatus::kCompressed);
          CHECK(dev.physical_length(seqs[i]) == want_keep[i]);
          const KeepPlan plan = rounds.last_plan(i);
          REQUIRE(plan.keep == want_keep[i]);
          const int prot = i < 2 ? 32 : 0;
          bool in_place = true;
          for (int l = 0; l < cfg.model.num_layers; ++l)
            for (int h = 0; h < cfg.model.num_kv_heads; ++h)
              for (int j = 0; j < prot; ++j) in_place = in_place && plan.row(l, h)[j] == j;
          CHECK(in_place);
          host.apply_keep_plan(seqs[i], plan);  // refuses a plan that would rewrite a shared block
        }
        require_same_positions(rounds, host, seqs);
        CHECK(std::equal(shared_blocks.begin(), shared_blocks.end(), dev.block_table(a).begin()));
        CHECK(std::equal(shared_blocks.begin(), shared_blocks.end(), dev.block_table(b).begin()));
        CHECK(dev.allocator().ref_count(shared_blocks[0]) == 2);
        require_same<T>(host, dev);  // tables, lengths and the whole pool, bit for bit

        // Decoding goes on past the compacted private parts; a second round is accepted too.
        add(a, 30, Phase::kDecode);
        add(b, 30, Phase::kDecode);
        (void)rounds.compress_if_needed_and_wait(seqs, stream);
        CHECK(dev.shared_prefix(a) == 32);
        CHECK(rounds.last_seqs().size() == 2);
        for (std::size_t i = 0; i < rounds.last_seqs().size(); ++i)
          host.apply_keep_plan(rounds.last_seqs()[i], rounds.last_plan(i));
        require_same<T>(host, dev);
        require_same_positions(rounds, host, rounds.last_seqs());
        // A host plan cannot update positions kept on the device: refused, naming the way.
        CHECK_THROWS_WITH_AS(dev.apply_keep_plan(a, rounds.last_plan(0)), doctest::Contains("DeviceRounds"), logic_error);
      }
      TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
    }
  }

  // launch_beside: the round runs on its own stream over a copy of the tables, while the engine
  // keeps extending and publishing on its stream. The round is held back (a kernel spinning on a
  // flag) until the engine has decoded another sequence and overwritten the published lengths with
  // garbage: a round that read the published mirror would refuse it (its device checks read every
  // row); over its copy it compacts exactly as the host twin does with the same plan. Nothing
  // that may synchronise the device (cudaFree, a first allocation) runs while the kernel spins.
  TEST_CASE("device rounds: launch_beside runs beside the engine's stream over a copy of the tables") {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed);
    std::mt19937_64 rng(seed ^ 0xb351deULL);
    using T = bf16_storage;
    CacheConfig cfg;
    cfg.model = ModelGeometry{2, 8, 2, 64};
    cfg.block_size = 16;
    cfg.num_blocks = 40;
    cfg.max_seqs = 4;
    cfg.max_blocks_per_seq = 12;
    cfg.dtype = DType::kBF16;
    SelectionParams sp;
    sp.budget = 64;
    sp.divide_length = 16;
    sp.window = 8;
    cudaStream_t engine = nullptr, side = nullptr;
    TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&engine, cudaStreamNonBlocking));
    TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    {
      DeviceBuffer<int> flag(std::vector<int>{0});
      std::mt19937 srng(static_cast<unsigned>(seed));
      const QueryStats stats = random_query_stats(srng, cfg.model.num_layers, cfg.model.num_q_heads, cfg.model.head_dim);
      cuda::DeviceKvCache<cuda::TriAttentionDeviceScorer, TopKSelector> dev(
          cfg, cuda::DeviceCompactor(engine),
          cuda::TriAttentionDeviceScorer(stats, RopeConfig{}, ScoringParams{}, cfg.model.num_kv_heads, engine),
          TopKSelector(sp));
      HostCache host(cfg);
      auto add = [&](SeqId s, int n, Phase phase) {
        const auto k = tokens<T>(rng, cfg, n);
        const auto v = tokens<T>(rng, cfg, n);
        REQUIRE(host.append<T>(s, k, v, n, phase).ok());
        DeviceBuffer<T> dk(k), dv(v);
        REQUIRE(cuda::append_tokens(dev, s, dk.get(), dv.get(), n, engine, phase).ok());
        TRIATTN_TEST_CUDA(cudaStreamSynchronize(engine));
      };
      const SeqId a = host.add_sequence();
      REQUIRE(dev.add_sequence() == a);
      const SeqId c = host.add_sequence();
      REQUIRE(dev.add_sequence() == c);
      add(a, 30, Phase::kPrefill);
      add(a, 70, Phase::kDecode);  // 100 slots: due (budget 64 + 16)
      add(c, 20, Phase::kPrefill);
      const std::vector<SeqId> seqs{a};
      cuda::DeviceRounds<decltype(dev)> rounds(dev);
      rounds.set_keep_plans(true);
      // Buffers for any round of one sequence, and a first round beside the engine (its table
      // copy): the gated round below allocates nothing.
      rounds.reserve(1, cfg.max_blocks_per_seq * cfg.block_size);
      rounds.launch_beside(seqs, engine, side);
      REQUIRE(rounds.wait().at(0).status == RoundStatus::kCompressed);
      host.apply_keep_plan(a, rounds.last_plan(0));
      add(a, 20, Phase::kDecode);  // due again
      const int want_keep = keep_counts_unchecked(dev.physical_length(a), dev.prompt_length(a), sp, 0).keep;
      REQUIRE(want_keep < dev.physical_length(a));
      const auto ck = tokens<T>(rng, cfg, 9);
      const auto cv = tokens<T>(rng, cfg, 9);
      DeviceBuffer<T> dck(ck), dcv(cv);

      spin_until_set<<<1, 1, 0, side>>>(flag.get());  // holds the side stream back
      TRIATTN_TEST_CUDA(cudaGetLastError());
      rounds.launch_beside(seqs, engine, side);
      CHECK(rounds.in_flight(a));
      // The engine decodes another sequence (extend + publish + append on its stream) ...
      REQUIRE(host.append<T>(c, ck, cv, 9, Phase::kDecode).ok());
      REQUIRE(cuda::append_tokens(dev, c, dck.get(), dcv.get(), 9, engine, Phase::kDecode).ok());
      // ... and the published lengths turn to garbage before the round reads anything.
      TRIATTN_TEST_CUDA(cudaMemsetAsync(const_cast<std::int32_t*>(dev.allocator().published_lengths()), 0x7f,
                                        static_cast<std::size_t>(cfg.max_seqs) * sizeof(std::int32_t), engine));
      TRIATTN_TEST_CUDA(cudaMemsetAsync(flag.get(), 1, sizeof(int), engine));  // now the round may run
      const std::vector<CompressionReport> done = rounds.wait();  // throws if the round read the garbage
      REQUIRE(done.size() == 1);
      REQUIRE(done[0].status == RoundStatus::kCompressed);
      CHECK(dev.physical_length(a) == want_keep);
      host.apply_keep_plan(a, rounds.last_plan(0));
      TRIATTN_TEST_CUDA(cudaStreamSynchronize(engine));
      // The commit published on the engine's stream: the mirror holds the new lengths again.
      std::vector<std::int32_t> lens(static_cast<std::size_t>(cfg.max_seqs));
      TRIATTN_TEST_CUDA(cudaMemcpy(lens.data(), dev.allocator().published_lengths(), lens.size() * sizeof(std::int32_t),
                                   cudaMemcpyDeviceToHost));
      CHECK(lens[static_cast<std::size_t>(a)] == want_keep);
      CHECK(lens[static_cast<std::size_t>(c)] == 29);
      require_same<T>(host, dev);  // a compacted as the host twin, c's decode intact, bit for bit
    }
    TRIATTN_TEST_CUDA(cudaStreamDestroy(side));
    TRIATTN_TEST_CUDA(cudaStreamDestroy(engine));
  }

  // The device scorer with its host-span score() counted: KvCache::compress on a device cache must
  // never call it (scores stay on the device). device_scores() is the same call, uncounted, for
  // the host twin.
  struct CountingDeviceScorer : cuda::TriAttentionDeviceScorer {
    using cuda::TriAttentionDeviceScorer::TriAttentionDeviceScorer;
    int host_scores = 0;
    template <class T, class Id>
    void score(const KvCacheView<T, Id>& view, int seq, int length, std::int64_t t0, std::span<float> out) {
      ++host_scores;
      cuda::TriAttentionDeviceScorer::score(view, seq, length, t0, out);
    }
    template <class T, class Id>
    std::vector<float> device_scores(const KvCacheView<T, Id>& view, int seq, int length, std::int64_t t0) {
      std::vector<float> out(static_cast<std::size_t>(model().num_layers()) * model().num_q_heads() * length);
      cuda::TriAttentionDeviceScorer::score(view, seq, length, t0, std::span<float>(out));
      return out;
    }
  };

  // The host twin's scorer: the scores the device scorer gave each sequence, so the host round
  // selects on exactly the device's scores (what KvCache::compress did before the device round).
  struct GivenScores {
    using policy_role = scorer_role;
    static constexpr MemorySpace memory_space = MemorySpace::kHost;
    std::map<SeqId, std::vector<float>> by_seq;  // [L, Hq, length]
    template <class T, class Id>
    void score(const KvCacheView<T, Id>&, int seq, int length, std::int64_t, std::span<float> out) const {
      const std::vector<float>& sc = by_seq.at(seq);
      REQUIRE(sc.size() == out.size());
      REQUIRE(out.size() % static_cast<std::size_t>(length > 0 ? length : 1) == 0);
      std::copy(sc.begin(), sc.end(), out.begin());
    }
  };

  template <class H, class D>
  void require_same_sequences(const H& host, const D& dev, std::span<const SeqId> seqs, cudaStream_t stream) {
    CHECK(dev.memory().blocks_free == host.memory().blocks_free);
    const ModelGeometry& g = host.config().model;
    long long differ = 0, checked = 0;
    for (SeqId s : seqs) {
      CAPTURE(s);
      CHECK(dev.physical_length(s) == host.physical_length(s));
      CHECK(dev.prompt_length(s) == host.prompt_length(s));
      CHECK(dev.logical_position(s) == host.logical_position(s));
      CHECK(dev.shared_prefix(s) == host.shared_prefix(s));
      if (!host.config().track_positions) continue;
      for (int l = 0; l < g.num_layers; ++l)
        for (int h = 0; h < g.num_kv_heads; ++h) {
          const std::vector<std::int32_t> want = host.positions(s, l, h);
          const std::vector<std::int32_t> got = cuda::tracked_positions(dev, s, l, h, stream);
          REQUIRE(got.size() == want.size());
          for (std::size_t i = 0; i < want.size(); ++i, ++checked) differ += got[i] != want[i];
        }
    }
    CHECK_MESSAGE(differ == 0, differ, " of ", checked, " tracked positions differ from the host twin's");
  }

  void require_same_reports(const std::vector<CompressionReport>& got, const std::vector<CompressionReport>& want,
                            bool tracked) {
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i].seq == want[i].seq);
      CHECK(got[i].status == want[i].status);
      CHECK(got[i].length_before == want[i].length_before);
      CHECK(got[i].length_after == want[i].length_after);
      CHECK(got[i].blocks_freed == want[i].blocks_freed);
      const bool compressed = want[i].status == RoundStatus::kCompressed;
      CHECK(want[i].has_positions == (tracked && compressed));
      CHECK_FALSE(got[i].has_positions);  // kept on the device, never copied
      CHECK(got[i].positions_on_device == (tracked && compressed));
    }
  }

  TEST_CASE_TEMPLATE("device kv cache: compress and compress_if_needed run the device round and equal the host rounds",
                     T, float, bf16_storage, fp8_e4m3_storage) {
    test::require_device();
    const std::uint64_t seed = test::test_seed();
    MESSAGE("seed = ", seed, " (set TRIATTN_TEST_SEED to replay)");
    CacheConfig cfg;
    cfg.model = ModelGeometry{2, 8, 2, 64};
    cfg.block_size = 16;
    cfg.num_blocks = 48;
    cfg.max_seqs = 4;
    cfg.max_blocks_per_seq = 12;
    cfg.dtype = dtype_of<T>;
    set_test_scales(cfg);
    for (const bool tracked : {false, true})
      for (PruningMode mode : {PruningMode::kPerHead, PruningMode::kPerLayerPerHead, PruningMode::kUnion}) {
        CAPTURE(tracked);
        CAPTURE(to_string(mode));
        cfg.track_positions = tracked;
        SelectionParams sp;
        sp.budget = 48;
        sp.divide_length = 16;
        sp.prompt = PromptMode::kCompete;
        sp.window = 8;
        sp.mode = mode;
        std::mt19937_64 rng(seed ^ test::dtype_salt<T>() ^ (static_cast<std::uint64_t>(mode) << 8) ^ (tracked ? 1u : 0u));
        cudaStream_t stream = nullptr;
        TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        {
          std::mt19937 srng(static_cast<unsigned>(seed));
          const QueryStats stats =
              random_query_stats(srng, cfg.model.num_layers, cfg.model.num_q_heads, cfg.model.head_dim);
          cuda::DeviceKvCache<CountingDeviceScorer, TopKSelector> dev(
              cfg, cuda::DeviceCompactor(stream),
              CountingDeviceScorer(stats, RopeConfig{}, ScoringParams{}, cfg.model.num_kv_heads, stream), TopKSelector(sp));
          KvCache<GivenScores, TopKSelector> host(cfg, GivenScores{}, TopKSelector(sp));
          // nan_slot >= 0: that token's first key element of layer 0, KV head 0 is NaN.
          auto add = [&](SeqId s, int n, Phase phase, int nan_slot = -1) {
            auto k = tokens<T>(rng, cfg, n);
            const auto v = tokens<T>(rng, cfg, n);
            if (nan_slot >= 0)
              k[static_cast<std::size_t>(nan_slot) * cfg.model.num_kv_heads * cfg.model.head_dim] =
                  from_float<T>(std::numeric_limits<float>::quiet_NaN());
            REQUIRE(host.template append<T>(s, k, v, n, phase).ok());
            DeviceBuffer<T> dk(k), dv(v);
            REQUIRE(cuda::append_tokens(dev, s, dk.get(), dv.get(), n, stream, phase).ok());
            TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
          };
          // The host twin scores with what the device scorer gives the same keys.
          auto give_scores = [&](std::span<const SeqId> seqs) {
            cuda::publish(dev, stream);
            for (SeqId s : seqs)
              host.scorer().by_seq[s] = dev.scorer().device_scores(dev.template view<T>(), s, dev.physical_length(s),
                                                                   dev.logical_position(s));
          };
          const SeqId a = host.add_sequence();
          REQUIRE(dev.add_sequence() == a);
          add(a, 40, Phase::kPrefill);
          const SeqId b = host.fork_prefix(a, 32);  // blocks 0 and 1 shared: protected in every round
          REQUIRE(dev.fork_prefix(a, 32) == b);
          const SeqId c = host.add_sequence(), d = host.add_sequence();
          REQUIRE(dev.add_sequence() == c);
          REQUIRE(dev.add_sequence() == d);
          add(a, 30, Phase::kDecode);
          add(b, 45, Phase::kDecode);
          add(c, 20, Phase::kPrefill);
          add(c, 35, Phase::kDecode);
          add(d, 30, Phase::kPrefill, 5);  // a selectable NaN key: d's rounds are refused (kNonFinite)
          add(d, 40, Phase::kDecode);
          const std::vector<SeqId> all{a, b, c, d};
          const std::vector<std::int32_t> shared_blocks(dev.block_table(a).begin(), dev.block_table(a).begin() + 2);
          REQUIRE(dev.shared_prefix(b) == 32);
          require_same<T>(host, dev);

          // compress: one sequence, below its trigger (brought to its keep count anyway).
          give_scores(std::span<const SeqId>(&c, 1));
          const CompressionReport want_c = host.compress(c);
          const CompressionReport got_c = dev.compress(c);
          REQUIRE(want_c.status == RoundStatus::kCompressed);
          REQUIRE(want_c.length_after < want_c.length_before);
          require_same_reports({got_c}, {want_c}, tracked);
          require_same<T>(host, dev);
          require_same_sequences(host, dev, all, stream);

          // Bad input is refused before anything changes, naming it.
          const std::vector<SeqId> twice{a, c, a};
          CHECK_THROWS_WITH_AS(dev.compress_if_needed(twice), doctest::Contains("appears twice"), logic_error);
          CHECK_THROWS_WITH_AS(dev.compress(SeqId{7}), doctest::Contains("sequence 7"), logic_error);
          require_same<T>(host, dev);

          // compress_if_needed over a ragged batch: a, b and d are due (d refused: non-finite), c not.
          give_scores(all);
          const std::vector<CompressionReport> want = host.compress_if_needed(all);
          const std::vector<CompressionReport> got = dev.compress_if_needed(all);
          REQUIRE(want.size() == 3);
          CHECK(want[0].seq == a);
          CHECK(want[1].seq == b);
          CHECK(want[2].status == RoundStatus::kNonFinite);
          require_same_reports(got, want, tracked);
          require_same<T>(host, dev);
          require_same_sequences(host, dev, all, stream);

          // More decoding, then a round through cuda::DeviceRounds: it reads the positions the
          // KvCache rounds left in the cache's store (one store per cache).
          add(a, 20, Phase::kDecode);
          add(b, 10, Phase::kDecode);
          add(c, 20, Phase::kDecode);
          const std::vector<SeqId> abc{a, b, c};
          cuda::DeviceRounds<decltype(dev)> rounds(dev);
          rounds.set_keep_plans(true);
          rounds.launch(abc, stream);
          REQUIRE(rounds.wait().size() == abc.size());
          for (std::size_t i = 0; i < abc.size(); ++i) host.apply_keep_plan(abc[i], rounds.last_plan(i));
          require_same<T>(host, dev);
          require_same_sequences(host, dev, all, stream);

          // And KvCache::compress again after it.
          add(b, 12, Phase::kDecode);
          give_scores(std::span<const SeqId>(&b, 1));
          require_same_reports({dev.compress(b)}, {host.compress(b)}, tracked);
          require_same<T>(host, dev);
          require_same_sequences(host, dev, all, stream);

          CHECK(std::equal(shared_blocks.begin(), shared_blocks.end(), dev.block_table(a).begin()));
          CHECK(std::equal(shared_blocks.begin(), shared_blocks.end(), dev.block_table(b).begin()));
          CHECK(dev.allocator().ref_count(shared_blocks[0]) == 2);
          CHECK(dev.scorer().host_scores == 0);  // no round copied scores to the host
        }
        TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
      }
  }

  TEST_CASE("device kv cache: a device round's report keeps tracked positions on the device and names where to read them") {
    test::require_device();
    CacheConfig cfg;
    cfg.model = ModelGeometry{1, 2, 1, 64};
    cfg.block_size = 8;
    cfg.num_blocks = 8;
    cfg.max_seqs = 1;
    cfg.max_blocks_per_seq = 8;
    cfg.dtype = DType::kF32;
    cfg.track_positions = true;
    SelectionParams sp;
    sp.budget = 8;
    sp.divide_length = 8;
    sp.prompt = PromptMode::kCompete;
    std::mt19937 srng(3);
    cuda::DeviceKvCache<cuda::TriAttentionDeviceScorer, TopKSelector> dev(
        cfg, cuda::TriAttentionDeviceScorer(random_query_stats(srng, 1, 2, 64), RopeConfig{}, ScoringParams{}, 1),
        TopKSelector(sp));
    const SeqId s = dev.add_sequence();
    std::mt19937_64 rng(5);
    const auto k = tokens<float>(rng, cfg, 20);
    DeviceBuffer<float> dk(k), dv(k);
    REQUIRE(cuda::append_tokens(dev, s, dk.get(), dv.get(), 20, nullptr, Phase::kPrefill).ok());
    const CompressionReport rep = dev.compress(s);
    REQUIRE(rep.status == RoundStatus::kCompressed);
    CHECK(rep.length_after == keep_counts_unchecked(20, 20, sp, 0).keep);
    CHECK(rep.positions_on_device);
    CHECK(rep.kept_positions.empty());
    CHECK_THROWS_WITH_AS((void)rep.kept(0), doctest::Contains("cuda::tracked_positions"), logic_error);
    const std::vector<std::int32_t> pos = cuda::tracked_positions(dev, s, 0, 0, nullptr);
    REQUIRE(pos.size() == static_cast<std::size_t>(rep.length_after));
    CHECK(std::is_sorted(pos.begin(), pos.end()));
    CHECK(std::adjacent_find(pos.begin(), pos.end()) == pos.end());
    CHECK(pos.front() >= 0);
    CHECK(pos.back() < 20);
  }
}
