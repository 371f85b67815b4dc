// SPDX-License-Identifier: Apache-2.0
// The documentation's CUDA example (docs/memory.md: the static and the VMM-backed device cache),
// as written, #included inside a gpu test case after the stream it assumes and before checks on
// the allocator it configured: a sequence's first tokens map pages, and once the sequence is
// released and the allocator trimmed, no block stays in use. The host examples are in
// test_doc_snippets.cpp, which also checks the block count of every listed file.
#include <doctest/doctest.h>

#include "../cuda/cuda_test_utils.cuh"

#include <type_traits>

#include <triattn/core/kv_cache.hpp>
#include <triattn/cuda/backend/vmm_allocator.cuh>
#include <triattn/cuda/device_kv_cache.cuh>

TEST_SUITE("gpu") {
  TEST_CASE("docs/memory.md: the elastic device cache with a memory limit then trim and stats") {
    triattn::test::require_device();
    cudaStream_t stream{};
    TRIATTN_TEST_CUDA(cudaStreamCreate(&stream));
    {
#include "memory_0.inc"
      static_assert(std::is_same_v<Static::allocator_type, triattn::cuda::DeviceAllocator>);
      static_assert(std::is_same_v<Elastic::allocator_type, triattn::cuda::VmmAllocator>);
      CHECK(s.memory_limit == (40ull << 30));
      CHECK(s.blocks_used == 0);
      CHECK(s.bytes_physical <= s.memory_limit);
      const triattn::SeqId seq = cache.add_sequence();
      REQUIRE(cache.extend(seq, 100, triattn::Phase::kPrefill).ok());
      CHECK(mem.stats().blocks_used == 7);  // ceil(100 / 16)
      CHECK(mem.stats().bytes_mapped > 0);
      cache.release(seq);
      mem.trim(stream);
      TRIATTN_TEST_CUDA(cudaStreamSynchronize(stream));
      mem.poll();
      CHECK(mem.stats().blocks_used == 0);
      CHECK(mem.stats().slabs_pending == 0);
    }
    TRIATTN_TEST_CUDA(cudaStreamDestroy(stream));
  }
}
