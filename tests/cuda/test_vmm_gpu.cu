// SPDX-License-Identifier: Apache-2.0
// The elastic allocator on the real driver (CUDA VMM through run-time entry points):
//  * KvCache<cuda::VmmAllocator, cuda::DeviceCompactor> against a host KvCache doing the same
//    operations (prefill, decode, compaction with random plans, release, trim, regrowth): every
//    cached token must match bitwise, before and after pages are unmapped and mapped again;
//  * pages really go back: cudaMemGetInfo's free memory rises by the trimmed bytes (within a
//    page or two) and falls again on regrowth; pooled handles stay resident until released;
//  * lowering the memory limit returns free pages and refuses growth beyond it;
//  * blocks larger than a page;
//  * KvCache::relocate_blocks after compaction: slabs empty, tokens stay bitwise.
// Where no driver/GPU exists these tests FAIL (construction throws cuda_error), never skip.
// ctest: RUN_SERIAL (free memory is device-wide: another test process would move it)
#include "cuda_test_utils.cuh"

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include <triattn/core/kv_cache.hpp>
#include <triattn/cuda/backend/vmm_allocator.cuh>
#include <triattn/cuda/device_kv_cache.cuh>
#include <triattn/cuda/policy/device_compactor.cuh>

namespace {

using namespace triattn;
using test::DeviceBuffer;

using VmmCache = KvCache<cuda::VmmAllocator, cuda::DeviceCompactor>;
using HostCache = KvCache<>;

static_assert(BlockAllocator<cuda::VmmAllocator>);
static_assert(BlockAllocator<cuda::VmmBlockAllocator>);
static_assert(VmmCache::memory_space == MemorySpace::kDevice);
static_assert(std::is_nothrow_move_constructible_v<cuda::VmmAllocator>);

constexpr std::size_t kMiB = std::size_t{1} << 20;

/// Device memory in use according to the driver (total - free).
std::size_t device_used() {
  std::size_t free_b = 0, total_b = 0;
  TRIATTN_TEST_CUDA(cudaMemGetInfo(&free_b, &total_b));
  return total_b - free_b;
}
std::ptrdiff_t diff(std::size_t a, std::size_t b) { return static_cast<std::ptrdiff_t>(a) - static_cast<std::ptrdiff_t>(b); }

/// 2 layers (4 ranges) x 4 KV heads x d 128, 16-token blocks: bf16 block = 16 KiB, 128 per 2 MiB page.
CacheConfig make_config(DType dtype, int num_blocks, int max_seqs, KvLayout layout = KvLayout::kNHD) {
  CacheConfig cfg;
  cfg.model = ModelGeometry{2, 8, 4, 128};
  cfg.block_size = 16;
  cfg.num_blocks = num_blocks;
  cfg.max_seqs = max_seqs;
  cfg.layout = layout;
  cfg.dtype = dtype;
  return cfg;
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
KeepPlan prefix_plan(const ModelGeometry& g, int keep) {
  KeepPlan p(g.num_layers, g.num_kv_heads, keep);
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h) std::iota(p.row(l, h), p.row(l, h) + keep, 0);
  return p;
}

/// Appends the same n random tokens to the host twin and (through the append kernel) the device cache.
template <class T>
void append_both(std::mt19937_64& rng, HostCache& host, VmmCache& dev, SeqId hs, SeqId ds, int n, Phase phase,
                 cudaStream_t stream) {
  const CacheConfig& cfg = host.config();
  const std::size_t elems = static_cast<std::size_t>(cfg.model.num_layers) * n * cfg.model.num_kv_heads * cfg.model.head_dim;
  const auto k = test::random_values<T>(rng, elems);
  const auto v = test::random_values<T>(rng, elems);
  REQUIRE(host.append<T>(hs, k, v, n, phase).ok());
  DeviceBuffer<T> dk(k), dv(v);
  REQUIRE(cuda::append_tokens(dev, ds, dk.get(), dv.get(), n, stream, phase).ok());
  TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
}

/// Every cached token of every pair (host seq, device seq) must be bitwise equal. Device blocks are
/// downloaded one (range, block) at a time through the cache's host tables.
template <class T>
void require_same_tokens(const HostCache& host, const VmmCache& dev, const std::vector<std::pair<SeqId, SeqId>>& pairs) {
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  const CacheConfig& cfg = host.config();
  const BlockLayout bl = cfg.block_layout();
  const auto hview = host.view<T>();
  const auto* base = static_cast<const T*>(dev.allocator().data());
  const std::int64_t stride = dev.allocator().range_stride_bytes() / static_cast<std::int64_t>(sizeof(T));
  std::map<std::pair<int, int>, std::vector<T>> blocks;  // (range, block) -> [block_elems]
  std::size_t compared = 0;
  for (auto [hs, ds] : pairs) {
    const int len = host.physical_length(hs);
    REQUIRE(dev.physical_length(ds) == len);
    const auto table = dev.block_table(ds);
    for (int l = 0; l < cfg.model.num_layers; ++l)
      for (int kind = 0; kind < 2; ++kind) {
        const int r = 2 * l + kind;
        for (int slot = 0; slot < len; ++slot) {
          const int b = table[static_cast<std::size_t>(slot / cfg.block_size)];
          auto it = blocks.find({r, b});
          if (it == blocks.end()) {
            std::vector<T> h(static_cast<std::size_t>(bl.block_elems()));
            TRIATTN_TEST_CUDA(cudaMemcpy(h.data(), base + r * stride + static_cast<std::int64_t>(b) * bl.block_elems(),
                                         h.size() * sizeof(T), cudaMemcpyDeviceToHost));
            it = blocks.emplace(std::make_pair(r, b), std::move(h)).first;
          }
          for (int h = 0; h < cfg.model.num_kv_heads; ++h) {
            const T* want = hview.token(l, static_cast<KvKind>(kind), hs, slot, h);
            const T* got = it->second.data() + (bl.offset(0, slot % cfg.block_size, h));
            if (std::memcmp(want, got, static_cast<std::size_t>(cfg.model.head_dim) * sizeof(T)) != 0) {
              FAIL("token mismatch: host seq " << hs << " device seq " << ds << " layer " << l << " kind " << kind
                                               << " slot " << slot << " head " << h);
            }
            ++compared;
          }
        }
      }
  }
  CHECK(compared > 0);
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("vmm gpu: the real driver loads and the allocator reserves and maps on demand and grants access") {
  test::require_device();
  const CacheConfig cfg = make_config(DType::kBF16, 128 * 64, 8);
  cuda::VmmBlockAllocator a(cfg);  // throws cuda_error where no driver exists: the test then fails
  const std::size_t page = a.page_bytes();
  MESSAGE("granularity = " << page << " bytes; slab = " << a.geometry().pages_per_slab << " page(s) x "
                           << a.geometry().num_ranges << " ranges, " << a.geometry().blocks_per_slab << " blocks");
  REQUIRE(page >= 64 * 1024);
  REQUIRE((page & (page - 1)) == 0);
  CHECK(a.bytes_resident() == 0);
  const std::size_t used0 = device_used();
  std::vector<std::int32_t> b(static_cast<std::size_t>(a.geometry().blocks_per_slab) * 10, -1);
  REQUIRE(a.allocate(b));
  const std::size_t mapped = a.bytes_resident();
  CHECK(mapped == 10 * a.geometry().pages_per_slab * 4 * page);
  CHECK(std::abs(diff(device_used() - used0, mapped)) <= static_cast<std::ptrdiff_t>(2 * page));
  // Every mapped byte is writable and readable by the device.
  for (int r = 0; r < 4; ++r) {
    char* p = static_cast<char*>(a.data()) + r * a.range_stride_bytes();
    TRIATTN_TEST_CUDA(cudaMemset(p, 0x5A, mapped / 4));
  }
  TRIATTN_TEST_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> h(mapped / 4);
  TRIATTN_TEST_CUDA(cudaMemcpy(h.data(), static_cast<char*>(a.data()) + 3 * a.range_stride_bytes(), h.size(),
                               cudaMemcpyDeviceToHost));
  CHECK(std::all_of(h.begin(), h.end(), [](unsigned char x) { return x == 0x5A; }));
  // One access grant per range for the 10-slab run.
  CHECK(a.counters().access_calls == 4);
  CHECK(a.counters().pages_mapped == 10 * a.geometry().pages_per_slab * 4);
}

TEST_CASE_TEMPLATE("vmm gpu: cached tokens survive compaction and trim and regrowth (vs the host cache)", T, bf16_storage,
                   float) {
  test::require_device();
  const std::uint64_t seed = test::test_seed();
  MESSAGE("seed = ", seed, " (set TRIATTN_TEST_SEED to replay)");
  for (KvLayout layout : {KvLayout::kNHD, KvLayout::kHND}) {
    CAPTURE(layout_name(layout));
    std::mt19937_64 rng(seed ^ static_cast<std::uint64_t>(layout) ^ (sizeof(T) << 8));
    const CacheConfig cfg = make_config(dtype_of<T>, 2048, 8, layout);
    cudaStream_t stream = nullptr;
    TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    {
      HostCache host(cfg);
      VmmCache dev(cfg, cuda::DeviceCompactor(stream));
      std::vector<std::pair<SeqId, SeqId>> seqs;
      for (int i = 0; i < 6; ++i) {
        const SeqId hs = host.add_sequence(), ds = dev.add_sequence();
        append_both<T>(rng, host, dev, hs, ds, 100 + static_cast<int>(rng() % 700), Phase::kPrefill, stream);
        seqs.emplace_back(hs, ds);
      }
      for (int step = 0; step < 20; ++step)
        for (auto [hs, ds] : seqs) append_both<T>(rng, host, dev, hs, ds, 1, Phase::kDecode, stream);
      require_same_tokens<T>(host, dev, seqs);
      const std::size_t resident_before = dev.allocator().bytes_resident();

      // Compress every sequence with a random plan (survivors move down, tail blocks are freed).
      for (auto [hs, ds] : seqs) {
        const int len = host.physical_length(hs);
        const KeepPlan plan = random_plan(rng, cfg.model, len, len / 4);
        host.apply_keep_plan(hs, plan);
        cuda::publish(dev, stream);
        dev.apply_keep_plan(ds, plan);
      }
      // Drop two sequences entirely, then give empty pages back after the compaction kernels.
      for (int i : {1, 4}) {
        host.release(seqs[static_cast<std::size_t>(i)].first);
        dev.release(seqs[static_cast<std::size_t>(i)].second);
      }
      seqs.erase(seqs.begin() + 4);
      seqs.erase(seqs.begin() + 1);
      (void)dev.allocator().trim(stream);
      dev.allocator().synchronize();
      require_same_tokens<T>(host, dev, seqs);
      CHECK(dev.allocator().bytes_resident() <= resident_before);
      // Whether a slab empties depends on how the survivors interleave; what must hold is that
      // after a completed trim no mapped slab is empty (none is kept: handle_pool_bytes = 0).
      CHECK(dev.allocator().ledger().empty_mapped_slabs().empty());
      MESSAGE("resident " << resident_before / kMiB << " MiB -> " << dev.allocator().bytes_resident() / kMiB
                          << " MiB after compaction + trim");

      // Regrowth: new sequences and more decoding map pages again.
      for (int i = 0; i < 3; ++i) {
        const SeqId hs = host.add_sequence(), ds = dev.add_sequence();
        append_both<T>(rng, host, dev, hs, ds, 300 + static_cast<int>(rng() % 500), Phase::kPrefill, stream);
        seqs.emplace_back(hs, ds);
      }
      for (int step = 0; step < 40; ++step)
        for (auto [hs, ds] : seqs) append_both<T>(rng, host, dev, hs, ds, 1, Phase::kDecode, stream);
      require_same_tokens<T>(host, dev, seqs);
      CHECK(dev.allocator().stats().blocks_used == host.memory().blocks_used);
    }
    TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
  }
}

TEST_CASE("vmm gpu: relocation after compaction empties slabs and keeps every token (vs the host cache)") {
  test::require_device();
  const std::uint64_t seed = test::test_seed();
  MESSAGE("seed = ", seed, " (set TRIATTN_TEST_SEED to replay)");
  std::mt19937_64 rng(seed);
  // bf16 16 KiB blocks, 128 per 2 MiB page: a slab is one page in each of 4 ranges, 128 blocks.
  // 16 prompts of 60 blocks prefilled in order fill 7.5 slabs; each keeps 16 blocks (256 tokens),
  // the first ones of its table, so every slab keeps survivors of two or three sequences.
  const CacheConfig cfg = make_config(DType::kBF16, 128 * 16, 16);
  cudaStream_t stream = nullptr;
  TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    HostCache host(cfg);
    VmmCache dev(cfg, cuda::DeviceCompactor(stream));
    REQUIRE(dev.allocator().geometry().blocks_per_slab == 128);
    std::vector<std::pair<SeqId, SeqId>> seqs;
    for (int i = 0; i < 16; ++i) {
      const SeqId hs = host.add_sequence(), ds = dev.add_sequence();
      append_both<bf16_storage>(rng, host, dev, hs, ds, 60 * 16, Phase::kPrefill, stream);
      seqs.emplace_back(hs, ds);
    }
    for (auto [hs, ds] : seqs) {
      const KeepPlan plan = random_plan(rng, cfg.model, host.physical_length(hs), 256);
      host.apply_keep_plan(hs, plan);
      cuda::publish(dev, stream);
      dev.apply_keep_plan(ds, plan);
    }
    (void)dev.allocator().trim(stream);
    dev.allocator().synchronize();
    const std::size_t stuck = dev.memory().bytes_resident;
    MESSAGE("after compaction + trim: " << stuck / kMiB << " MiB resident for " << dev.memory().bytes_live / kMiB << " MiB live");
    CHECK(stuck >= 3 * dev.memory().bytes_live);  // the pattern: no slab emptied

    const std::size_t used0 = device_used();
    const RelocationReport rep = dev.relocate_blocks();
    (void)dev.allocator().trim(stream);
    dev.allocator().synchronize();
    const std::size_t used1 = device_used();
    MESSAGE("relocated " << rep.blocks_moved << " blocks in " << rep.copies << " copies, emptying " << rep.slabs_emptied
                         << " slabs: " << dev.memory().bytes_resident / kMiB << " MiB resident");
    CHECK(rep.slabs_emptied >= 5);
    CHECK(dev.memory().bytes_resident == dev.memory().bytes_live);  // 256 blocks: exactly 2 slabs
    CHECK(std::abs(diff(used0 - used1, stuck - dev.memory().bytes_resident)) <= static_cast<std::ptrdiff_t>(2 * dev.allocator().page_bytes()));
    require_same_tokens<bf16_storage>(host, dev, seqs);
    CHECK(dev.allocator().stats().blocks_used == host.memory().blocks_used);

    // Decoding after the move: appends go through the republished tables into the new blocks.
    for (int step = 0; step < 20; ++step)
      for (auto [hs, ds] : seqs) append_both<bf16_storage>(rng, host, dev, hs, ds, 1, Phase::kDecode, stream);
    require_same_tokens<bf16_storage>(host, dev, seqs);
  }
  TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("vmm gpu: trim returns pages to the driver and regrowth maps them again (cudaMemGetInfo)") {
  test::require_device();
  const CacheConfig cfg = make_config(DType::kBF16, 128 * 64, 48);
  cudaStream_t stream = nullptr;
  TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    VmmCache dev(cfg, cuda::DeviceCompactor(stream));
    auto& a = dev.allocator();
    const std::size_t page = a.page_bytes();
    const int per_slab_tokens = a.geometry().blocks_per_slab * cfg.block_size;
    const auto slab_bytes = static_cast<std::size_t>(a.geometry().slab_bytes_all_ranges(0));
    const auto tol = static_cast<std::ptrdiff_t>(2 * page);
    // Warm up everything that allocates device memory lazily (tables, events, kernels).
    cuda::publish(dev, stream);
    (void)a.trim(stream);
    TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
    const std::size_t used0 = device_used();

    // 32 sequences of exactly one slab each, added one after the other: sequence i owns slab i.
    std::vector<SeqId> seqs;
    for (int i = 0; i < 32; ++i) {
      seqs.push_back(dev.add_sequence());
      REQUIRE(dev.extend(seqs.back(), per_slab_tokens, Phase::kPrefill).ok());
    }
    const std::size_t used1 = device_used();
    CHECK(a.bytes_resident() == 32 * slab_bytes);
    CHECK(std::abs(diff(used1 - used0, a.bytes_resident())) <= tol);
    MESSAGE("32 slabs: allocator " << a.bytes_resident() / kMiB << " MiB, cudaMemGetInfo +" << (used1 - used0) / kMiB << " MiB");

    // Release the upper half: trim gives exactly those pages back.
    for (int i = 16; i < 32; ++i) dev.release(seqs[static_cast<std::size_t>(i)]);
    CHECK(device_used() == used1);  // release alone never calls the driver
    const auto tr = a.trim(stream);
    a.synchronize();
    CHECK(tr.bytes_scheduled == 16 * slab_bytes);
    const std::size_t used2 = device_used();
    MESSAGE("trim of 16 slabs: cudaMemGetInfo -" << (used1 - used2) / kMiB << " MiB (expected " << 16 * slab_bytes / kMiB << ")");
    CHECK(std::abs(diff(used1 - used2, 16 * slab_bytes)) <= tol);
    CHECK(a.bytes_resident() == 16 * slab_bytes);

    // Regrowth maps them again.
    for (int i = 16; i < 32; ++i) {
      seqs[static_cast<std::size_t>(i)] = dev.add_sequence();
      REQUIRE(dev.extend(seqs[static_cast<std::size_t>(i)], per_slab_tokens, Phase::kPrefill).ok());
    }
    const std::size_t used3 = device_used();
    CHECK(std::abs(diff(used3 - used2, 16 * slab_bytes)) <= tol);

    // Compression to half of every sequence frees half of every slab: best fit refills those
    // holes before mapping anything new (filler j takes the free halves of slabs 2j and 2j+1).
    const KeepPlan half = prefix_plan(cfg.model, per_slab_tokens / 2);
    for (SeqId s : seqs) dev.apply_keep_plan(s, half);
    const auto mapped_before = a.counters().pages_mapped;
    std::vector<SeqId> fillers;
    for (int i = 0; i < 16; ++i) {
      fillers.push_back(dev.add_sequence());
      REQUIRE(dev.extend(fillers.back(), per_slab_tokens, Phase::kPrefill).ok());
    }
    CHECK(a.counters().pages_mapped == mapped_before);
    CHECK(std::abs(diff(device_used(), used3)) <= tol);

    // Empty slabs 0..15 completely; with a handle pool they stay resident (pooled) after trim,
    // and go back to the driver when the pool is released.
    for (int i = 0; i < 16; ++i) dev.release(seqs[static_cast<std::size_t>(i)]);
    for (int j = 0; j < 8; ++j) dev.release(fillers[static_cast<std::size_t>(j)]);
    a.set_handle_pool_bytes(16 * slab_bytes);
    const std::size_t used4 = device_used();
    const auto tr2 = a.trim(stream);
    a.synchronize();
    CHECK(tr2.bytes_scheduled == 16 * slab_bytes);
    CHECK(a.bytes_pooled() == 16 * slab_bytes);
    CHECK(a.bytes_resident() == 16 * slab_bytes);
    CHECK(std::abs(diff(device_used(), used4)) <= tol);  // pooled handles are still physical memory
    a.release_handle_pool();
    CHECK(a.bytes_pooled() == 0);
    CHECK(std::abs(diff(used4 - device_used(), 16 * slab_bytes)) <= tol);
    CHECK(std::abs(diff(device_used() - used0, a.physical_bytes())) <= tol);
  }
  TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("vmm gpu: lowering the memory limit returns free pages and refuses growth beyond it") {
  test::require_device();
  const CacheConfig cfg = make_config(DType::kBF16, 128 * 64, 48);
  cudaStream_t stream = nullptr;
  TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    VmmCache dev(cfg, cuda::DeviceCompactor(stream));
    auto& a = dev.allocator();
    const int per_slab_tokens = a.geometry().blocks_per_slab * cfg.block_size;
    const auto slab_bytes = static_cast<std::size_t>(a.geometry().slab_bytes_all_ranges(0));
    const auto tol = static_cast<std::ptrdiff_t>(2 * a.page_bytes());
    cuda::publish(dev, stream);
    TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
    std::vector<SeqId> seqs;
    for (int i = 0; i < 16; ++i) {
      seqs.push_back(dev.add_sequence());
      REQUIRE(dev.extend(seqs.back(), per_slab_tokens, Phase::kPrefill).ok());
    }
    for (int i = 8; i < 16; ++i) dev.release(seqs[static_cast<std::size_t>(i)]);
    const std::size_t used1 = device_used();
    const auto r = a.set_memory_limit(12 * slab_bytes, stream);  // 4 of the 8 empty slabs must go
    CHECK(r.bytes_over_limit == 0);
    CHECK(a.physical_bytes() == 12 * slab_bytes);
    CHECK(std::abs(diff(used1 - device_used(), 4 * slab_bytes)) <= tol);
    // 4 empty slabs are still mapped: filling them needs no growth; one block more does.
    for (int i = 0; i < 4; ++i) {
      const SeqId s = dev.add_sequence();
      REQUIRE(dev.extend(s, per_slab_tokens, Phase::kPrefill).ok());
    }
    const SeqId extra = dev.add_sequence();
    CHECK(dev.extend(extra, 1, Phase::kPrefill).status == AppendStatus::kOutOfBlocks);
    CHECK(a.last_status() == cuda::AllocStatus::kMemoryLimit);
    // A limit below live usage only blocks growth; raising it allows growth again.
    const auto below = a.set_memory_limit(4 * slab_bytes, stream);
    CHECK(below.bytes_over_limit == 8 * slab_bytes);
    a.set_memory_limit(~std::size_t{0});
    CHECK(dev.extend(extra, per_slab_tokens, Phase::kPrefill).ok());
    CHECK(a.physical_bytes() == 13 * slab_bytes);
  }
  TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("vmm gpu: blocks larger than a page (one block spans two pages)") {
  test::require_device();
  CacheConfig cfg;
  cfg.model = ModelGeometry{1, 8, 8, 128};
  cfg.block_size = 1024;  // 1024 x 8 x 128 x 4 B = 4 MiB per block and range
  cfg.num_blocks = 16;
  cfg.max_seqs = 2;
  cfg.dtype = DType::kF32;
  cudaStream_t stream = nullptr;
  TRIATTN_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    std::mt19937_64 rng(test::test_seed());
    HostCache host(cfg);
    VmmCache dev(cfg, cuda::DeviceCompactor(stream));
    if (dev.allocator().page_bytes() == 2 * kMiB) CHECK(dev.allocator().geometry().pages_per_slab == 2);
    std::vector<std::pair<SeqId, SeqId>> seqs;
    for (int i = 0; i < 2; ++i) {
      const SeqId hs = host.add_sequence(), ds = dev.add_sequence();
      append_both<float>(rng, host, dev, hs, ds, 1500 + 300 * i, Phase::kPrefill, stream);
      seqs.emplace_back(hs, ds);
    }
    require_same_tokens<float>(host, dev, seqs);
    const KeepPlan plan = random_plan(rng, cfg.model, host.physical_length(seqs[0].first), 700);
    host.apply_keep_plan(seqs[0].first, plan);
    cuda::publish(dev, stream);
    dev.apply_keep_plan(seqs[0].second, plan);
    (void)dev.allocator().trim(stream);
    dev.allocator().synchronize();
    require_same_tokens<float>(host, dev, seqs);
    if ((4 * kMiB) % dev.allocator().page_bytes() == 0)  // slab = one block of 4 MiB per range, 2 ranges
      CHECK(dev.allocator().bytes_resident() == dev.memory().blocks_used * 4 * kMiB * 2);
  }
  TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
}

}  // TEST_SUITE
