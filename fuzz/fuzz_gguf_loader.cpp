// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: arbitrary bytes into the GGUF reader, the llama model mapping and the BPE
// tokenizer of the reference transformer (examples/reference_transformer/gguf*.hpp,
// bpe_tokenizer.hpp). A triattn::error whose message starts with the file name is the expected
// outcome for bad input; any other exception, a crash, a sanitizer report, an error message
// without the file name, or a loaded model / tokenizer that breaks its invariants (the file's
// tensors not tiling its data section, a non-finite weight, metadata over its memory bound) is a
// finding.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <triattn/core/error.hpp>

#include <reference_transformer/bpe_tokenizer.hpp>
#include <reference_transformer/gguf.hpp>
#include <reference_transformer/gguf_llama.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  constexpr std::string_view kName = "fuzz.gguf";
  namespace ex = triattn_example;
  try {
    const ex::gguf::File f = ex::gguf::File::parse(
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size), std::string(kName));
    // The metadata stayed within its memory bound.
    if (f.metadata_memory() > ex::gguf::kMetadataMemoryFactor * size + ex::gguf::kMetadataMemorySlack) __builtin_trap();
    // Every tensor lies inside the file, the tensors tile the data section (each span at most its
    // bytes padded to the alignment), and a tensor dequantises to finite values only.
    std::vector<const ex::gguf::TensorInfo*> by_offset;
    for (const ex::gguf::TensorInfo& t : f.tensors()) {
      if (f.data_offset() + t.offset + t.n_bytes > f.file_size()) __builtin_trap();
      by_offset.push_back(&t);
      if (t.n_elements > (1u << 20)) continue;
      for (float v : f.dequantize(t))
        if (!std::isfinite(v)) __builtin_trap();
    }
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
    const std::uint64_t a = f.alignment();
    for (std::size_t k = 0; k < by_offset.size(); ++k) {
      const std::uint64_t end = k + 1 < by_offset.size() ? by_offset[k + 1]->offset : f.file_size() - f.data_offset();
      const std::uint64_t padded = (by_offset[k]->n_bytes + a - 1) / a * a;
      if ((k == 0 && by_offset[k]->offset != 0) || end - by_offset[k]->offset > padded) __builtin_trap();
    }
    if (f.has("general.architecture")) {
      const ex::ModelWeights w = ex::gguf_llama_weights(f);
      w.validate();  // throws logic_error (a finding) when the loader let a bad shape through
    }
    if (f.has("tokenizer.ggml.model")) {
      const ex::BpeTokenizer tok = ex::BpeTokenizer::from_gguf(f);
      const std::string text = "<|im_start|>user\nHello, world 2026! caf\xC3\xA9 \xFF<|im_end|>\n";
      for (int id : tok.encode(text))
        if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
    }
  } catch (const triattn::format_error& e) {
    if (std::string_view(e.what()).substr(0, kName.size()) != kName) __builtin_trap();
  }
  return 0;
}
