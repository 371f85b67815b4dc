// SPDX-License-Identifier: Apache-2.0
// Seed-corpus generator for the fuzzers: reads the real calibration files and writes
//   OUT/seeds/{pt,safetensors,pickle}: tiny, small and medium variants (first layers, heads and
//       frequencies of the real statistics), which keep libFuzzer at thousands of runs a second;
//   OUT/full/{safetensors,pickle}: the full real statistics as safetensors and their data.pkl,
//       which run_fuzzers.sh replays once (next to the real .pt files it copies to OUT/full/pt);
//   OUT/seeds/gguf: tiny llama GGUF models (tests/common/gguf_builder.hpp) of 1 and 2 layers and
//       one with a 64-byte alignment (run_fuzzers.sh copies the real SmolLM2 file to OUT/full/gguf).
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include <triattn/core/stats.hpp>

#include "common/gguf_builder.hpp"

namespace {

// The first `layers` layers and `heads` heads with the first `freqs` frequencies of `s`.
triattn::QueryStats shrink(const triattn::QueryStats& s, int layers, int heads, int freqs) {
  triattn::QueryStats out = triattn::slice_query_heads(s, 0, heads);
  triattn::QueryStats small;
  small.model_name = s.model_name;
  small.rope_style = s.rope_style;
  small.num_layers = layers;
  small.num_q_heads = heads;
  small.head_dim = 2 * freqs;
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < heads; ++h)
      for (int f = 0; f < freqs; ++f) {
        small.q_mean_real.push_back(out.mean_real(l, h)[f]);
        small.q_mean_imag.push_back(out.mean_imag(l, h)[f]);
        small.q_abs_mean.push_back(out.abs_mean(l, h)[f]);
      }
  return small;
}

void write(const std::filesystem::path& p, const std::vector<std::uint8_t>& bytes) {
  triattn::detail::write_file_bytes(p.string(), bytes);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: triattn_fuzz_seeds CALIBRATION_DIR OUT_DIR\n");
    return 2;
  }
  try {
    const std::filesystem::path in = argv[1], out = argv[2];
    for (const char* d : {"pt", "safetensors", "pickle", "gguf"}) {
      std::filesystem::create_directories(out / "seeds" / d);
      std::filesystem::create_directories(out / "full" / d);
    }
    for (const char* stem : {"qwen3_8b", "ds_llama8b"}) {
      const auto bytes = triattn::detail::read_file_bytes((in / (std::string(stem) + ".pt")).string());
      const auto stats = triattn::load_pt_stats(std::span<const std::uint8_t>(bytes), stem);
      write(out / "full" / "safetensors" / (std::string(stem) + ".safetensors"),
            triattn::serialize_safetensors_stats(stats));
      const triattn::detail::ZipReader zip(bytes, stem);
      const auto* pkl = zip.find(std::string(stem) + "/data.pkl");
      if (pkl == nullptr) throw triattn::format_error(std::string(stem) + ": no data.pkl");
      const auto p = zip.read(*pkl);
      write(out / "full" / "pickle" / (std::string(stem) + ".pkl"), std::vector<std::uint8_t>(p.begin(), p.end()));
      // Small and medium variants keep executions fast.
      const struct { int layers, heads, freqs; const char* tag; } sizes[] = {{1, 1, 2, "tiny"}, {2, 2, 4, "small"},
                                                                           {2, 8, 64, "medium"}};
      for (const auto& z : sizes) {
        const auto s = shrink(stats, z.layers, z.heads, z.freqs);
        const std::string base = std::string(stem) + "_" + z.tag;
        const auto pt = triattn::serialize_pt_stats(s, base);
        write(out / "seeds" / "pt" / (base + ".pt"), pt);
        write(out / "seeds" / "safetensors" / (base + ".safetensors"), triattn::serialize_safetensors_stats(s));
        const triattn::detail::ZipReader small_zip(pt, base);
        const auto sp = small_zip.read(*small_zip.find(base + "/data.pkl"));
        write(out / "seeds" / "pickle" / (base + ".pkl"), std::vector<std::uint8_t>(sp.begin(), sp.end()));
      }
    }
    for (int layers : {1, 2}) {
      triattn::test::GgufBuilder b = triattn::test::tiny_llama_gguf(layers);
      const std::vector<std::byte> g = b.build();
      const auto* p = reinterpret_cast<const std::uint8_t*>(g.data());
      write(out / "seeds" / "gguf" / ("tiny_llama_" + std::to_string(layers) + ".gguf"),
            std::vector<std::uint8_t>(p, p + g.size()));
    }
    {
      triattn::test::GgufBuilder b = triattn::test::tiny_llama_gguf(1);
      b.kv_u32("general.alignment", 64);
      b.alignment = 64;
      const std::vector<std::byte> g = b.build();
      const auto* p = reinterpret_cast<const std::uint8_t*>(g.data());
      write(out / "seeds" / "gguf" / "tiny_llama_align64.gguf", std::vector<std::uint8_t>(p, p + g.size()));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "triattn_fuzz_seeds: %s\n", e.what());
    return 1;
  }
}
