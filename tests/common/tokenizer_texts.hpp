// SPDX-License-Identifier: Apache-2.0
// Texts that stress the BPE tokenizer, shared by tests/core/test_bpe_tokenizer.cpp and
// benchmarks/bench_ref_tokenizer.cpp. Test-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>

#include <reference_transformer/bpe_tokenizer.hpp>

namespace triattn::test {

/// `n` codepoints of CJK ideographs (U+4E00..U+9FFF, all \p{L}: one pre-tokenized word), seeded.
inline std::string cjk_run(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::uint32_t> cp(0x4E00, 0x9FFF);
  std::string s;
  for (std::size_t i = 0; i < n; ++i) triattn_example::unicode::append_utf8(s, cp(rng));
  return s;
}

}  // namespace triattn::test
